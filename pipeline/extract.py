"""The extraction stage: manifest → sharded feature set (``DIR/NAME/shard-*.h5`` + the index ``DIR/NAME.h5``).

Sharding. The manifest's N images are split into W shards of contiguous rows in manifest order: shard ``r``
holds rows ``[r·N // W, (r+1)·N // W)`` (sizes differ by at most one). The assignment depends only on N and W,
so any process, machine or re-run agrees on it, and the index (shards joined in order) lists the rows in
manifest order, minus the images recorded in ``errors``.

Who runs which shard. ``--num-shards W --shard-index r`` runs exactly shard r. Under ``torchrun`` (``RANK`` and
``WORLD_SIZE`` in the environment) rank r of w runs shard r of w, or — with ``--num-shards W`` — shards
``r, r+w, r+2w, …``. A plain run without flags does every shard in turn (one shard by default).

Resume. A shard is written to ``shard-….h5.partial`` and renamed when complete (:class:`ShardWriter`); a
complete shard is skipped by any later run, after checking it was made by the same extractor, weights,
options and manifest (otherwise the run stops and says so rather than mixing feature sets). An interrupted
shard is started again from its first row.

Exclusive shards. Once its network is built, a process takes an exclusive ``fcntl.flock`` on
``NAME/.shard-RRRRR-of-WWWWW.h5.lock`` for every shard it is about to write, and writes its pid, host and start
time into it. A second extraction into the same folder that needs one of those shards stops with one line
naming that pid and host — at once, before building its network, when the lock file is already there (it would otherwise collide in HDF5's own file lock on the ``.partial`` file). The
OS drops the lock when the holder exits or dies, so a killed run never leaves a stale lock; ranks of one
torchrun job lock disjoint shards.

Image paths. A manifest path that leaves the image root (absolute, or ``..`` above it) is not opened: it becomes
an ``errors`` row like an unreadable image, unless ``allow_outside_root`` (then the feature set records
``images_outside_root = "read"``).

Index. After its shards, every process takes an exclusive lock (``fcntl.flock`` on ``NAME/.index.lock``, so
concurrent ranks never write it together) and, if all W shards are complete and the index is missing or
older than a shard, writes it. Hence the last rank to finish — or any re-run — writes it; no
``torch.distributed`` process group is needed. ``retr-pipeline index DIR/NAME`` does the same by hand.

Decoding runs in DataLoader workers (``--workers``), so it overlaps the network; an image that cannot be read
becomes one ``errors`` row ``(id, reason)`` and the run goes on. With ``decode="device"`` the workers only read
file bytes and JPEGs are decoded in batches on the device (:mod:`retr.extractors.device_decode`); an image the
device decoder rejects becomes an ``errors`` row there, with Pillow's reason.

Overlap on CUDA. Batches are pinned by the DataLoader, and :class:`~retr.common.prefetch.DevicePrefetcher`
moves (or decodes) the next batch onto the device on a side stream while the current one is in the network. The
shard's rows are written by a background thread (:mod:`retr.pipeline.write_thread`, ``write_queue`` batches
deep; 0 writes in the loop), so the device does not wait on the disk; the shard file is the same either way.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from retr.common.progress import progress
from retr.common.errors import ParameterError, UserError
from retr.common.locks import LockHeldError, acquire_lock
from retr.common.torchrun import TorchrunEnv
from retr.extractors.base import Extractor, ImageError, build_extractor
from retr.manifests.schema import ManifestRecord, manifest_sha256, outside_root_reason, read_manifest
from retr.common.prefetch import DevicePrefetcher
from retr.pipeline.write_thread import WRITE_QUEUE_DEPTH, BackgroundWriter
from retr.store.features import (NonFiniteError, ShardWriter, decode_str, index_path_for, is_complete,
                                 shard_name, shard_status, write_index)

#: Attributes the shard writer adds that change with the run, not with what the features are; a complete
#: shard from an earlier run must agree with this run on every other attribute to be reused.
_RUN_ATTRS = ("created", "retr_version", "shard_index", "num_shards", "complete", "num_rows", "format_version")


def shard_ranges(num_rows: int, num_shards: int) -> list[tuple[int, int]]:
    """``[(start, stop)]`` of every shard: contiguous manifest rows, sizes differing by at most one."""
    if num_shards < 1:
        raise ParameterError(f"num_shards must be at least 1, not {num_shards}", "num_shards")
    return [(r * num_rows // num_shards, (r + 1) * num_rows // num_shards) for r in range(num_shards)]


#: the torchrun environment (kept under this name for callers of the extraction stage)
DistributedEnv = TorchrunEnv


def plan_shards(num_shards: int | None, shard_index: int | None,
                env: DistributedEnv) -> tuple[int, list[int]]:
    """``(W, the shard indices this process runs)`` from the flags and the torchrun environment."""
    if shard_index is not None:
        if num_shards is None:
            raise ParameterError("shard_index needs num_shards", "shard_index", "num_shards")
        if env.world_size > 1:
            raise ParameterError("shard_index under torchrun would make every rank write the same shard; "
                                 "leave it out (rank r takes shard r)", "shard_index")
        if not 0 <= shard_index < num_shards:
            raise ParameterError(f"shard_index {shard_index} is outside 0..{num_shards - 1}", "shard_index")
        return num_shards, [shard_index]
    if env.world_size > 1:
        count = env.world_size if num_shards is None else num_shards
        if count < env.world_size:
            raise ParameterError(f"num_shards {count} is less than the {env.world_size} torchrun processes; "
                                 f"some would have nothing to do", "num_shards")
        return count, list(range(env.rank, count, env.world_size))
    count = 1 if num_shards is None else num_shards
    if count < 1:
        raise ParameterError(f"num_shards must be at least 1, not {count}", "num_shards")
    return count, list(range(count))


class ImageFiles(Dataset):
    """Rows of one shard for a DataLoader: item ``i`` → ``(i, sample or None, error reason or None)``.

    ``refused``: positions not to open at all, with the reason recorded instead (paths outside the image root).
    """

    def __init__(self, paths: Sequence[str], preprocess: Callable[[str], Any],
                 refused: dict[int, str] | None = None):
        self.paths = list(paths)
        self.preprocess = preprocess
        self.refused = dict(refused or {})

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[int, Any, str | None]:
        if i in self.refused:
            return i, None, self.refused[i]
        try:
            return i, self.preprocess(self.paths[i]), None
        except ImageError as exc:
            return i, None, str(exc) or "unusable image"


@dataclass
class Batch:
    """A collated batch: positions (within the shard) of usable images, their batch, and the failed ones."""

    positions: list[int]
    samples: Any
    failures: list[tuple[int, str]]

    def pin_memory(self) -> "Batch":
        """Called by the DataLoader with ``pin_memory=True`` (CUDA): page-locks the sample tensor (or the
        samples' own ``pin_memory``, e.g. an :class:`~retr.extractors.device_decode.EncodedBatch`)."""
        if self.samples is not None and hasattr(self.samples, "pin_memory"):
            self.samples = self.samples.pin_memory()
        return self


class BatchCollator:
    """DataLoader ``collate_fn``: splits failed images off and batches the rest with ``extractor.collate``."""

    def __init__(self, collate: Callable[[list[Any]], Any]):
        self.collate = collate

    def __call__(self, items: list[tuple[int, Any, str | None]]) -> Batch:
        good = [(i, sample) for i, sample, reason in items if reason is None]
        failures = [(i, reason) for i, _sample, reason in items if reason is not None]
        samples = self.collate([s for _, s in good]) if good else None
        return Batch([i for i, _ in good], samples, failures)


@dataclass
class ShardResult:
    index: int
    images: int
    rows: int
    errors: int
    skipped: bool
    seconds: float = 0.0


@dataclass
class ExtractionSummary:
    """What one process did; :meth:`line` is the one-line report printed at the end."""

    extractor: str
    folder: Path
    num_shards: int
    shards: list[ShardResult] = field(default_factory=list)
    index_path: Path | None = None
    index_written: bool = False
    missing_shards: int = 0
    seconds: float = 0.0

    @property
    def images(self) -> int:
        return sum(s.images for s in self.shards if not s.skipped)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def errors(self) -> int:
        return sum(s.errors for s in self.shards)

    def line(self) -> str:
        done = [s for s in self.shards if not s.skipped]
        skipped = [s for s in self.shards if s.skipped]
        run_seconds = sum(s.seconds for s in done)
        parts = [f"{self.extractor}:"]
        if done:
            rate = self.images / run_seconds if run_seconds > 0 else 0.0
            parts.append(f"{self.images} images in {len(done)} shard{'s' if len(done) != 1 else ''} "
                         f"({run_seconds:.1f} s, {rate:.2f} images/s)")
        if skipped:
            parts.append(f"{len(skipped)} shard{'s' if len(skipped) != 1 else ''} already complete, skipped;")
        parts.append(f"{self.rows} rows, {self.errors} unreadable image{'s' if self.errors != 1 else ''}"
                     + (" (listed in errors)" if self.errors else "") + ";")
        if self.index_written:
            parts.append(f"index written: {self.index_path}")
        elif self.index_path is not None:
            parts.append(f"index up to date: {self.index_path}")
        else:
            parts.append(f"index not written yet: {self.missing_shards} of {self.num_shards} shards still to do "
                         f"(the run that finishes last writes it; or `retr-pipeline index {self.folder}`)")
        return " ".join(parts)


def _comparable(attrs: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in attrs.items():
        if key in _RUN_ATTRS:
            continue
        if isinstance(value, bytes):
            value = value.decode("utf-8")
        if isinstance(value, np.ndarray):
            value = value.tolist()
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, (list, tuple, dict)):
            value = json.dumps(value)
        out[key] = value
    return out


def check_existing_shard(path: Path, attrs: dict[str, Any], dtype: str, ids: list[str]) -> None:
    """Refuse to reuse a complete shard made with other settings (attributes, dtype) or for other rows."""
    from retr.store.features import ATTRS_BEFORE_RECORDED, _attr_value  # the writer's JSON encoding
    with h5py.File(path, "r") as f:
        have = _comparable({k: f.attrs[k] for k in f.attrs})
        shard_ids = [decode_str(v) for v in f["ids"][:]]
        error_ids = [decode_str(v) for v in f["errors"][:, 0]] if len(f["errors"]) else []
    want = _comparable({k: _attr_value(v) for k, v in {**attrs, "dtype": dtype}.items()})
    for key, value in ATTRS_BEFORE_RECORDED.items():
        if key in want and key not in have:
            have[key] = value
    differing = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
    if differing:
        key = differing[0]
        raise UserError(f"{path} was made with {key} = {have.get(key)!r}, this run has {want.get(key)!r}; "
                        f"give another out folder or delete {path.parent} to start over", parameters=["out"])
    if sorted(shard_ids + error_ids) != sorted(ids):
        raise UserError(f"{path} holds other images than this manifest assigns to it; give another out folder or "
                        f"delete {path.parent} to start over", parameters=["out"])


def _worker_context() -> mp.context.BaseContext:
    """``fork`` where the platform has it: workers start in milliseconds and receive nothing by pickling (a
    ``spawn``ed worker re-imports torch, seconds per worker per shard). Workers only decode images; they never
    touch CUDA, so forking after CUDA initialisation is safe here. Elsewhere the platform default."""
    return mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()


def outside_root_refusals(records: Sequence[ManifestRecord]) -> dict[int, str]:
    """Positions of ``records`` whose path leaves the image root → the reason recorded in ``errors``."""
    refused = {}
    for i, record in enumerate(records):
        reason = outside_root_reason(record.path)
        if reason is not None:
            refused[i] = (f"path {record.path!r} leaves the image root ({reason}); not read "
                          f"(--allow-outside-root reads it)")
    return refused


@dataclass
class ExtractedBatch:
    """One batch through the network: ``positions`` (in the path list) of ``out``'s rows, and the failures."""

    positions: list[int]
    out: dict[str, np.ndarray] | None
    failures: list[tuple[int, str]]


def extracted_batches(extractor: Extractor, paths: Sequence[str], *, batch_size: int, workers: int,
                      refused: dict[int, str] | None = None) -> Iterator[ExtractedBatch]:
    """Run ``extractor`` over ``paths`` in order: DataLoader workers (``extractor.preprocessor()``), pinned
    batches on CUDA, ``extractor.to_device`` one batch ahead (:class:`DevicePrefetcher`), ``extract``.

    ``refused``: positions not to open, with the reason reported as their failure. Yields one
    :class:`ExtractedBatch` per loader batch; failures from the workers come before those found on the device.
    """
    device = torch.device(getattr(extractor, "device", "cpu"))
    loader = DataLoader(ImageFiles(paths, extractor.preprocessor(), refused), batch_size=batch_size, shuffle=False,
                        num_workers=workers, collate_fn=BatchCollator(extractor.collator()),
                        pin_memory=device.type == "cuda",
                        prefetch_factor=2 if workers > 0 else None,
                        multiprocessing_context=_worker_context() if workers > 0 else None)

    def move(batch: Batch) -> tuple[Batch, Any, list[tuple[int, str]]]:
        if not batch.positions:
            return batch, None, []
        samples, dropped = extractor.to_device(batch.samples)
        return batch, samples, dropped

    for batch, samples, dropped in DevicePrefetcher(loader, move, device):
        failures = list(batch.failures) + [(batch.positions[row], reason) for row, reason in dropped]
        gone = {row for row, _reason in dropped}
        positions = [p for row, p in enumerate(batch.positions) if row not in gone]
        out = extractor.extract(samples) if positions else None
        yield ExtractedBatch(positions, out, failures)


def extract_paths(extractor: Extractor, paths: Sequence[str], *, batch_size: int = 8,
                  workers: int = 2) -> tuple[dict[str, np.ndarray], list[tuple[int, str]]]:
    """Every output of ``extractor`` over ``paths``, in memory (no shard file): what ``bench/gpu.py`` times.

    Returns ``(outputs, failures)``: ``outputs["features"]`` ``[N', K, D]`` (and each extra) for the ``N'``
    usable paths in order; ``failures`` ``[(position in paths, one-line reason)]``. The decode path and
    precision are the extractor's own (``build_extractor(name, decode=..., autocast=..., half=...)``).
    """
    names = ["features", *extractor.extras]
    parts: dict[str, list[np.ndarray]] = {name: [] for name in names}
    failures: list[tuple[int, str]] = []
    for done in extracted_batches(extractor, paths, batch_size=batch_size, workers=workers):
        failures.extend(done.failures)
        if done.out is not None:
            for name in names:
                parts[name].append(done.out[name])
    K, D = extractor.feature_shape
    empty = {"features": np.zeros((0, K, D), np.float32),
             **{name: np.zeros((0, *shape), dtype) for name, (shape, dtype) in extractor.extras.items()}}
    outputs = {name: np.concatenate(parts[name]) if parts[name] else empty[name] for name in names}
    return outputs, sorted(failures)


@contextlib.contextmanager
def _write_errors(path: Path) -> Iterator[None]:
    """The writer's refusals (raised in the loop or in the writer thread) as one-line :class:`UserError`."""
    try:
        yield
    except NonFiniteError as exc:
        raise UserError(f"{path.name}: the network's {exc.dataset} for image {exc.image_id!r} hold NaN "
                        f"or infinite values, which no dtype stores; check the weights (a damaged or "
                        f"mismatched file?) and try without half precision") from None
    except ValueError as exc:  # e.g. values beyond float16's range: the writer says what to do
        raise UserError(f"{path.name}: {exc}") from None


def run_shard(extractor: Extractor, records: Sequence[ManifestRecord], image_root: Path, path: Path,
              attrs: dict[str, Any], dtype: str, shard_index: int, num_shards: int, batch_size: int,
              workers: int, bar, allow_outside_root: bool = False,
              write_queue: int = WRITE_QUEUE_DEPTH) -> ShardResult:
    """Extract ``records`` into the shard file ``path`` (atomically); update ``bar`` per batch.

    Paths outside ``image_root`` become ``errors`` rows without being opened unless ``allow_outside_root``.
    ``write_queue``: batches the writer thread may hold (0: write in this thread).
    """
    start = time.perf_counter()
    paths = [str(image_root / record.path) for record in records]
    refused = {} if allow_outside_root else outside_root_refusals(records)
    rows = errors = 0
    with ShardWriter(path, attrs, extractor.feature_shape, dtype=dtype, extras=extractor.extras,
                     shard_index=shard_index, num_shards=num_shards) as shard:
        writer = BackgroundWriter(shard, write_queue)
        try:
            for done in extracted_batches(extractor, paths, batch_size=batch_size, workers=workers,
                                          refused=refused):
                with _write_errors(path):
                    for position, reason in done.failures:
                        writer.add_error(records[position].id, reason)
                errors += len(done.failures)
                if done.out is not None:
                    ids = [records[p].id for p in done.positions]
                    with _write_errors(path):
                        writer.append(ids, done.out["features"],
                                      **{name: done.out[name] for name in extractor.extras})
                    rows += len(ids)
                bar.update(len(done.positions) + len(done.failures))
            with _write_errors(path):
                writer.close()   # every row on disk before the shard is renamed into place
        except BaseException:
            writer.abandon()
            raise
    return ShardResult(shard_index, len(records), rows, errors, skipped=False,
                       seconds=time.perf_counter() - start)


def _existing_shard_result(path: Path, shard_index: int) -> ShardResult:
    with h5py.File(path, "r") as f:
        rows, errors = int(f["features"].shape[0]), int(f["errors"].shape[0])
    return ShardResult(shard_index, rows + errors, rows, errors, skipped=True)


def shard_lock_path(folder: Path, shard_index: int, num_shards: int) -> Path:
    """``NAME/.shard-RRRRR-of-WWWWW.h5.lock``: the lock file of one shard."""
    return folder / f".{shard_name(shard_index, num_shards)}.lock"


def lock_shards(folder: Path, shards: Sequence[int], num_shards: int, stack: contextlib.ExitStack | None) -> None:
    """Take the exclusive lock of every shard in ``shards`` (:func:`retr.common.locks.acquire_lock`; released when
    ``stack`` closes, or the process dies).

    Raises :class:`UserError` naming the holder (pid, host, start time) if another process holds one. With
    ``stack=None`` only look: lock files that exist are tried and let go at once, nothing is created (so a run
    that is refused, or fails before writing, leaves no folder behind).
    """
    if stack is not None:
        folder.mkdir(parents=True, exist_ok=True)
    for r in shards:
        try:
            fd = acquire_lock(shard_lock_path(folder, r, num_shards), create=stack is not None)
        except LockHeldError as exc:
            raise UserError(f"another extraction ({exc.holder}) is writing {folder / shard_name(r, num_shards)}; "
                            f"wait for it to finish (its finished shards are then reused), or give another out "
                            f"folder") from None
        if fd is not None:
            if stack is None:
                os.close(fd)
            else:
                stack.callback(os.close, fd)


def write_index_when_complete(folder: Path) -> tuple[Path | None, bool, int]:
    """Under an exclusive lock: write ``DIR/NAME.h5`` if every shard is complete and the index is stale.

    Returns ``(index path or None, whether it was written now, number of shards still missing)``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".index.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        count, complete, _partial = shard_status(folder)
        if count is None:
            return None, False, 0
        missing = count - len(complete)
        if missing:
            return None, False, missing
        index = index_path_for(folder)
        shards = [complete[i] for i in range(count)]
        if is_complete(index) and all(index.stat().st_mtime_ns >= s.stat().st_mtime_ns for s in shards):
            with h5py.File(index, "r") as f:
                if int(f.attrs.get("num_shards", -1)) == count:
                    return index, False, 0
        return write_index(index, shards), True, 0


def extract_features(manifest: str | os.PathLike, extractor: str, out: str | os.PathLike, *,
                     image_root: str | os.PathLike | None = None, options: dict[str, Any] | None = None,
                     batch_size: int = 8, workers: int = 2, num_shards: int | None = None,
                     shard_index: int | None = None, dtype: str = "float16", quiet: bool = False,
                     env: DistributedEnv | None = None, allow_outside_root: bool = False,
                     write_queue: int = WRITE_QUEUE_DEPTH,
                     build: Callable[..., Extractor] = build_extractor) -> ExtractionSummary:
    """Run extractor ``extractor`` over the manifest into ``out/<extractor>/`` and index it when complete.

    Args:
        manifest: JSON Lines manifest (validated entirely before any work).
        out: the features folder; shards go to ``out/<extractor>/``, the index to ``out/<extractor>.h5``.
        image_root: folder manifest paths are relative to (default: the manifest's folder).
        options: builder options (``weights``, ``device``, ``half``, ``image_size``, …). Under torchrun a
            ``cuda`` device becomes ``cuda:LOCAL_RANK``.
        batch_size: images per network call; workers: DataLoader decoding processes (0 = in this process).
        num_shards / shard_index / env: see the module docstring.
        dtype: ``float16`` (default) or ``float32`` on disk.
        allow_outside_root: read manifest paths that leave ``image_root`` (absolute, ``..``) instead of
            recording them as errors.
        write_queue: batches waiting for the writer thread before the loop blocks (0: synchronous writes).

    Raises :class:`UserError` when another process is writing one of this run's shards (see the module
    docstring), before the network is built.
    """
    started = time.perf_counter()
    if batch_size < 1:
        raise ParameterError(f"batch_size must be at least 1, not {batch_size}", "batch_size")
    if workers < 0:
        raise ParameterError(f"workers must be 0 or more, not {workers}", "workers")
    if write_queue < 0:
        raise ParameterError(f"write_queue must be 0 or more, not {write_queue}", "write_queue")
    env = env or DistributedEnv.from_environ()
    count, mine = plan_shards(num_shards, shard_index, env)
    manifest = Path(manifest)
    records = read_manifest(manifest)
    if not records:
        raise UserError(f"manifest {manifest} has no images")
    root = Path(image_root) if image_root is not None else manifest.resolve().parent
    if not root.is_dir():
        raise UserError(f"image root {root} is not a folder (give image_root)", parameters=["image_root"])
    folder = Path(out) / extractor
    existing_count, complete, _partial = shard_status(folder)
    if existing_count is not None and existing_count != count:
        raise UserError(f"{folder} holds shards of a {existing_count}-shard run; use num_shards {existing_count} "
                        f"to resume it, or delete the folder to start over", parameters=["num_shards"])

    unfinished = [r for r in mine if r not in complete]
    lock_shards(folder, unfinished, count, None)  # refuse at once, before the network is built, if one is held
    with contextlib.ExitStack() as locks:  # this run's shard locks, held until it returns
        options = dict(options or {})
        device = str(options.get("device", "cpu"))
        if env.world_size > 1 and device == "cuda":
            options["device"] = f"cuda:{env.local_rank}"
        model = build(extractor, **options)
        lock_shards(folder, unfinished, count, locks)
        attrs = dict(model.attrs())
        attrs["manifest_sha256"] = manifest_sha256(manifest)
        if allow_outside_root and any(outside_root_reason(record.path) for record in records):
            attrs["images_outside_root"] = "read"
        ranges = shard_ranges(len(records), count)

        summary = ExtractionSummary(extractor, folder, count)
        todo = []
        for r in mine:
            start, stop = ranges[r]
            path = folder / shard_name(r, count)
            if r in complete or is_complete(path):  # (finished by another run since the folder was listed)
                check_existing_shard(path, attrs, dtype, [rec.id for rec in records[start:stop]])
                summary.shards.append(_existing_shard_result(path, r))
            else:
                todo.append(r)
        total = sum(ranges[r][1] - ranges[r][0] for r in todo)
        rank_note = f" [rank {env.rank}/{env.world_size}]" if env.world_size > 1 else ""
        with progress(total=total, desc=f"{extractor}{rank_note}", unit="img", quiet=quiet) as bar:
            for r in todo:
                start, stop = ranges[r]
                summary.shards.append(run_shard(model, records[start:stop], root, folder / shard_name(r, count),
                                                attrs, dtype, r, count, batch_size, workers, bar,
                                                allow_outside_root, write_queue))
        summary.shards.sort(key=lambda s: s.index)
        del model
        summary.index_path, summary.index_written, summary.missing_shards = write_index_when_complete(folder)
    summary.seconds = time.perf_counter() - started
    return summary
