"""What every golden-figure generator shares: a patched copy of the authors' code, and figures written with
their provenance.

The generators in this folder are run by hand, never by CI. Each takes the authors' public repository from a
scratch folder the person running it fetched (``git clone`` of the repository named in the script), copies it
to a temporary folder, applies the script's listed patches (text substitutions that only let it import on
Python 3 and current torch), runs it on a small stored initial state and stored batches, and writes the
figures to ``tests/data/golden/<name>/``:

* ``inputs.npz``  — the initial state and batches both sides start from (plain arrays, no pickle);
* ``figures.npz`` — what the authors' code computed from them;
* ``provenance.json`` — repository, commit, patches, command, versions, date.

The authors' code never enters this repository; the figures do.
"""
from __future__ import annotations

import contextlib

import json
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).resolve().parents[2] / "tests" / "data" / "golden"


@dataclass(frozen=True)
class Patch:
    """One text substitution in one file of the authors' code, and why it is needed."""

    path: str
    old: str
    new: str
    why: str


def patched_copy(source: Path, patches: list[Patch]) -> Path:
    """A temporary copy of ``source`` with every patch applied once (each must match exactly once)."""
    target = Path(tempfile.mkdtemp(prefix="golden-")) / source.name
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(".git"))
    for patch in patches:
        file = target / patch.path
        text = file.read_text(encoding="utf-8")
        count = text.count(patch.old)
        if count != 1:
            raise SystemExit(f"patch for {patch.path} ({patch.why}) matches {count} times: is this the listed commit?")
        file.write_text(text.replace(patch.old, patch.new), encoding="utf-8")
    return target


def authors_checkout(description: str, what: str, commit: str, patches: list[Patch]) -> tuple[Path, Path]:
    """Parse the one argument every generator takes (the authors' checkout, ``what``), say when it is not at
    ``commit``, and return ``(checkout, its patched copy)``."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("authors", type=Path, help=f"checkout of {what}")
    source = parser.parse_args().authors.resolve()
    if commit_of(source) != commit:
        print(f"note: {source} is not at {commit}, the commit these patches and figures were made for")
    return source, patched_copy(source, patches)


@contextlib.contextmanager
def recorded_clip_norms(module, name: str):
    """Within the block ``module.<name>``, their gradient-clipping function, also records the norm each call
    returns, into the list yielded; restored on exit."""
    norms: list[float] = []
    clip = getattr(module, name)

    def recording(params, max_norm, *args, **kwargs):
        norm = clip(params, max_norm, *args, **kwargs)
        norms.append(float(norm))
        return norm
    setattr(module, name, recording)
    try:
        yield norms
    finally:
        setattr(module, name, clip)


def padded(token_lists, width: int) -> np.ndarray:
    """Token lists as one ``[n, width]`` int64 array, zero-padded on the right."""
    out = np.zeros((len(token_lists), width), dtype=np.int64)
    for row, tokens in enumerate(token_lists):
        out[row, :len(tokens)] = tokens
    return out


def commit_of(source: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], check=True, capture_output=True,
                              text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def write_figures(name: str, *, repository: str, source: Path, patches: list[Patch], inputs: dict, figures: dict,
                  notes: str = "") -> Path:
    """Write ``tests/data/golden/<name>/`` (inputs.npz, figures.npz, provenance.json)."""
    import torch

    folder = GOLDEN / name
    folder.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(folder / "inputs.npz", **{k: np.asarray(v) for k, v in inputs.items()})
    np.savez_compressed(folder / "figures.npz", **{k: np.asarray(v) for k, v in figures.items()})
    provenance = {
        "repository": repository, "commit": commit_of(source),
        "patches": [{"path": p.path, "old": p.old, "new": p.new, "why": p.why} for p in patches],
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
        "generated": datetime.now(timezone.utc).isoformat(timespec="seconds"), "notes": notes,
    }
    (folder / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n", encoding="utf-8")
    return folder
