"""``retr-train eval`` (single runs and ensembles), ``retr-train table`` and ``retr-train import-scan-checkpoint``."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import click
import numpy as np
import torch

from retr.common.cli import quiet_option
from retr.common.errors import UserError
from retr.trainers.training import checkpoint as ckpt
from retr.trainers.training.data import ImageFeatures, open_run_split
from retr.trainers.evaluation.metrics import PROTOCOLS, TIE_RULES, protocol_metrics
from retr.trainers.evaluation.similarity import DEFAULT_PRECISION, PRECISIONS, Scorer, SplitEmbeddings, combined_matrix
from retr.common.devices import resolve_device


def evaluate_runs(runs: list[str], protocol: str, split: str = "test", features: str | None = None,
                  manifest: str | None = None, device: str = "auto", precision: str = DEFAULT_PRECISION,
                  which: str = "best", preload: bool | None = None, quiet: bool = False,
                  trust_checkpoint: bool = False, allow_size_mismatch: bool = False, ties: str = "pessimistic"):
    """Score ``split`` with every run, average the similarity matrices (ensemble) and apply ``protocol``.

    Returns ``(result dict, sims [N_img, M] float64)``. Every run's embeddings are kept until the end, so that
    ``refined`` precision can rescore near-ties of the *averaged* matrix in float64.
    """
    dev = resolve_device(device)
    reference, models, scorers = None, [], []
    for run in runs:
        opened = open_run_split(run, split, features, manifest, which, dev, trust_checkpoint)
        model, config, feature_set, data = opened.model, opened.config, opened.features, opened.data
        feats_path = opened.features_path
        key = (data.image_ids, data.captions)
        if reference is not None and key != reference:
            raise UserError(f"{run} sees other images/captions than {runs[0]}; an ensemble needs the same split")
        reference = key
        image_features = ImageFeatures(feature_set, data.image_ids, preload)
        if model.shortlist and len(runs) == 1:   # two-step models (MatchingModel.shortlist > 0), see two_step.py
            from retr.trainers.evaluation.two_step import two_step_protocol
            if ties != "pessimistic":
                raise UserError("--ties official applies to one-step scoring; a two-step run ranks its shortlists")
            result = two_step_protocol(model, data, image_features, protocol, dev, model.shortlist, precision,
                                       allow_size_mismatch=allow_size_mismatch)
            result.update({k: result["two_step"][k] for k in ("i2t", "t2i", "rsum")}, protocol=protocol,
                          split=split, ensemble=False, runs=[str(run)], precision=precision,
                          models=[{"run": str(run), "model": config["model"], "direction": None,
                                   "features": str(feats_path),
                                   "checkpoint": ckpt.resolve_checkpoint(run, which).name}],
                          evaluated=datetime.now(timezone.utc).isoformat(timespec="seconds"))
            return result, None
        scorers.append(Scorer(model, SplitEmbeddings.encode(model, data, image_features, dev, quiet=quiet)))
        models.append({"run": str(run), "model": config["model"],
                       "direction": config["model_args"].get("direction"), "features": str(feats_path),
                       "checkpoint": ckpt.resolve_checkpoint(run, which).name})
    stats: dict = {}
    sims = combined_matrix(scorers, precision, data.caption_image, quiet=quiet, stats=stats)
    result = protocol_metrics(sims, data, protocol, allow_size_mismatch, ties)
    result.update(protocol=protocol, split=split, ensemble=len(runs) > 1, runs=[str(r) for r in runs],
                  models=models, precision=precision, **({"refinement": stats} if stats else {}),
                  evaluated=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return result, sims


def _save_sims(path: str, sims: np.ndarray, result: dict, manifest: str, split: str) -> None:
    """``path`` (``.npy``): the float64 similarities ``[images, captions]`` in manifest order, and beside it
    ``path.ids.json``: the image ids (rows) and caption keys ``<image id>#<n>`` (columns) they belong to."""
    from retr.manifests.schema import read_manifest

    records = read_manifest(manifest, splits=[split])
    ids = {"image_ids": [r.id for r in records],
           "caption_keys": [f"{r.id}#{n}" for r in records for n in range(len(r.captions))],
           "protocol": result["protocol"], "split": split, "runs": result["runs"]}
    if (len(ids["image_ids"]), len(ids["caption_keys"])) != sims.shape:
        raise UserError(f"--save-sims: the manifest's {split} split no longer matches the evaluated matrix")
    path = path if str(path).endswith(".npy") else f"{path}.npy"       # np.save's own rule
    np.save(path, sims.astype(np.float64))
    ckpt.write_json(f"{path}.ids.json", ids)


def _record(run: str, result: dict) -> None:
    path = Path(run) / ckpt.EVAL
    existing = json.loads(path.read_text()) if path.is_file() else {"results": []}
    keep = [r for r in existing.get("results", []) if (r["protocol"], r["split"], r["runs"])
            != (result["protocol"], result["split"], result["runs"])]
    ckpt.write_json(path, {"results": keep + [result]})


def _line(side: str, m: dict) -> str:
    return (f"{side}: R@1 {m['r1']:.1f}  R@5 {m['r5']:.1f}  R@10 {m['r10']:.1f}  "
            f"medr {m['medr']:.1f}  meanr {m['meanr']:.1f}")


@click.command("eval")
@click.argument("runs", nargs=-1, required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--protocol", type=click.Choice(PROTOCOLS), required=True,
              help="f30k-1k / coco-5k: the split as given; coco-1k: five equal folds in file order, averaged; "
                   "coco-1k-first: the first fold alone (SEAM's Table 3).")
@click.option("--split", default="test", show_default=True)
@click.option("--features", type=click.Path(dir_okay=False), default=None, help="Override the run's feature set.")
@click.option("--manifest", type=click.Path(dir_okay=False), default=None, help="Override the run's manifest.")
@click.option("--checkpoint", "which", default="best", show_default=True, help="best, last, or a file in the run.")
@click.option("--precision", type=click.Choice(PRECISIONS), default=DEFAULT_PRECISION, show_default=True,
              help="refined: float32 scoring, then float64 for every pair whose rank rounding could change "
                   "(every rank, so every metric, equals float64's); float64: everything in float64 (full "
                   "orderings too); float32: one pass.")
@click.option("--device", default="auto", show_default=True)
@click.option("--preload/--no-preload", default=None)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with every number.")
@click.option("--save-sims", type=click.Path(dir_okay=False), default=None,
              help="Write the images × captions similarities (float64 .npy, manifest order) and FILE.ids.json "
                   "(the image ids of the rows, the caption keys of the columns).")
@click.option("--ties", type=click.Choice(TIE_RULES), default="pessimistic", show_default=True,
              help="pessimistic: a tie counts against the query; official: the authors' argsort order (gives an "
                   "imported official checkpoint its official numbers when identical captions tie).")
@click.option("--allow-size-mismatch", is_flag=True,
              help="Evaluate a split whose size is not the protocol's (1,000 Flickr30K / 5,000 COCO test images), "
                   "e.g. the synthetic data; recorded in the result.")
@click.option("--trust-checkpoint", is_flag=True,
              help="Read checkpoints that hold Python objects besides tensors (they can run code: only for files "
                   "you trust).")
@quiet_option
def eval_command(runs, protocol, split, features, manifest, which, precision, device, preload, as_json,
                 save_sims, ties, allow_size_mismatch, trust_checkpoint, quiet) -> None:
    """Evaluate one run, or an ensemble of runs (their similarity matrices averaged).

    The result is also stored in each run's eval.json.

    \b
    Example:
      retr-train eval runs/scan-f30k --protocol f30k-1k
      retr-train eval runs/scan-coco-t2i runs/scan-coco-i2t --protocol coco-1k --json
    """
    result, sims = evaluate_runs(list(runs), protocol, split, features, manifest, device, precision, which,
                                 preload, quiet, trust_checkpoint=trust_checkpoint,
                                 allow_size_mismatch=allow_size_mismatch, ties=ties)
    if save_sims and sims is None:
        raise UserError("--save-sims: a two-step run has no single similarity matrix (one per direction)")
    if save_sims:
        _save_sims(save_sims, sims, result, manifest or ckpt.read_config(runs[0]).get("manifest"), split)
    for run in runs:
        _record(run, result)
    if as_json:
        click.echo(json.dumps(result))
        return
    kind = f"ensemble of {len(runs)} runs (averaged similarities)" if len(runs) > 1 else "single model"
    click.echo(f"{protocol} on {split} ({result['images']} images, {result['captions']} captions) — {kind}: "
               f"{', '.join(runs)}")
    if result.get("size_mismatch"):
        m = result["size_mismatch"]
        click.echo(f"note: {protocol} expects {m['expected']} images, this split has {m['images']} "
                   "(--allow-size-mismatch): not the protocol's numbers")
    if protocol == "coco-1k":
        click.echo("mean over 5 folds:")
    if protocol == "coco-1k-first":
        click.echo("first 1K fold only:")
    click.echo(_line("image→text (i2t)", result["i2t"]))
    click.echo(_line("text→image (t2i)", result["t2i"]))
    click.echo(f"rsum: {result['rsum']:.1f}  (ties: {result.get('ties', 'pessimistic')})")
    if "refinement" in result:
        r = result["refinement"]
        click.echo(f"precision refined: {r['rescored_pairs']} pairs ({100 * r['rescored_fraction']:.2f}%) rescored "
                   f"in float64 (margin {r['margin']:.2g}); every rank is the float64 one")
    if "two_step" in result:
        sec = result["seconds"]
        click.echo(f"two-step (shortlist {result['shortlist']}, re-ranked by the pair score) above; "
                   f"one-step (global score only): rsum {result['one_step']['rsum']:.1f}, "
                   f"i2t R@1 {result['one_step']['i2t']['r1']:.1f}, t2i R@1 {result['one_step']['t2i']['r1']:.1f}; "
                   f"seconds: one-step {sec['one_step']:.2f}, two-step {sec['two_step']:.2f}")


TABLE_FORMATS = {"text": "simple", "markdown": "github", "latex": "latex_booktabs", "csv": None}
METRIC_COLUMNS = [("i2t", "r1"), ("i2t", "r5"), ("i2t", "r10"), ("t2i", "r1"), ("t2i", "r5"), ("t2i", "r10")]


def table_rows(runs) -> tuple[list[str], list[list]]:
    """(header, rows) of every result stored in the runs' ``eval.json``, one row per (protocol, split, run set):
    run name(s), model(s), preset, seed, protocol, split, single/ensemble, the six recalls and rSum (floats)."""
    rows, seen = [], set()
    for run in runs:
        path = Path(run) / ckpt.EVAL
        if not path.is_file():
            raise UserError(f"{run} has no {ckpt.EVAL}; run `retr-train eval {run} --protocol …` first")
        for r in json.loads(path.read_text()).get("results", []):
            key = (r["protocol"], r["split"], tuple(r["runs"]))
            if key in seen:
                continue
            seen.add(key)
            configs = [_config_or_empty(m["run"]) for m in r["models"]]
            models = "+".join(m["model"] + (f"({m['direction']})" if m.get("direction") else "") for m in r["models"])
            rows.append(["+".join(Path(m["run"]).name for m in r["models"]), models,
                         "+".join(sorted({str(c.get("preset") or "-") for c in configs})),
                         "+".join(sorted({str(c.get("seed", "-")) for c in configs})),
                         r["protocol"], r["split"], f"ensemble of {len(r['runs'])}" if r["ensemble"] else "single",
                         *(float(r[d][k]) for d, k in METRIC_COLUMNS), float(r["rsum"])])
    header = ["run", "model", "preset", "seed", "protocol", "split", "kind",
              "i2t R@1", "i2t R@5", "i2t R@10", "t2i R@1", "t2i R@5", "t2i R@10", "rSum"]
    return header, rows


def _config_or_empty(run: str) -> dict:
    try:
        return ckpt.read_config(run)
    except UserError:            # an ensemble member moved away since: the row still prints
        return {}


@click.command("table")
@click.argument("runs", nargs=-1, required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--format", "fmt", type=click.Choice(list(TABLE_FORMATS)), default="text", show_default=True,
              help="text: aligned columns; markdown: a GitHub table; latex: a booktabs tabular; csv: full precision.")
def table_command(runs, fmt) -> None:
    """Print one table of every result stored in the runs' eval.json: which run (name, model, preset, seed),
    which protocol and split, single or ensemble, R@1/5/10 both ways and rSum.

    \b
    Example:
      retr-train table runs/scan-f30k runs/vsepp-f30k
      retr-train table runs/vsepp-s* --format markdown
    """
    from tabulate import tabulate

    header, rows = table_rows(runs)
    if fmt == "csv":
        import csv
        import io

        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerows([header, *rows])
        click.echo(buffer.getvalue(), nl=False)
        return
    click.echo(tabulate(rows, headers=header, tablefmt=TABLE_FORMATS[fmt], floatfmt=".1f"))
