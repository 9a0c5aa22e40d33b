"""Evaluating trained runs: one run or an ensemble on a protocol, and the table of many runs' stored numbers."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from retr.common.devices import float32_arithmetic, resolve_device
from retr.common.errors import UserError
from retr.trainers.evaluation.metrics import protocol_metrics
from retr.trainers.evaluation.similarity import DEFAULT_PRECISION, Scorer, SplitEmbeddings, combined_matrix
from retr.trainers.runs import checkpoint as ckpt
from retr.trainers.data.splits import ImageFeatures
from retr.trainers.runs.split import open_run_split


def evaluate_runs(runs: list[str], protocol: str, split: str = "test", features: str | None = None,
                  manifest: str | None = None, device: str = "auto", precision: str = DEFAULT_PRECISION,
                  which: str = "best", preload: bool | None = None, quiet: bool = False,
                  trust_checkpoint: bool = False, allow_size_mismatch: bool = False, ties: str = "pessimistic",
                  tf32: bool = False):
    """Score ``split`` with every run, average the similarity matrices (ensemble) and apply ``protocol``.

    Returns ``(result dict, sims [N_img, M] float64)``. Every run's embeddings are kept until the end, so that
    ``refined`` precision can rescore near-ties of the *averaged* matrix in float64. On CUDA the float32 work is
    exact unless ``tf32`` (:func:`~retr.common.devices.float32_arithmetic`); the result records ``tf32`` as what
    ran (True only on CUDA)."""
    dev = resolve_device(device)
    with float32_arithmetic(tf32):
        result, sims = _evaluate_runs(runs, protocol, split, features, manifest, dev, precision, which, preload,
                                      quiet, trust_checkpoint, allow_size_mismatch, ties)
    result["tf32"] = bool(tf32 and dev.type == "cuda")
    return result, sims


def _evaluate_runs(runs, protocol, split, features, manifest, dev, precision, which, preload, quiet,
                   trust_checkpoint, allow_size_mismatch, ties):
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
                                       allow_size_mismatch=allow_size_mismatch, quiet=quiet)
            result.update({k: result["two_step"][k] for k in ("i2t", "t2i", "rsum")}, protocol=protocol,
                          split=split, ensemble=False, runs=[str(run)], precision=precision,
                          models=[{"run": str(run), "model": config["model"], "direction": None,
                                   "features": str(feats_path),
                                   "checkpoint": ckpt.resolve_checkpoint(run, which).name}],
                          evaluated=datetime.now(timezone.utc).isoformat(timespec="seconds"))
            return result, None
        scorers.append(Scorer(model, SplitEmbeddings.encode(model, data, image_features, dev, quiet=quiet)))
        del image_features                   # read once: features held in memory are let go before scoring
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


def write_sims(path: str, sims: np.ndarray, result: dict, manifest: str, split: str) -> None:
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


def record_result(run: str, result: dict) -> None:
    path = Path(run) / ckpt.EVAL
    existing = json.loads(path.read_text()) if path.is_file() else {"results": []}
    keep = [r for r in existing.get("results", []) if (r["protocol"], r["split"], r["runs"])
            != (result["protocol"], result["split"], result["runs"])]
    ckpt.write_json(path, {"results": keep + [result]})


METRIC_COLUMNS = [("i2t", "r1"), ("i2t", "r5"), ("i2t", "r10"), ("t2i", "r1"), ("t2i", "r5"), ("t2i", "r10")]


#: appended to the protocol of a stored result whose split did not have the protocol's size
MISMATCH_MARK = "*"


def table_rows(runs) -> tuple[list[str], list[list], list[str]]:
    """(header, rows, notes) of every result stored in the runs' ``eval.json``, one row per (protocol, split, run
    set): run name(s), model(s), preset, seed, protocol, split, single/ensemble, the six recalls and rSum (floats).
    A result evaluated with ``--allow-size-mismatch`` on a split of another size has its protocol marked
    :data:`MISMATCH_MARK`, and a note says what was evaluated instead (one note for the runs it is the same for)."""
    rows, seen = [], set()
    mismatched: dict[str, list[str]] = {}
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
            names = "+".join(Path(m["run"]).name for m in r["models"])
            models = "+".join(m["model"] + (f"({m['direction']})" if m.get("direction") else "") for m in r["models"])
            protocol = r["protocol"]
            if mismatch := r.get("size_mismatch"):
                protocol += MISMATCH_MARK
                what = (f"{r['protocol']} on a {r['split']} split of {mismatch['images']:,} images, not the "
                        f"protocol's {mismatch['expected']:,} (--allow-size-mismatch): not comparable with published "
                        "numbers")
                mismatched.setdefault(what, []).append(names)
            rows.append([names, models, "+".join(sorted({str(c.get("preset") or "-") for c in configs})),
                         "+".join(sorted({str(c.get("seed", "-")) for c in configs})),
                         protocol, r["split"], f"ensemble of {len(r['runs'])}" if r["ensemble"] else "single",
                         *(float(r[d][k]) for d, k in METRIC_COLUMNS), float(r["rsum"])])
    header = ["run", "model", "preset", "seed", "protocol", "split", "kind",
              "i2t R@1", "i2t R@5", "i2t R@10", "t2i R@1", "t2i R@5", "t2i R@10", "rSum"]
    notes = [f"{MISMATCH_MARK} {', '.join(runs)}: {what}" for what, runs in mismatched.items()]
    return header, rows, notes


def _config_or_empty(run: str) -> dict:
    try:
        return ckpt.read_config(run)
    except UserError:            # an ensemble member moved away since: the row still prints
        return {}
