"""The extraction stage: manifest → sharded feature set (``DIR/NAME/shard-*.h5`` + the index ``DIR/NAME.h5``).

Sharding, resume, shard locks, the index without a process group, image paths outside the root, decoding and the
CUDA overlap: docs/extraction.md ("Options of retr-pipeline extract", "Decisions the code relies on", "On the
GPU")."""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import h5py
import numpy as np

from retr.common.progress import progress
from retr.common.errors import ParameterError, UserError
from retr.common.locks import LockHeldError, acquire_lock, waiting_lock
from retr.common.torchrun import TorchrunEnv
from retr.extractors.base import Extractor, build_extractor
from retr.extractors.batches import extract_paths, extracted_batches  # noqa: F401  (extract_paths: bench/gpu.py)
from retr.manifests.schema import ManifestRecord, manifest_sha256, outside_root_reason, read_manifest
from retr.pipeline.write_thread import WRITE_QUEUE_DEPTH, BackgroundWriter
from retr.store.features import (ATTRS_BEFORE_RECORDED, NonFiniteError, ShardWriter, _attr_value, decode_str,
                                 index_path_for, is_complete, shard_name, shard_status, write_index)

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


def outside_root_refusals(records: Sequence[ManifestRecord]) -> dict[int, str]:
    """Positions of ``records`` whose path leaves the image root → the reason recorded in ``errors``."""
    refused = {}
    for i, record in enumerate(records):
        reason = outside_root_reason(record.path)
        if reason is not None:
            refused[i] = (f"path {record.path!r} leaves the image root ({reason}); not read "
                          f"(--allow-outside-root reads it)")
    return refused


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
    """Extract ``records`` into the shard file ``path`` (atomically); ``write_queue``: writer-thread depth (0: inline)."""
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
    """Take the exclusive lock of every shard in ``shards`` (released when ``stack`` closes or the process dies).

    Raises :class:`UserError` naming the holder. ``stack=None``: only try existing lock files, create nothing."""
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
    """Under an exclusive lock, write ``DIR/NAME.h5`` if every shard is complete and the index is stale.

    Returns ``(index path or None, whether it was written now, number of shards still missing)``."""
    with waiting_lock(folder / ".index.lock"):
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
    """Run ``extractor`` over the manifest into ``out/<extractor>/`` and index it when complete.

    ``image_root`` defaults to the manifest's folder; ``options`` are the builder's (under torchrun ``cuda`` becomes
    ``cuda:LOCAL_RANK``); ``num_shards``/``shard_index``/``env`` choose the shards. Raises :class:`UserError`,
    before the network is built, when another process writes one of this run's shards."""
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
