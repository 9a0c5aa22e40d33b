"""Evaluating trained runs: one run or an ensemble on a protocol, and the table of many runs' stored numbers."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from retr.common.devices import float32_arithmetic, resolve_device
from retr.common.errors import UserError
from retr.trainers.evaluation import coco_extended
from retr.trainers.evaluation.metrics import protocol_metrics
from retr.trainers.evaluation.similarity import DEFAULT_PRECISION, Scorer, SplitEmbeddings, combined_matrix
from retr.trainers.runs import checkpoint as ckpt
from retr.trainers.data.splits import ImageFeatures
from retr.trainers.runs.split import open_run_split
from retr.trainers.runs.layout import EVAL
from retr.manifests.schema import read_manifest
from retr.trainers.evaluation.two_step import two_step_protocol


def evaluate_runs(runs: list[str], protocol: str, split: str = "test", features: str | None = None,
                  manifest: str | None = None, device: str = "auto", precision: str = DEFAULT_PRECISION,
                  which: str = "best", preload: bool | None = None, quiet: bool = False,
                  trust_checkpoint: bool = False, allow_size_mismatch: bool = False, ties: str = "pessimistic",
                  tf32: bool = False, extended: bool = False):
    """Score ``split`` with every run, average the similarity matrices (ensemble) and apply ``protocol``.

    Returns ``(result dict, sims [N_img, M] float64)``. Every run's embeddings are kept until the end, so that
    ``refined`` precision can rescore near-ties of the *averaged* matrix in float64. On CUDA the float32 work is
    exact unless ``tf32`` (:func:`~retr.common.devices.float32_arithmetic`); the result records ``tf32`` as what
    ran (True only on CUDA). ``extended``: also ECCV Caption, CxC and COCO 1K/5K as eccv_caption computes them
    (:mod:`~retr.trainers.evaluation.coco_extended`), in ``result["extended"]``; its inputs (the package, the
    protocol, the manifest's caption ids) are checked before any run is opened."""
    coco = extended_inputs(runs, protocol, split, manifest) if extended else None
    dev = resolve_device(device)
    with float32_arithmetic(tf32):
        result, sims = _evaluate_runs(runs, protocol, split, features, manifest, dev, precision, which, preload,
                                      quiet, trust_checkpoint, allow_size_mismatch, ties, coco)
    result["tf32"] = bool(tf32 and dev.type == "cuda")
    return result, sims


def extended_inputs(runs: list[str], protocol: str, split: str, manifest: str | None):
    """``(annotations, ids)`` for ``--extended``, every check done (one line each): a COCO protocol, one matrix (not
    a two-step run alone), the eccv-caption package and its files, the manifest's caption ids, and the split being
    the COCO 5K test set."""
    coco_extended.check_protocol(protocol)
    settings = [ckpt.read_settings(run) for run in runs]
    if len(runs) == 1:
        if getattr(settings[0].model_config, "shortlist", 0):
            raise UserError("--extended ranks one similarity matrix; a two-step run re-ranks a shortlist per "
                            "direction (evaluate it in an ensemble, or without --extended)")
    annotations = coco_extended.load_annotations()
    manifest = manifest or settings[0].manifest
    if not manifest:
        raise UserError(f"{runs[0]} does not record its manifest (an export or an imported run); pass --manifest")
    ids = coco_extended.ids_from_records(read_manifest(manifest, splits=[split]), manifest, split)
    coco_extended.check_test_set(annotations, ids)
    return annotations, ids


def add_extended(result: dict, sims: np.ndarray, annotations, ids, ties: str) -> None:
    """``result["extended"]``: every number of :data:`~retr.trainers.evaluation.coco_extended.METRIC_NAMES` for
    ``sims`` (percent), and which annotations counted them (``extended_annotations``)."""
    result["extended"] = coco_extended.extended_metrics(sims, ids, annotations, ties)
    result["extended_annotations"] = f"{coco_extended.PACKAGE} {annotations.version}"


def _evaluate_runs(runs, protocol, split, features, manifest, dev, precision, which, preload, quiet,
                   trust_checkpoint, allow_size_mismatch, ties, coco):
    reference, models, scorers = None, [], []
    for run in runs:
        opened = open_run_split(run, split, features, manifest, which, dev, trust_checkpoint)
        model, settings, feature_set, data = opened.model, opened.settings, opened.features, opened.data
        feats_path = opened.features_path
        key = (data.image_ids, data.captions)
        if reference is not None and key != reference:
            raise UserError(f"{run} sees other images/captions than {runs[0]}; an ensemble needs the same split")
        reference = key
        # each image is read once (encoded once): held in memory, the set would only add itself to the peak
        image_features = ImageFeatures(feature_set, data.image_ids, "off" if preload is None else preload)
        if model.shortlist and len(runs) == 1:   # two-step models (MatchingModel.shortlist > 0), see two_step.py
            if ties != "pessimistic":
                raise UserError("--ties official applies to one-step scoring; a two-step run ranks its shortlists")
            result = two_step_protocol(model, data, image_features, protocol, dev, model.shortlist, precision,
                                       allow_size_mismatch=allow_size_mismatch, quiet=quiet)
            result.update({k: result["two_step"][k] for k in ("i2t", "t2i", "rsum")}, protocol=protocol,
                          split=split, ensemble=False, runs=[str(run)], precision=precision,
                          models=[{"run": str(run), "model": settings.model, "direction": None,
                                   "features": str(feats_path),
                                   "checkpoint": ckpt.resolve_checkpoint(run, which).name}],
                          evaluated=datetime.now(timezone.utc).isoformat(timespec="seconds"))
            return result, None
        scorers.append(Scorer(model, SplitEmbeddings.encode(model, data, image_features, dev, quiet=quiet)))
        del image_features                   # read once: features held in memory are let go before scoring
        models.append({"run": str(run), "model": settings.model,
                       "direction": getattr(settings.model_config, "direction", None), "features": str(feats_path),
                       "checkpoint": ckpt.resolve_checkpoint(run, which).name})
    stats: dict = {}
    positives = None
    if coco is not None:
        annotations, ids = coco
        if data.image_ids != ids.image_keys or data.num_captions != len(ids.caption_ids):
            raise UserError(f"the evaluated {split} split is not the manifest's any more ({ids.source})")
        # refined: the extended positives' places are float64's too, not only the pairs COCO's ranks depend on
        positives = coco_extended.positive_pairs(ids, annotations)
    sims = combined_matrix(scorers, precision, data.caption_image, quiet=quiet, stats=stats, positives=positives,
                           release=True)   # the embeddings go before the float64 matrix is made
    result = protocol_metrics(sims, data, protocol, allow_size_mismatch, ties)
    if coco is not None:
        add_extended(result, sims, annotations, ids, ties)
    result.update(protocol=protocol, split=split, ensemble=len(runs) > 1, runs=[str(r) for r in runs],
                  models=models, precision=precision, **({"refinement": stats} if stats else {}),
                  evaluated=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return result, sims


def write_sims(path: str, sims: np.ndarray, result: dict, manifest: str, split: str) -> None:
    """``path`` (``.npy``): the float64 similarities ``[images, captions]`` in manifest order, and beside it
    ``path.ids.json``: the image ids (rows) and caption keys ``<image id>#<n>`` (columns) they belong to, and the
    columns' COCO caption ids (``caption_ids``, null where the manifest has none) when the manifest has any."""
    records = read_manifest(manifest, splits=[split])
    ids = {"image_ids": [r.id for r in records],
           "caption_keys": [f"{r.id}#{n}" for r in records for n in range(len(r.captions))],
           "protocol": result["protocol"], "split": split, "runs": result["runs"]}
    if any(r.caption_ids is not None for r in records):
        ids["caption_ids"] = [None if r.caption_ids is None else r.caption_ids[n]
                              for r in records for n in range(len(r.captions))]
    if (len(ids["image_ids"]), len(ids["caption_keys"])) != sims.shape:
        raise UserError(f"--save-sims: the manifest's {split} split no longer matches the evaluated matrix")
    path = path if str(path).endswith(".npy") else f"{path}.npy"       # np.save's own rule
    np.save(path, np.asarray(sims, dtype=np.float64))     # no copy of a float64 matrix
    ckpt.write_json(f"{path}.ids.json", ids)


def record_result(run: str, result: dict) -> None:
    path = Path(run) / EVAL
    existing = json.loads(path.read_text()) if path.is_file() else {"results": []}
    keep = [r for r in existing.get("results", []) if (r["protocol"], r["split"], r["runs"])
            != (result["protocol"], result["split"], result["runs"])]
    ckpt.write_json(path, {"results": keep + [result]})


METRIC_COLUMNS = [("i2t", "r1"), ("i2t", "r5"), ("i2t", "r10"), ("t2i", "r1"), ("t2i", "r5"), ("t2i", "r10")]
#: ``table --extended``'s numbers: each of ``TABLE_METRICS`` i2t, then t2i
EXTENDED_COLUMNS = [(name, d) for name in coco_extended.TABLE_METRICS for d in ("i2t", "t2i")]


#: appended to the protocol of a stored result whose split did not have the protocol's size
MISMATCH_MARK = "*"


def table_rows(runs, extended: bool = False) -> tuple[list[str], list[list], list[str]]:
    """(header, rows, notes) of every result stored in the runs' ``eval.json``, one row per (protocol, split, run
    set): run name(s), model(s), preset, seed, protocol, split, single/ensemble, the six recalls and rSum (floats).
    A result evaluated with ``--allow-size-mismatch`` on a split of another size has its protocol marked
    :data:`MISMATCH_MARK`, and a note says what was evaluated instead (one note for the runs it is the same for).
    ``extended``: only the results evaluated with ``--extended``, their ECCV Caption and CxC numbers instead of the
    recalls (:data:`~retr.trainers.evaluation.coco_extended.TABLE_METRICS`, i2t then t2i each)."""
    rows, seen = [], set()
    mismatched: dict[str, list[str]] = {}
    for run in runs:
        path = Path(run) / EVAL
        if not path.is_file():
            raise UserError(f"{run} has no {EVAL}; run `retr-train eval {run} --protocol …` first")
        for r in json.loads(path.read_text()).get("results", []):
            key = (r["protocol"], r["split"], tuple(r["runs"]))
            if key in seen or (extended and "extended" not in r):
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
            numbers = ([float(r["extended"][name][d]) for name, d in EXTENDED_COLUMNS] if extended else
                       [*(float(r[d][k]) for d, k in METRIC_COLUMNS), float(r["rsum"])])
            rows.append([names, models, "+".join(sorted({str(c.get("preset") or "-") for c in configs})),
                         "+".join(sorted({str(c.get("seed", "-")) for c in configs})),
                         protocol, r["split"], f"ensemble of {len(r['runs'])}" if r["ensemble"] else "single",
                         *numbers])
    if extended and not rows:
        raise UserError(f"no result stored in the {EVAL} of {', '.join(map(str, runs))} has ECCV Caption and "
                        "CxC numbers; run `retr-train eval RUN --protocol coco-5k --extended` first")
    header = ["run", "model", "preset", "seed", "protocol", "split", "kind"]
    header += ([f"{d} {coco_extended.METRIC_LABELS[name]}" for name, d in EXTENDED_COLUMNS] if extended else
               ["i2t R@1", "i2t R@5", "i2t R@10", "t2i R@1", "t2i R@5", "t2i R@10", "rSum"])
    notes = [f"{MISMATCH_MARK} {', '.join(runs)}: {what}" for what, runs in mismatched.items()]
    return header, rows, notes


def has_extended(runs) -> bool:
    """Whether a result stored in the runs' ``eval.json`` has ECCV Caption and CxC numbers."""
    for run in runs:
        path = Path(run) / EVAL
        if path.is_file() and any("extended" in r for r in json.loads(path.read_text()).get("results", [])):
            return True
    return False


def _config_or_empty(run: str) -> dict:
    try:
        return ckpt.read_config(run)
    except UserError:            # an ensemble member moved away since: the row still prints
        return {}
