"""Files that appear under their final name only when complete.

Every HDF5 file retr writes (feature shards and indexes, trees, concepts) goes through :func:`atomic_hdf5`:
the data is written to ``<name>.partial``, the root attribute ``complete`` is set last, and only then is the
file renamed. A killed writer leaves at most a ``.partial`` file, which no reader mistakes for a finished one.
Text files (label files) go through :func:`atomic_text` the same way: written to ``<name>.partial``, renamed
when the writer finishes without an exception.
"""
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
def atomic_hdf5(path: str | os.PathLike) -> Iterator[h5py.File]:
    """Yield an HDF5 file open for writing at ``<path>.partial``; on success mark it complete and rename it.

    On any exception (including KeyboardInterrupt) the partial file is removed and the exception re-raised.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    try:
        with h5py.File(partial, "w") as handle:
            yield handle
            handle.attrs["complete"] = True
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)


@contextmanager
def atomic_text(path: str | os.PathLike) -> Iterator[IO[str]]:
    """Yield a UTF-8 text file open for writing at ``<path>.partial``; on success rename it to ``path``.

    On any exception (including KeyboardInterrupt) the partial file is removed and the exception re-raised.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    try:
        with open(partial, "w", encoding="utf-8") as handle:
            yield handle
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)
