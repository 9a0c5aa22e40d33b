"""Files that appear under their final name only when complete: written to ``<name>.partial`` and renamed (any
writer that takes a path: :func:`atomic_file`; HDF5: :func:`atomic_hdf5`, ``complete`` set last; text:
:func:`atomic_text`)."""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

import h5py

PARTIAL_SUFFIX = ".partial"


def partial_path(path: str | os.PathLike) -> Path:
    """``<path>.partial``: where ``path`` is written before it is renamed."""
    path = Path(path)
    return path.with_name(path.name + PARTIAL_SUFFIX)


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield ``<path>.partial`` to write (``torch.save``, ``faiss.write_index``…); on success rename it to
    ``path``, else remove it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    try:
        yield partial
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)


@contextmanager
def atomic_hdf5(path: str | os.PathLike) -> Iterator[h5py.File]:
    """Yield an HDF5 file open at ``<path>.partial``; on success mark it complete and rename it, else remove it."""
    with atomic_file(path) as partial, h5py.File(partial, "w") as handle:
        yield handle
        handle.attrs["complete"] = True


@contextmanager
def atomic_text(path: str | os.PathLike) -> Iterator[IO[str]]:
    """Yield a UTF-8 text file open at ``<path>.partial``; on success rename it to ``path``, else remove it."""
    with atomic_file(path) as partial, open(partial, "w", encoding="utf-8") as handle:
        yield handle
