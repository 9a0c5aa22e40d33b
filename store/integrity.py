"""A feature set's rows against the checksums stored when they were written, streamed in bounded blocks.

* :func:`check_rows` — one file's rows (every row, or a sample): floats finite, each row's CRC-32 equal to the one
  its writer stored (:func:`~retr.store.features.row_checksums`); ``retr-pipeline verify`` reports every problem
  of a set with it;
* :func:`verify_rows` — the check a command runs before training or evaluating on a set: every row of every file,
  refused in one line at the first file with a problem, and remembered per state of each file (its path, size,
  modification time and inode) in ``$RETR_CACHE/verified/`` (:mod:`retr.common.cache`), so a set is read once
  until a file changes, not at every run.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import h5py
import numpy as np

from retr.common.atomic import atomic_text
from retr.common.cache import cache_folder
from retr.common.errors import UserError
from retr.common.locks import waiting_lock
from retr.common.progress import progress
from retr.store.features import (CHECKSUMS, CHECKSUM_ALGORITHM, FeatureSet, NOT_ROW_DATA, decode_str, non_finite_rows,
                                 row_checksums)

logger = logging.getLogger(__name__)

#: Bytes of row data read at once while streaming (all per-row datasets of a block together).
DEFAULT_CHUNK_BYTES = 64 << 20
#: the cache folder (under ``$RETR_CACHE``) of the files found sound, one small JSON file each
VERIFIED = "verified"
#: what a remembered verification covered (a change of rule makes every file be read again)
RULE = f"finite values and {CHECKSUM_ALGORITHM}"
#: sets at least this large say that they are being verified (a line at INFO; smaller ones at DEBUG)
ANNOUNCE_BYTES = 1 << 30


@dataclass(frozen=True)
class RowNames:
    """How a problem names a row: its row in the set (``offset`` + row in the file), and the shard if any."""

    set_name: str
    offset: int
    shard: str | None

    def __call__(self, row: int, image_id: str) -> str:
        where = f"row {self.offset + row} (id {image_id!r}"
        return where + (f", row {row} of {self.shard})" if self.shard else ")")


@dataclass
class RowCheck:
    """What :func:`check_rows` found in one file: ``problems`` (empty: sound), ``rows_read``,
    ``rows_checksummed``, and ``without_checksums`` (the file stores none: written before retr stored them)."""

    problems: list[str] = field(default_factory=list)
    rows_read: int = 0
    rows_checksummed: int = 0
    without_checksums: bool = False


def row_datasets(f: h5py.File) -> list[str]:
    """The per-row datasets a checksum covers, in its order: ``features``, then the others by name."""
    return ["features"] + sorted(name for name in f if name not in NOT_ROW_DATA and name != "features")


def row_bytes(f: h5py.File) -> int:
    """Bytes of one row over :func:`row_datasets`."""
    return sum(f[name].dtype.itemsize * int(np.prod(f[name].shape[1:])) for name in row_datasets(f))


def check_rows(f: h5py.File, names: RowNames, rows: np.ndarray | None = None, checksum: bool = True,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, advance: Callable[[int], None] | None = None) -> RowCheck:
    """Read the rows of one open file (every row, or ``rows`` [R] sorted) ``chunk_bytes`` at a time: floats finite,
    checksums equal (unless ``checksum`` is false). ``advance(n)`` is called after each block of ``n`` rows."""
    result = RowCheck()
    n = f["features"].shape[0]
    datasets = row_datasets(f)
    ids_ds = f["ids"]
    sums = f[CHECKSUMS] if checksum and CHECKSUMS in f else None
    what = names.shard or names.set_name
    if sums is not None and sums.shape != (n,):
        result.problems.append(f"{what}: checksums have shape {sums.shape}, expected ({n},)")
        sums = None
    result.without_checksums = checksum and CHECKSUMS not in f
    per_block = max(1, chunk_bytes // max(1, row_bytes(f)))
    wanted = np.arange(n) if rows is None else np.asarray(rows, dtype=np.int64)
    bad_values: dict[str, list] = {}   # dataset → [rows not finite, the first one named]
    mismatched: list = [0, None]        # [rows whose checksum differs, the first one named]
    for first in range(0, len(wanted), per_block):
        block_rows = wanted[first:first + per_block]
        if rows is None:  # contiguous: slice reads
            lo, hi = int(block_rows[0]), int(block_rows[-1]) + 1
            data = {name: f[name][lo:hi] for name in datasets}
            block_ids = [decode_str(v) for v in ids_ds[lo:hi]]
            stored = sums[lo:hi] if sums is not None else None
        else:  # a sample: one slice per row (h5py's point selection is far slower on one-row chunks)
            data = {name: np.concatenate([f[name][r:r + 1] for r in block_rows]) for name in datasets}
            block_ids = [decode_str(ids_ds[r]) for r in block_rows]
            stored = np.array([sums[r] for r in block_rows], dtype=np.uint32) if sums is not None else None
        for name in datasets:
            bad = non_finite_rows(data[name])
            if bad.any():
                found = bad_values.setdefault(name, [0, None])
                found[0] += int(bad.sum())
                if found[1] is None:
                    k = int(np.argmax(bad))
                    found[1] = names(int(block_rows[k]), block_ids[k])
        if stored is not None:
            differ = row_checksums(block_ids, [data[name] for name in datasets]) != stored
            if differ.any():
                if mismatched[1] is None:
                    k = int(np.argmax(differ))
                    mismatched[1] = names(int(block_rows[k]), block_ids[k])
                mismatched[0] += int(differ.sum())
        if advance is not None:
            advance(len(block_rows))
    checked = len(wanted)
    result.rows_read = checked
    if sums is not None:
        result.rows_checksummed = checked
    for name, (count, example) in bad_values.items():
        result.problems.append(f"{count} of {checked} checked rows of {name!r} in {what} are not finite "
                               f"(NaN or inf), e.g. {example}")
    if mismatched[0]:
        result.problems.append(f"{mismatched[0]} of {checked} checked rows in {what} do not match the checksum "
                               f"stored when they were written (changed since, or their id was), e.g. {mismatched[1]}")
    return result


# ------------------------------------------------------------------------------------------ before the work

def row_files(path: str | os.PathLike) -> list[tuple[Path, int, str | None]]:
    """``[(file, first row in the set, shard name or None)]`` holding a set's rows: an index's shards (resolved
    beside it), else the file itself."""
    path = Path(path)
    with h5py.File(path, "r") as f:
        shards = f.attrs.get("shards")
    if shards is None:
        return [(path, 0, None)]
    listed = json.loads(decode_str(shards))
    files, offset = [], 0
    for shard in listed:
        files.append((path.resolve().parent / shard["file"], offset, str(shard["file"])))
        offset += int(shard["rows"])
    return files


def file_state(path: Path) -> dict:
    """What identifies the content of ``path`` without reading it: resolved path, size, modification time, inode."""
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino,
            "device": stat.st_dev, "rule": RULE}


def _entry(state: dict) -> Path:
    """The cache file that remembers the file of ``state`` (one per file path)."""
    return cache_folder(VERIFIED) / (hashlib.sha256(state["path"].encode("utf-8")).hexdigest()[:32] + ".json")


def is_remembered(state: dict) -> bool:
    """Whether a file in exactly ``state`` was found sound before."""
    entry = _entry(state)
    try:
        remembered = json.loads(entry.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(remembered, dict) and {k: remembered.get(k) for k in state} == state


def remember(state: dict, rows: int) -> None:
    """Record that the file of ``state`` was found sound (silently skipped where the cache cannot be written)."""
    entry = _entry(state)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with atomic_text(entry) as handle:
            handle.write(json.dumps({**state, "rows": rows,
                                     "verified": datetime.now(timezone.utc).isoformat(timespec="seconds")}) + "\n")
    except OSError as exc:
        logger.debug(f"could not remember the verification of {state['path']} in {entry.parent} ({exc})")


def verify_rows(path: str | os.PathLike, name: str = "--features", quiet: bool = False,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Refuse a feature set (an index or a single file) with a row that is not finite or does not match its stored
    checksum: one :class:`UserError` line naming ``name``, the file and a row, and ``retr-pipeline verify``. Each
    file whose state (:func:`file_state`) was found sound before is skipped; returns the rows read (0: all
    remembered). Concurrent commands read a file once: the first verifies it, the others wait and find it
    remembered."""
    path = Path(path)
    FeatureSet(path)                        # one line for a file that is no (complete) feature set
    files = row_files(path)
    pending = [(file, offset, shard) for file, offset, shard in files if not is_remembered(file_state(file))]
    if not pending:
        return 0
    sizes = {file: file.stat().st_size for file, _, _ in pending}
    total = sum(sizes.values())
    (logger.info if total >= ANNOUNCE_BYTES else logger.debug)(
        f"verifying {path}: {total / 1e9:.1f} GB of rows against their checksums (once: remembered in "
        f"{cache_folder(VERIFIED)} until a file changes; --no-verify skips it)")
    read = 0
    with progress(total=sum(_rows_in(file) for file, _, _ in pending), desc=f"verify {path.name}", unit="row",
                  quiet=quiet) as bar:
        for file, offset, shard in pending:
            lock = cache_folder(VERIFIED) / (_entry(file_state(file)).stem + ".lock")
            with _maybe_locked(lock):
                state = file_state(file)
                if is_remembered(state):             # another process verified it meanwhile
                    bar.update(_rows_in(file))
                    continue
                try:
                    with h5py.File(file, "r") as f:
                        found = check_rows(f, RowNames(path.name, offset, shard), chunk_bytes=chunk_bytes,
                                           advance=bar.update)
                except OSError as exc:            # HDF5 could not read a block: the file is damaged there
                    raise UserError(f"{name} {path}: reading {file.name} failed ({str(exc).splitlines()[0]}); "
                                    f"`retr-pipeline verify {path}` lists every problem of the set") from None
                if found.problems:
                    raise UserError(f"{name} {path}: {found.problems[0]}; `retr-pipeline verify {path}` lists "
                                    f"every problem of the set (--no-verify skips this check)")
                read += found.rows_read
                remember(state, found.rows_read)
    return read


def _rows_in(file: Path) -> int:
    with h5py.File(file, "r") as f:
        return int(f["features"].shape[0])


class _maybe_locked:
    """:func:`~retr.common.locks.waiting_lock` on ``path``, or nothing where the cache folder cannot be written."""

    def __init__(self, path: Path):
        self.path, self.held = path, None

    def __enter__(self):
        try:
            self.held = waiting_lock(self.path)
            self.held.__enter__()
        except OSError:
            self.held = None
        return self

    def __exit__(self, *exc) -> None:
        if self.held is not None:
            self.held.__exit__(*exc)
