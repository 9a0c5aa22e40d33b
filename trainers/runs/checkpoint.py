"""Run directories and checkpoints (read with ``torch.load(weights_only=True)`` unless ``trust``).

Files of a run, a checkpoint's keys and the trust rule: docs/trainer.md ("Run directory", "Interrupted runs")."""
from __future__ import annotations

import json
import os
import pickle
import random
import re
import zipfile
from pathlib import Path

import numpy as np
import torch

from retr.common.atomic import atomic_file, atomic_text
from retr.common.errors import UserError
from retr.store.vocab import Vocabulary
from retr.trainers.runs.hub import local_run
from retr.trainers.runs.layout import BEST, CONFIG, EMA, EVAL, LOCK, METRICS, VOCAB, WEIGHTS
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)\.pt$")


def write_json(path: str | os.PathLike, data) -> Path:
    """Write JSON atomically (temporary file, then rename)."""
    with atomic_text(path) as handle:
        handle.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    return Path(path)


def read_config(run: str | os.PathLike) -> dict:
    """The run's ``config.json``, upgraded to today's form (:func:`upgrade_config`), with its data paths
    resolved (:func:`resolve_paths`)."""
    folder = local_run(run)
    path = folder / CONFIG
    if not path.is_file():
        what = ("does not exist" if not folder.exists() else "is a file, not a run folder" if not folder.is_dir()
                else f"is not a run folder (it holds no {CONFIG})")
        raise UserError(f"{run} {what}")
    run = path.parent
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{path} is not a run's settings (not JSON: {str(exc).splitlines()[0]})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model"), str):
        raise UserError(f"{path} is not a retr run's settings (it names no model): is {run} a run folder, or "
                        "another tool's?")
    return resolve_paths(run, upgrade_config(config))


def absolute_paths(cfg):
    """``cfg`` (a ``TrainConfig``) with its features, manifest and side files as absolute paths."""
    import dataclasses

    return dataclasses.replace(cfg, features=str(Path(cfg.features).resolve()),
                               manifest=str(Path(cfg.manifest).resolve()),
                               inputs={k: _absolute(v) for k, v in (cfg.inputs or {}).items()})


def _named(path: str) -> bool:
    """A side input given as a resource fetched on first use (``--concept-vectors glove``), not a file."""
    from retr.store.word_vectors import GLOVE_SETS
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
    from retr.common.atomic import PARTIAL_SUFFIX

    return (name in (CONFIG, VOCAB, BEST, METRICS, EVAL, LOCK, EMA, "tensorboard", "wandb")
            or bool(_CHECKPOINT.match(name)) or name.endswith(PARTIAL_SUFFIX))


def save_checkpoint(path: str | os.PathLike, state: dict) -> Path:
    """``torch.save`` to a temporary name, then rename (a killed run never leaves a truncated checkpoint)."""
    with atomic_file(path) as partial:
        torch.save(state, partial)
    return Path(path)


#: what older checkpoints need besides tensors: numpy's RNG key array (array reconstruction only)
LEGACY_SAFE_GLOBALS = (np.ndarray, np.dtype, np.dtypes.UInt32DType)


def _numpy_reconstruct():
    """numpy's array-unpickling function (its module moved in numpy 2)."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:                      # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


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
        with torch.serialization.safe_globals([*LEGACY_SAFE_GLOBALS, _numpy_reconstruct(), *allow]):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        allowed = {f"{g.__module__}.{g.__qualname__}" for g in (*LEGACY_SAFE_GLOBALS, _numpy_reconstruct(), *allow)}
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
    ``trust``: read a checkpoint that holds other Python objects (:func:`load_checkpoint`)."""
    from retr.trainers.models import create_model

    run = local_run(run)
    config = read_config(run)
    path = resolve_checkpoint(run, which)
    if path.suffix == ".safetensors":
        return _load_weights_file(path, config, run / VOCAB, device), Vocabulary.load(run / VOCAB), config
    state = load_checkpoint(path, trust=trust)
    vocab = Vocabulary.from_json(state["vocab"], str(path)) if "vocab" in state else Vocabulary.load(run / VOCAB)
    model = create_model(config["model"], **config["model_args"])
    model.load_state_dict(state["model"])
    return model.to(device).eval(), vocab, config


def _load_weights_file(path: Path, config: dict, vocab: Path, device):
    """The model ``config`` describes with the weights of the safetensors file ``path`` (an export): no pickle is
    read. A file that is not safetensors, or whose tensors are not the model's, is one line."""
    from retr.trainers.models import create_model

    import safetensors.torch

    if not vocab.is_file():
        raise UserError(f"{path.parent} is not a complete export: no {vocab.name} beside {path.name}")
    model = create_model(config["model"], **config["model_args"])
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


def upgrade_config(config: dict) -> dict:
    """A stored run config in today's form: side files that older runs kept among ``model_args`` (SMFEA's
    ``trees``/``concepts``, JGCAR's ``labels``) move to ``inputs`` (the model's spec says how)."""
    from retr.trainers.models import get_spec

    config = dict(config)
    if isinstance(config.get("amp"), bool):           # before --amp fp16|bf16: a flag meaning fp16 on CUDA
        config["amp"] = "fp16" if config["amp"] else "off"
    model_args, inputs = get_spec(config["model"]).upgrade(config.get("model_args") or {}, config.get("inputs"))
    config["model_args"], config["inputs"] = model_args, inputs
    return config
