"""Run directories and checkpoints (read with ``torch.load(weights_only=True)`` unless ``trust``).

Files of a run, a checkpoint's keys and the trust rule: docs/trainer.md ("Run directory", "Interrupted runs")."""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import re
import zipfile
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

try:
    from numpy._core.multiarray import _reconstruct      # numpy's array-unpickling function
except ImportError:                                      # numpy < 2
    from numpy.core.multiarray import _reconstruct

from retr.common.atomic import PARTIAL_SUFFIX, atomic_file, atomic_text
from retr.common.errors import UserError
from retr.store.vocabularies import load_vocabulary, vocabulary_from_json
from retr.store.word_vectors import GLOVE_SETS
from retr.trainers.config import TrainConfig, settings_from_stored, upgrade_stored
from retr.trainers.models import get_spec
from retr.trainers.runs.hub import local_run
from retr.trainers.runs.layout import BEST, CONFIG, EMA, EVAL, LOCK, METRICS, VOCAB, WEIGHTS
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)\.pt$")


def write_json(path: str | os.PathLike, data) -> Path:
    """Write JSON atomically (temporary file, then rename)."""
    with atomic_text(path) as handle:
        handle.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    return Path(path)


def read_stored(run: str | os.PathLike) -> tuple[Path, dict]:
    """``(the run's folder, its config.json as stored)``: a one-line :class:`UserError` when ``run`` holds none,
    or when it is not JSON naming a model."""
    folder = local_run(run)
    path = folder / CONFIG
    if not path.is_file():
        what = ("does not exist" if not folder.exists() else "is a file, not a run folder" if not folder.is_dir()
                else f"is not a run folder (it holds no {CONFIG})")
        raise UserError(f"{run} {what}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{path} is not a run's settings (not JSON: {str(exc).splitlines()[0]})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model"), str):
        raise UserError(f"{path} is not a retr run's settings (it names no model): is {folder} a run folder, or "
                        "another tool's?")
    return folder, config


def read_config(run: str | os.PathLike) -> dict:
    """The run's ``config.json`` — its settings and its records (feature attributes, data identity, an export's
    provenance …) — in today's form (:func:`~retr.trainers.config.upgrade_stored`), with its data paths resolved
    (:func:`resolve_paths`). :func:`read_settings` gives the settings as the typed object."""
    folder, config = read_stored(run)
    return resolve_paths(folder, upgrade_stored(get_spec(config["model"]), config))


def read_settings(run: str | os.PathLike) -> TrainConfig:
    """The run's settings (:func:`~retr.trainers.config.settings_from_stored`: its model's config dataclass
    inside), data paths resolved as :func:`read_config` resolves them."""
    folder, config = read_stored(run)
    return settings_from_stored(get_spec(config["model"]), resolve_paths(folder, config))


def absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with its features, manifest and side files as absolute paths."""
    return dataclasses.replace(cfg, features=str(Path(cfg.features).resolve()),
                               manifest=str(Path(cfg.manifest).resolve()),
                               inputs={k: _absolute(v) for k, v in (cfg.inputs or {}).items()})


def _named(path: str) -> bool:
    """A side input given as a resource fetched on first use (``--concept-vectors glove``), not a file."""
    return path in GLOVE_SETS


def _absolute(path: str) -> str:
    return path if _named(path) else str(Path(path).resolve())


def paths_from_run(cfg, run: str | os.PathLike) -> dict:
    """The data paths of ``cfg`` relative to the run directory (``{"features": "../data/x.h5", "inputs":
    {…}}``): what finds the data again when the run and its data move together."""
    run = Path(run).resolve()
    rel = lambda p: os.path.relpath(Path(p).resolve(), run)   # noqa: E731
    return {"features": rel(cfg.features), "manifest": rel(cfg.manifest),
            "inputs": {k: rel(v) for k, v in (cfg.inputs or {}).items() if not _named(v)}}


def resolve_paths(run: str | os.PathLike, config: dict) -> dict:
    """``config`` with each data path taken as recorded if it exists, else relative to the run directory
    (``paths_from_run``) if that exists, else as recorded."""
    from_run = config.get("paths_from_run") or {}

    def pick(recorded: str | None, relative: str | None) -> str | None:
        if not recorded or Path(recorded).exists() or not relative:
            return recorded
        moved = Path(run) / relative
        return str(moved) if moved.exists() else recorded
    config = dict(config)
    for key in ("features", "manifest"):
        config[key] = pick(config.get(key), from_run.get(key))
    config["inputs"] = {k: pick(v, (from_run.get("inputs") or {}).get(k)) for k, v in (config.get("inputs") or {}).items()}
    return config


def rng_state() -> dict:
    """Every RNG's state in plain types (tuples, ints, floats, tensors), so a checkpoint needs no pickle."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": (kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss),
                       float(cached)),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((kind, keys.astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_path(run: str | os.PathLike, epoch: int) -> Path:
    return Path(run) / f"checkpoint-{epoch:03d}.pt"


def list_checkpoints(run: str | os.PathLike) -> list[tuple[int, Path]]:
    """``[(epoch, path)]`` of the run's epoch checkpoints, oldest first."""
    run = Path(run)
    found = [(int(m.group(1)), p) for p in run.glob("checkpoint-*.pt") if (m := _CHECKPOINT.match(p.name))]
    return sorted(found)


def holds_run(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a run (its ``config.json``, ``metrics.jsonl`` or an epoch checkpoint)."""
    folder = Path(folder)
    return (folder / CONFIG).exists() or (folder / METRICS).exists() or bool(list_checkpoints(folder))


def is_run_file(name: str) -> bool:
    """Whether a file or folder named ``name`` is one a run writes into its folder (a run stopped before its
    ``config.json`` leaves some of them)."""
    return (name in (CONFIG, VOCAB, BEST, METRICS, EVAL, LOCK, EMA, "tensorboard", "wandb")
            or bool(_CHECKPOINT.match(name)) or name.endswith(PARTIAL_SUFFIX))


def save_checkpoint(path: str | os.PathLike, state: dict) -> Path:
    """``torch.save`` to a temporary name, then rename (a killed run never leaves a truncated checkpoint)."""
    with atomic_file(path) as partial:
        torch.save(state, partial)
    return Path(path)


#: what older checkpoints need besides tensors: numpy's RNG key array (array reconstruction only)
LEGACY_SAFE_GLOBALS = (np.ndarray, np.dtype, np.dtypes.UInt32DType)


def load_checkpoint(path: str | os.PathLike, map_location="cpu", trust: bool = False,
                    allow: tuple = ()) -> dict:
    """A checkpoint's contents, read without running code (docs/trainer.md): tensors and plain types, the
    numpy arrays of older runs' RNG states, and the types in ``allow`` (e.g. ``argparse.Namespace`` for official
    SCAN checkpoints). ``trust=True`` reads any pickle (``--trust-checkpoint``; only for files you trust)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist")
    if trust:
        try:
            return torch.load(path, map_location=map_location, weights_only=False)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file for the user
            raise UserError(f"{path} is not a readable checkpoint ({type(exc).__name__}: {exc})") from None
    try:
        with torch.serialization.safe_globals([*LEGACY_SAFE_GLOBALS, _reconstruct, *allow]):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        allowed = {f"{g.__module__}.{g.__qualname__}" for g in (*LEGACY_SAFE_GLOBALS, _reconstruct, *allow)}
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path) if zipfile.is_zipfile(path) else []
        names = [n for n in names if n not in allowed]
        what = f" ({', '.join(names)})" if names else ""
        raise UserError(f"{path} holds Python objects other than tensors{what}, which could run code when "
                        "loaded; load it only if you trust it: --trust-checkpoint") from None
    except Exception as exc:  # noqa: BLE001 - any other failure is a bad file for the user
        raise UserError(f"{path} is not a readable checkpoint ({type(exc).__name__}: {exc})") from None


def prune_checkpoints(run: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest ``keep`` epoch checkpoints (``best.pt`` is separate)."""
    for _, path in list_checkpoints(run)[:-keep] if keep > 0 else []:
        path.unlink(missing_ok=True)


def is_export(run: str | os.PathLike) -> bool:
    """Whether ``run`` is an exported model folder (its weights in :data:`WEIGHTS`, no training checkpoints)."""
    return (Path(run) / WEIGHTS).is_file()


def resolve_checkpoint(run: str | os.PathLike, which: str = "best") -> Path:
    """The file ``which`` names in ``run``: ``best`` (``best.pt``, else the newest epoch checkpoint; an export's
    :data:`WEIGHTS`), ``last`` (the newest epoch checkpoint) or a file name."""
    run = Path(run)
    if which == "best" and is_export(run) and not (run / BEST).is_file():
        return run / WEIGHTS
    if which == "best":
        path = run / BEST
        if not path.is_file() and list_checkpoints(run):
            path = list_checkpoints(run)[-1][1]
        return path
    if which == "last":
        if not list_checkpoints(run):
            raise UserError(f"{run} has no epoch checkpoints")
        return list_checkpoints(run)[-1][1]
    return run / which


def load_run_model(run: str | os.PathLike, which: str = "best", device: torch.device | str = "cpu",
                   trust: bool = False):
    """(model in eval mode, vocabulary, config) of a run; ``which`` is ``best``, ``last`` or a file name;
    ``trust``: read a checkpoint that holds other Python objects (:func:`load_checkpoint`). ``config`` is the run's
    ``config.json`` as :func:`read_config` gives it; the model is built from its settings (:func:`build_model`)."""
    run = local_run(run)
    config = read_config(run)
    model = build_model(settings_from_stored(get_spec(config["model"]), config))
    path = resolve_checkpoint(run, which)
    if path.suffix == ".safetensors":
        return _load_weights_file(model, path, config, run / VOCAB, device), load_vocabulary(run / VOCAB), config
    state = load_checkpoint(path, trust=trust)
    vocab = vocabulary_from_json(state["vocab"], str(path)) if "vocab" in state else load_vocabulary(run / VOCAB)
    model.load_state_dict(state["model"])
    return model.to(device).eval(), vocab, config


def build_model(settings: TrainConfig):
    """The untrained model a run's settings describe: its model class built from ``settings.model_config`` and
    the sizes that followed from its data (``settings.sizes``)."""
    return get_spec(settings.model).model_class(config=settings.model_config, **settings.sizes)


def _load_weights_file(model, path: Path, config: dict, vocab: Path, device):
    """``model`` (as ``config`` describes it) with the weights of the safetensors file ``path`` (an export): no
    pickle is read. A file that is not safetensors, or whose tensors are not the model's, is one line."""
    if not vocab.is_file():
        raise UserError(f"{path.parent} is not a complete export: no {vocab.name} beside {path.name}")
    try:
        missing, unexpected = safetensors.torch.load_model(model, str(path), strict=False)
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign file is a bad input for the user
        raise UserError(f"{path} is not a readable safetensors file of a {config['model']} model "
                        f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]})") from None
    if missing or unexpected:
        raise UserError(f"{path} does not hold the weights of the {config['model']} model {path.parent / CONFIG} "
                        f"describes ({len(missing)} missing, {len(unexpected)} unexpected, e.g. "
                        f"{(list(missing) + list(unexpected))[0]})")
    return model.to(device).eval()
