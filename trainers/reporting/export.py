"""A trained run as a self-contained, pickle-free model folder (``retr-train export``), the way the ecosystem shares
models: ``model.safetensors`` (the chosen checkpoint's weights), ``config.json`` (the model and its settings, the
vocabulary's digest, the feature provenance the weights expect), ``vocab.json``, and a ``README.md`` model card in
the Hugging Face Hub's format (a YAML header, then the run's evaluation table, the reproduction verdict where a
``reproduce`` report names the run, the features it needs and how to load it).

Every command that takes a run takes such a folder (:func:`retr.trainers.runs.checkpoint.load_run_model` reads
its weights with safetensors: no pickle), with ``--features``/``--manifest`` given, since an export records no
local path."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
from pathlib import Path

from tabulate import tabulate
import safetensors.torch

from retr.common.errors import UserError
from retr.common.hashing import sha256_file
from retr.common.version import __version__
from retr.trainers.runs import checkpoint as ckpt
from retr.trainers.runs.layout import CONFIG, EVAL, VOCAB, WEIGHTS
from retr.extractors.recorded import extract_arguments
from retr.store.features import FeatureSet
from retr.trainers.evaluation.runs import has_extended, table_rows
from retr.trainers.models import get_spec

#: the version of the export layout ``config.json`` records (``export.format_version``)
FORMAT_VERSION = 1
#: the files of an export
CARD = "README.md"
#: the feature-set attributes an export records: what a user must extract again for the weights to apply
PROVENANCE_ATTRS = ("kind", "extractor", "backbone", "weights", "weights_sha256", "image_size", "short_side",
                    "max_side", "post_nms_topk", "pooled_size", "source")
#: run settings that describe where and how the run was trained, not the model: not carried into an export
LOCAL_SETTINGS = ("features", "manifest", "out", "inputs", "paths_from_run", "device", "workers", "preload",
                  "optimizer_impl", "compile", "log", "wandb_project", "wandb_name", "environment")


def check_export_target(out: str | os.PathLike) -> Path:
    """``out`` when an export may be written there: absent, or an empty folder (one line otherwise)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a new folder for the export")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"--out {out} is not empty; give a new folder for the export (nothing is overwritten)")
    return out


def export_run(run: str | os.PathLike, out: str | os.PathLike, which: str = "best",
               trust_checkpoint: bool = False) -> Path:
    """Write ``run``'s ``which`` checkpoint (``best``, ``last`` or a file of the run) as an export in ``out``
    (written to ``out.partial`` and renamed when complete); returns ``out``. Every check runs before a file is
    written."""
    run, out = Path(run), check_export_target(out)
    if ckpt.is_export(run):
        raise UserError(f"{run} is an export already; copy the folder to share it")
    config = ckpt.read_config(run)                     # one line unless it is a run
    source = ckpt.resolve_checkpoint(run, which)
    if not source.is_file():
        raise UserError(f"{run} has no checkpoint {source.name} to export (train it first, or --checkpoint last)")
    model, vocab, _ = ckpt.load_run_model(run, which, "cpu", trust=trust_checkpoint)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        safetensors.torch.save_model(model, str(staging / WEIGHTS),
                                     metadata={"format": "pt", "retr_model": config["model"]})
        vocab.save(staging / VOCAB)
        # safetensors writes its file 0600; give it the mode the process gives new files (the others' here)
        os.chmod(staging / WEIGHTS, stat.S_IMODE((staging / VOCAB).stat().st_mode))
        exported = export_config(run, config, source, staging)
        ckpt.write_json(staging / CONFIG, exported)
        (staging / CARD).write_text(model_card(run, exported), encoding="utf-8")
        if out.is_dir():
            out.rmdir()                               # empty: checked above
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def export_config(run: Path, config: dict, source: Path, folder: Path) -> dict:
    """The export's ``config.json``: the run's settings without its local paths and machine settings
    (:data:`LOCAL_SETTINGS`), and ``export``: the layout version, retr's version, the source checkpoint's name
    and SHA-256, the vocabulary's SHA-256, the feature provenance and the run's data identity."""
    kept = {k: v for k, v in config.items() if k not in LOCAL_SETTINGS}
    kept.update(features="", manifest="", inputs={})
    kept["export"] = {"format_version": FORMAT_VERSION, "retr_version": __version__, "run": run.resolve().name,
                      "checkpoint": source.name, "checkpoint_sha256": sha256_file(source),
                      "weights_sha256": sha256_file(folder / WEIGHTS),
                      "vocab_sha256": sha256_file(folder / VOCAB), "features": feature_provenance(config)}
    return kept


def feature_provenance(config: dict) -> dict:
    """What the weights expect of a feature set: ``[K, D]``, the extraction attributes the run's feature set
    records (:data:`PROVENANCE_ATTRS`) and the ``retr-pipeline extract`` arguments that make it again
    (``extract_arguments``: :func:`~retr.extractors.recorded.extract_arguments`; absent for imported features), read
    from it where it is still on disk (else ``D`` alone)."""
    provenance: dict = {"dim": config["model_args"].get("img_dim")}
    path = config.get("features")
    if path and Path(path).is_file():
        features = FeatureSet(path)
        provenance["shape"] = [int(n) for n in features.feature_shape]
        provenance.update({k: _plain(features.attrs[k]) for k in PROVENANCE_ATTRS if k in features.attrs})
        try:
            provenance["extract_arguments"] = extract_arguments(features)
        except UserError:                     # imported, or made before its options were recorded
            pass
    return provenance


def _plain(value):
    """An HDF5 attribute as a JSON value."""
    return value.item() if hasattr(value, "item") else json.loads(json.dumps(value, default=str))


def model_card(run: Path, exported: dict) -> str:
    """The export's ``README.md``: a Hub model card (YAML header: library, tags, metrics), then the evaluation
    table of the run's ``eval.json``, the verdict of a ``reproduce`` report that names the run, the features the
    weights need, how to load them, and the model's settings."""
    name, model = exported["export"]["run"], exported["model"]
    spec = get_spec(model)
    features = exported["export"]["features"]
    extended = (run / EVAL).is_file() and has_extended([str(run)])
    header = ["---", "library_name: retr", "tags:", "- image-text-retrieval", "- cross-modal-retrieval",
              f"- {model}", "metrics:", "- recall", *(["- map@r", "- r-precision"] if extended else []), "---", ""]
    lines = [f"# {name}", "", f"An image–text matching model, `{model}`, trained with retr (`retr-train {model}`: "
             f"{spec.summary.split('.')[0].strip()}).", ""]
    lines += ["## Evaluation", ""]
    if (run / EVAL).is_file():
        head, rows, notes = table_rows([str(run)])
        lines += [tabulate(rows, headers=head, tablefmt="github", floatfmt=".1f"), "", *notes]
        if extended:
            head, rows, notes = table_rows([str(run)], extended=True)
            lines += ["", "### Every true match counted: ECCV Caption and CxC", "",
                      "The COCO 5K test set scored with the human-verified extra positives of ECCV Caption (mAP@R, "
                      "R-Precision, R@1) and CxC (R@1/5/10), as `eccv_caption` computes them (`retr-train eval "
                      "--extended`), percent:", "", tabulate(rows, headers=head, tablefmt="github", floatfmt=".1f"),
                      "", *notes]
    else:
        lines.append(f"Not evaluated when exported (`retr-train eval {name} --protocol …` stores its numbers).")
    verdict = _reproduction_verdict(run)
    if verdict:
        lines += ["", "## Reproduction", "", verdict]
    extractor = features.get("extractor")
    lines += ["", "## Features it needs", "",
              f"Image features of shape [K, D] = {features.get('shape') or ['K', features.get('dim')]}"
              + (f", made by retr's `{extractor}` extractor" if extractor else "") + ":", ""]
    lines += [f"- {k}: `{v}`" for k, v in features.items() if k not in ("dim", "shape", "extract_arguments")] \
        or ["- (not recorded)"]
    if features.get("extract_arguments"):
        command = ["retr-pipeline", "extract", "--manifest", "data/manifest.jsonl", "--image-root", "data",
                   *features["extract_arguments"], "--out", "data/features"]
        lines += ["", "Made again, with the settings the feature set records:", "", "```bash",
                  " ".join(shlex.quote(part) for part in command), "```"]
        weights = features.get("weights", "")
        if "sha256:" in str(weights):
            lines += ["", f"`--weights` is the file whose sha256 is `{str(weights).rsplit('sha256:', 1)[1][:16]}…`."]
    elif extractor:
        lines += ["", "The feature set records no more of how it was made (imported, or made by an older retr); "
                  "give the options it was made with:", "", "```bash",
                  f"retr-pipeline extract --manifest data/manifest.jsonl --extractor {extractor} --out data/features",
                  "```"]
    lines += ["", "## How to load it", "", "```python", "import retr", "",
              f'model, vocab, config = retr.load_model("{name}")        # this folder',
              f'search = retr.Retriever.from_run("{name}", features="data/features/{extractor or "FEATURES"}.h5",',
              '                                  manifest="data/manifest.jsonl")', "```", "", "```bash",
              f"retr-train eval {name} --features data/features/{extractor or 'FEATURES'}.h5 "
              "--manifest data/manifest.jsonl --protocol f30k-1k", "```", ""]
    settings = sorted((k, v) for k, v in exported["model_args"].items())
    lines += ["## Settings", "", tabulate(settings, headers=["setting", "value"], tablefmt="github",
                                          disable_numparse=True), "",
              f"Exported by retr {exported['export']['retr_version']} from `{exported['export']['checkpoint']}` "
              f"(sha256 {exported['export']['checkpoint_sha256'][:16]}…).", ""]
    return "\n".join(header + lines)


def _reproduction_verdict(run: Path) -> str | None:
    """The first line and reasons of a ``reproduce`` report beside the run (``runs/reproduce-RECIPE.json``)
    whose members include it, else None."""
    for report in sorted(run.resolve().parent.glob("reproduce-*.json")):
        try:
            data = json.loads(report.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        members = {Path(str(r)).resolve() for r in data.get("runs", [])}
        if run.resolve() in members:
            reasons = data.get("reasons") or []
            verdict = (f"Recipe `{data.get('recipe', report.stem)}` ({data.get('title', '')}): reproduction "
                       f"{'yes' if data.get('reproduction') else 'no'}")
            return verdict + (" — " + "; ".join(map(str, reasons)) if reasons else "")
    return None
