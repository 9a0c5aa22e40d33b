"""The HDF5 feature store: shard writer, index writer and reader (the "feature set" contract).

Layout, attributes, atomicity, per-row checksums and lazy per-process reading: docs/DESIGN.md ("Contracts")."""
from __future__ import annotations

import json
import os
import re
import zlib
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import h5py
import numpy as np

from retr.common.atomic import PARTIAL_SUFFIX, atomic_hdf5, partial_path
from retr.common.errors import UserError
from retr.common.version import __version__
from retr.store.row_reader import RowReader, row_layout

FORMAT_VERSION = 1
KINDS = ("grid", "maps", "tencrop", "regions", "clip")   # clip: row 0 the image embedding, then patches
#: Attributes every feature-set file carries at its root.
ROOT_ATTRS = ("format_version", "kind", "extractor", "backbone", "weights", "image_size", "dtype",
              "manifest_sha256", "created", "retr_version")
#: Attributes that must agree between the shards of one feature set and their index.
SHARED_ATTRS = ("format_version", "kind", "extractor", "backbone", "weights", "image_size", "dtype",
                "manifest_sha256")
#: Per-row datasets a ``regions`` feature set has besides ``features``: name → (shape after [N, K], dtype).
REGION_DATASETS = {
    "boxes": ((4,), "float32"),
    "object_ids": ((), "int32"),
    "object_conf": ((), "float32"),
    "attr_ids": ((), "int32"),
    "attr_conf": ((), "float32"),
}
#: Per-row datasets of a ``regions`` set that do not have the K axis: name → (shape after [N], dtype).
REGION_IMAGE_DATASETS = {"num_boxes": ((), "int32"), "image_hw": ((2,), "int32")}
FEATURE_DTYPES = ("float16", "float32")
#: row order of a ``tencrop`` feature set (torchvision's ``ten_crop``): the four corners, the centre, then the
#: same five of the horizontally flipped image
TENCROP_ORDER = ("top-left", "top-right", "bottom-left", "bottom-right", "centre",
                 "flipped top-left", "flipped top-right", "flipped bottom-left", "flipped bottom-right", "flipped centre")

#: The per-row checksum dataset of a shard, and its algorithm (the dataset's ``algorithm`` attribute).
CHECKSUMS = "checksums"
#: What extraction settings a set written before they were recorded was made with (Pillow decoding, no autocast,
#: the default memory format, no TF32): extraction reuses such shards for these settings, reproduce reads them so.
#: (A set made on CUDA before ``tf32`` was recorded — butd-regions before 2026-11-26, the backbones and CLIP before
#: 2026-11-28 — ran PyTorch's default TF32 convolutions: resumed now, its remaining shards are exact float32;
#: docs/butd.md, TF32.)
ATTRS_BEFORE_RECORDED = {"decode": "cpu", "autocast": "none", "channels_last": False, "tf32": False}
CHECKSUM_ALGORITHM = "crc32(id utf-8 + NUL, features, other per-row datasets in name order; little-endian)"
#: Datasets that are not per-row data: the index copies ``ids``/``errors`` and leaves ``checksums`` in the shards.
NOT_ROW_DATA = ("ids", "errors", CHECKSUMS)

_STR = h5py.string_dtype("utf-8")


class NonFiniteError(ValueError):
    """Rows handed to :meth:`ShardWriter.append` hold NaN or ±inf: ``image_id`` (first), ``dataset``, ``count``."""

    def __init__(self, image_id: str, dataset: str, count: int, file_name: str):
        self.image_id, self.dataset, self.count = image_id, dataset, count
        more = f" ({count} rows of this batch)" if count > 1 else ""
        super().__init__(f"{dataset} of id {image_id!r}{more} hold NaN or infinite values, which {file_name} "
                         f"does not store in any dtype")


def row_checksums(ids: Sequence[str], arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The CRC-32 of each row: ``ids`` [B] and ``arrays`` (each [B, …], ``features`` first, then by name) → ``[B]``
    uint32."""
    little = [np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")) for a in map(np.asarray, arrays)]
    out = np.empty(len(ids), dtype=np.uint32)
    for row, image_id in enumerate(ids):
        crc = zlib.crc32(str(image_id).encode("utf-8") + b"\0")
        for array in little:
            crc = zlib.crc32(memoryview(array[row]).cast("B"), crc)
        out[row] = crc
    return out


def non_finite_rows(array: np.ndarray) -> np.ndarray:
    """``[B]`` bool: which rows of ``array`` [B, …] hold a NaN or ±inf (float16 tested on its bits: 2× faster)."""
    array = np.asarray(array)
    if array.dtype.kind != "f":
        return np.zeros(len(array), dtype=bool)
    flat = array.reshape(len(array), -1)
    if array.dtype == np.float16:
        bits = flat.view(np.uint16)
        return ((bits & 0x7C00) == 0x7C00).any(axis=1)  # exponent all ones: inf or NaN
    return ~np.isfinite(flat).all(axis=1)


def shard_name(index: int, count: int) -> str:
    """``shard-RRRRR-of-WWWWW.h5`` for shard ``index`` of ``count``."""
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} out of range for {count} shards")
    return f"shard-{index:05d}-of-{count:05d}.h5"


def _attr_value(value):
    """HDF5 attributes hold strings and numbers; anything else is stored as JSON text."""
    if isinstance(value, (str, int, float, bool, np.integer, np.floating)):
        return value
    return json.dumps(value)


def decode_str(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class ClosesOrAborts:
    """Context manager: :meth:`close` on success, ``abort`` (remove the partial file) on an exception."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close() if exc_type is None else self.abort()


class ShardWriter(ClosesOrAborts):
    """Append batches of rows to one shard; the finished file appears only on :meth:`close`.

    ``attrs``: root attributes (``format_version``, ``dtype``, ``created``, ``retr_version`` filled in here);
    ``feature_shape`` ``(K, D)``; ``extras``: name → (row shape, dtype), e.g. ``{"boxes": ((36, 4), "float32")}``;
    ``compression``: None, ``"lzf"`` or ``"gzip"``. As a context manager an exception removes the partial file."""

    def __init__(self, path: str | os.PathLike, attrs: Mapping[str, object], feature_shape: tuple[int, int],
                 dtype: str = "float16", extras: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
                 shard_index: int = 0, num_shards: int = 1, compression: str | None = None):
        if dtype not in FEATURE_DTYPES:
            raise UserError(f"feature dtype must be one of {', '.join(FEATURE_DTYPES)}, not {dtype!r}")
        kind = attrs.get("kind")
        if kind not in KINDS:
            raise UserError(f"feature-set kind must be one of {', '.join(KINDS)}, not {kind!r}")
        self.path = Path(path)
        self.partial_path = partial_path(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.feature_shape = tuple(int(n) for n in feature_shape)
        self.dtype = np.dtype(dtype)
        self.extras = dict(extras or {})
        self._errors: list[tuple[str, str]] = []
        self._rows = 0
        self._ids: set[str] = set()
        self._file = h5py.File(self.partial_path, "w")
        f = self._file
        for key, value in attrs.items():
            f.attrs[key] = _attr_value(value)
        f.attrs.update({"format_version": FORMAT_VERSION, "dtype": dtype, "retr_version": __version__,
                        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "shard_index": shard_index, "num_shards": num_shards, "complete": False})
        missing = [a for a in ROOT_ATTRS if a not in f.attrs]
        if missing:
            self._discard()
            raise UserError(f"feature-set attributes missing: {', '.join(missing)}")
        f.create_dataset("ids", shape=(0,), maxshape=(None,), dtype=_STR, chunks=(1024,))
        k, d = self.feature_shape
        f.create_dataset("features", shape=(0, k, d), maxshape=(None, k, d), dtype=self.dtype,
                         chunks=(1, k, d), compression=compression)
        for name, (shape, extra_dtype) in self.extras.items():
            if name in NOT_ROW_DATA or name == "features":
                self._discard()
                raise ValueError(f"{name!r} is a reserved dataset name, not an extra")
            shape = tuple(shape)
            f.create_dataset(name, shape=(0, *shape), maxshape=(None, *shape), dtype=np.dtype(extra_dtype),
                             chunks=(min(256, 1 << 20 // max(1, int(np.prod(shape or (1,))))), *shape))
        sums = f.create_dataset(CHECKSUMS, shape=(0,), maxshape=(None,), dtype=np.uint32, chunks=(4096,))
        sums.attrs["algorithm"] = CHECKSUM_ALGORITHM

    @property
    def num_rows(self) -> int:
        return self._rows

    def append(self, ids: Sequence[str], features: np.ndarray, **extras: np.ndarray) -> None:
        """Add ``B`` rows: ``ids`` [B], ``features`` [B, K, D] (cast to the file dtype), each extra [B, …].

        Raises ``ValueError`` (shape, unknown extra, repeated id, beyond float16) or :class:`NonFiniteError`;
        nothing of the batch is written then."""
        ids = [str(i) for i in ids]
        features = np.asarray(features)
        batch = len(ids)
        if features.shape != (batch, *self.feature_shape):
            raise ValueError(f"features have shape {features.shape}, expected {(batch, *self.feature_shape)}")
        if set(extras) != set(self.extras):
            raise ValueError(f"extras {sorted(extras)} differ from the declared {sorted(self.extras)}")
        batch_ids: set[str] = set()
        for image_id in ids:
            if image_id in self._ids or image_id in batch_ids:
                raise ValueError(f"id {image_id!r} written twice to {self.path.name}")
            batch_ids.add(image_id)
        f = self._file
        arrays = {"features": features}
        arrays.update({name: np.asarray(extras[name], dtype=f[name].dtype) for name in sorted(self.extras)})
        for name, values in arrays.items():
            bad = non_finite_rows(values)
            if bad.any():
                raise NonFiniteError(ids[int(np.argmax(bad))], name, int(bad.sum()), self.path.name)
        if self.dtype == np.float16:
            peak = max(abs(float(features.max(initial=0.0))), abs(float(features.min(initial=0.0))))  # no copy
            if peak > float(np.finfo(np.float16).max):
                raise ValueError(f"features reach {peak:.3g}, beyond float16's range; write with dtype float32")
        arrays["features"] = features.astype(self.dtype, copy=False)
        sums = row_checksums(ids, list(arrays.values()))
        self._ids |= batch_ids
        start, stop = self._rows, self._rows + batch
        for name in ("ids", CHECKSUMS, *arrays):
            f[name].resize(stop, axis=0)
        f["ids"][start:stop] = ids
        f[CHECKSUMS][start:stop] = sums
        for name, values in arrays.items():
            f[name][start:stop] = values
        self._rows = stop

    def add_error(self, image_id: str, reason: str) -> None:
        """Record an image that could not be used (it gets no row)."""
        self._errors.append((str(image_id), str(reason)))

    def close(self) -> Path:
        """Write errors and ``complete``, flush, close and rename to the final name; returns the final path."""
        f = self._file
        errors = np.array(self._errors, dtype=object).reshape(len(self._errors), 2)
        f.create_dataset("errors", data=errors, dtype=_STR, maxshape=(None, 2))
        f.attrs["num_rows"] = self._rows
        f.attrs["complete"] = True
        f.flush()
        f.close()
        os.replace(self.partial_path, self.path)
        return self.path

    def _discard(self) -> None:
        try:
            self._file.close()
        finally:
            self.partial_path.unlink(missing_ok=True)

    def abort(self) -> None:
        """Close and delete the partial file."""
        self._discard()


def is_complete(path: str | os.PathLike) -> bool:
    """True if ``path`` is a finished shard (exists under its final name and carries ``complete = True``)."""
    path = Path(path)
    if not path.is_file() or path.name.endswith(PARTIAL_SUFFIX):
        return False
    try:
        with h5py.File(path, "r") as f:
            return bool(f.attrs.get("complete", False))
    except OSError:
        return False


def write_index(index_path: str | os.PathLike, shard_paths: Sequence[str | os.PathLike]) -> Path:
    """Join complete shards, in the order given, into one index file of HDF5 virtual datasets (atomically)."""
    index_path = Path(index_path)
    if not shard_paths:
        raise UserError(f"no shards to index for {index_path}")
    infos = []
    for shard in map(Path, shard_paths):
        if not is_complete(shard):
            raise UserError(f"shard {shard} is missing or incomplete; finish it before writing the index")
        with h5py.File(shard, "r") as f:
            infos.append({
                "path": shard,
                "attrs": {k: f.attrs[k] for k in f.attrs},
                "rows": int(f["features"].shape[0]),
                "datasets": {name: (f[name].shape[1:], f[name].dtype) for name in f
                             if name not in NOT_ROW_DATA},
                "ids": [decode_str(v) for v in f["ids"][:]],
                "errors": [tuple(decode_str(v) for v in row) for row in f["errors"][:]],
            })
    first = infos[0]
    for info in infos[1:]:
        for key in SHARED_ATTRS:
            if _attr_equal(info["attrs"].get(key), first["attrs"].get(key)) is False:
                raise UserError(f"shards disagree on {key!r}: {first['path'].name} has "
                                f"{first['attrs'].get(key)!r}, {info['path'].name} has {info['attrs'].get(key)!r}")
        if info["datasets"] != first["datasets"]:
            raise UserError(f"shards {first['path'].name} and {info['path'].name} have different datasets/shapes")
    ids = [i for info in infos for i in info["ids"]]
    if len(set(ids)) != len(ids):
        raise UserError(f"the shards of {index_path} share ids; each image belongs to exactly one shard")
    total = len(ids)
    index_dir = index_path.resolve().parent
    with atomic_hdf5(index_path) as out:
        for key, value in first["attrs"].items():
            if key not in ("shard_index", "num_shards", "complete", "num_rows"):
                out.attrs[key] = value
        out.attrs["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        out.attrs["num_shards"] = len(infos)
        out.attrs["shards"] = json.dumps([{"file": os.path.relpath(i["path"].resolve(), index_dir),
                                           "rows": i["rows"]} for i in infos])
        out.create_dataset("ids", data=np.array(ids, dtype=object), dtype=_STR)
        errors = [e for info in infos for e in info["errors"]]
        out.create_dataset("errors", data=np.array(errors, dtype=object).reshape(len(errors), 2), dtype=_STR,
                           maxshape=(None, 2))
        for name, (shape, dtype) in first["datasets"].items():
            layout = h5py.VirtualLayout(shape=(total, *shape), dtype=dtype)
            start = 0
            for info in infos:
                rel = os.path.relpath(info["path"].resolve(), index_dir)
                layout[start:start + info["rows"]] = h5py.VirtualSource(rel, name, shape=(info["rows"], *shape))
                start += info["rows"]
            out.create_virtual_dataset(name, layout, fillvalue=np.nan if np.dtype(dtype).kind == "f" else 0)
        out.attrs["num_rows"] = total
    return index_path


def _attr_equal(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    return a == b


class FeatureSet:
    """Read a feature set (an index or a single shard) by row or by id; safe to pass to DataLoader workers.

    ``ids`` ``[N]`` str, ``attrs`` (JSON-valued ones decoded), ``feature_shape`` ``(K, D)``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if self.path.is_dir():
            raise UserError(f"feature set {self.path} is a folder, not a feature-set .h5 file")
        if not self.path.is_file():
            raise UserError(f"feature set {self.path} does not exist")
        try:
            f = h5py.File(self.path, "r")
        except OSError as exc:
            raise UserError(f"{self.path} is not a readable HDF5 file ({exc})") from None
        with f:
            if "features" not in f or "ids" not in f:
                raise UserError(f"{self.path} is not a feature set (no 'features'/'ids' datasets)")
            if not f.attrs.get("complete", False):
                raise UserError(f"{self.path} is incomplete (its writer did not finish); re-run the stage")
            self.attrs = {key: _decode_attr(f.attrs[key]) for key in f.attrs}
            self.ids = np.array([decode_str(v) for v in f["ids"][:]], dtype=object)
            self.feature_shape = tuple(f["features"].shape[1:])
            self.dtype = f["features"].dtype
            self.datasets = {name: (tuple(f[name].shape[1:]), f[name].dtype) for name in f
                             if name not in NOT_ROW_DATA}
            self.errors = [tuple(decode_str(v) for v in row) for row in f["errors"][:]] if "errors" in f else []
        self._check_shards()
        self._row_of = {image_id: row for row, image_id in enumerate(self.ids)}
        self._file: h5py.File | None = None
        self._pid: int | None = None
        self._direct: dict[str, tuple[RowReader | None, str]] = {}   # dataset name → (its reader or None, why)

    def _check_shards(self) -> None:
        shards = self.attrs.get("shards")
        if not shards:
            return
        for shard in shards:
            source = self.path.resolve().parent / shard["file"]
            if not is_complete(source):
                raise UserError(f"{self.path}: shard {shard['file']} is missing or incomplete "
                                f"(run `retr-pipeline verify {self.path}`)")

    # -- metadata ----------------------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        return str(self.attrs["kind"])

    def __len__(self) -> int:
        return len(self.ids)

    def rows_of(self, ids: Iterable[str]) -> np.ndarray:
        """Row numbers ``[B]`` of ``ids``; a ``KeyError`` names the first id that is not in the set."""
        try:
            return np.array([self._row_of[i] for i in ids], dtype=np.int64)
        except KeyError as exc:
            raise KeyError(f"id {exc.args[0]!r} is not in {self.path}") from None

    def __contains__(self, image_id: str) -> bool:
        return image_id in self._row_of

    # -- data ----------------------------------------------------------------------------------------------
    def _handle(self) -> h5py.File:
        if self._file is None or self._pid != os.getpid():
            self._file = h5py.File(self.path, "r")
            self._pid = os.getpid()
        return self._file

    def how_read(self, name: str = "features") -> tuple[str, str]:
        """How :meth:`read_rows` reads dataset ``name``, and why: ``("pread", …)`` — positional reads at each row's
        byte offset (:mod:`retr.store.row_reader`), for uncompressed rows in whole-row chunks or one block, through
        an index's virtual datasets too — or ``("h5py", the reason)``, e.g. a compressed set. Decided on the first
        call for each dataset (the offsets found then travel with the set to DataLoader workers)."""
        if name not in self._direct:
            if name not in self.datasets:
                raise KeyError(f"{self.path} has no dataset {name!r}")
            layout, why = row_layout(self._handle()[name], self.path)
            self._direct[name] = (RowReader(layout) if layout is not None else None, why)
        reader, why = self._direct[name]
        return ("pread" if reader is not None else "h5py"), why

    def read_rows(self, rows: Sequence[int] | np.ndarray, name: str = "features",
                  out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``[B, …]`` of dataset ``name`` in the order given (any order, repeats allowed), read in file order
        underneath (:meth:`how_read`); into ``out`` (``[B, …]``, C-contiguous, the dataset's dtype) when given."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        shape, dtype = self.datasets[name]
        if out is None:
            out = np.empty((rows.size, *shape), dtype=dtype)
        elif out.shape != (rows.size, *shape) or out.dtype != dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous {dtype} array of shape {(rows.size, *shape)}")
        if rows.size == 0:
            return out
        if rows.min() < 0 or rows.max() >= len(self):
            raise IndexError(f"row out of range 0..{len(self) - 1}")
        self.how_read(name)
        reader = self._direct[name][0]
        if reader is not None:
            reader.read(rows, out)
            return out
        unique, inverse = np.unique(rows, return_inverse=True)
        in_order = unique.size == rows.size and np.array_equal(unique, rows)
        dataset = self._handle()[name]
        # h5py's fancy (point-list) selection is ~80x slower than slice reads for one-sample chunks
        # (bench/store.py), so sorted rows are read as contiguous runs of slices, straight into the block:
        # `block[...] = dataset[...]` would first build a temporary of the run, doubling the peak memory of a
        # long run (preloading a split reads it as one run)
        block = out if in_order else np.empty((unique.size, *shape), dtype=dtype)
        breaks = np.flatnonzero(np.diff(unique) != 1) + 1
        for run in np.split(np.arange(unique.size), breaks):
            first, last = int(unique[run[0]]), int(unique[run[-1]])
            dataset.read_direct(block, np.s_[first:last + 1], np.s_[int(run[0]):int(run[-1]) + 1])
        if not in_order:
            out[...] = block[inverse]
        return out

    def read_ids(self, ids: Iterable[str], name: str = "features") -> np.ndarray:
        """Rows ``[B, …]`` of dataset ``name`` for ``ids``."""
        return self.read_rows(self.rows_of(ids), name)

    def read_all(self, name: str = "features") -> np.ndarray:
        """The whole dataset ``[N, …]`` in memory."""
        if self.how_read(name)[0] == "pread":
            return self.read_rows(np.arange(len(self)), name)
        return self._handle()[name][...]

    def close(self) -> None:
        if self._file is not None and self._pid == os.getpid():
            self._file.close()
        self._file = None
        for reader, _ in self._direct.values():
            if reader is not None:
                reader.close()

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_file"] = None
        state["_pid"] = None
        return state

    def __enter__(self) -> "FeatureSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _decode_attr(value):
    if isinstance(value, bytes):
        value = value.decode("utf-8")
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    if isinstance(value, np.generic):
        return value.item()
    return value


_SHARD_PATTERN = re.compile(r"^shard-(\d{5})-of-(\d{5})\.h5$")


def shard_status(folder: str | os.PathLike) -> tuple[int | None, dict[int, Path], list[Path]]:
    """What a shard folder holds: (number of shards W or None, complete shards by index, partial files)."""
    folder = Path(folder)
    complete: dict[int, Path] = {}
    counts: set[int] = set()
    partial = sorted(folder.glob("shard-*" + PARTIAL_SUFFIX)) if folder.is_dir() else []
    for path in sorted(folder.glob("shard-*.h5")) if folder.is_dir() else []:
        match = _SHARD_PATTERN.match(path.name)
        if match is None:
            continue
        index, count = int(match.group(1)), int(match.group(2))
        counts.add(count)
        if is_complete(path):
            complete[index] = path
    if len(counts) > 1:
        raise UserError(f"{folder} mixes shards of different runs (of {sorted(counts)}); remove the stale ones")
    return (counts.pop() if counts else None), complete, partial


def index_path_for(folder: str | os.PathLike) -> Path:
    """``DIR/NAME.h5`` for the shard folder ``DIR/NAME``."""
    folder = Path(folder)
    return folder.with_name(folder.name + ".h5")


def index_shard_folder(folder: str | os.PathLike) -> Path:
    """Write ``DIR/NAME.h5`` over every shard of ``DIR/NAME`` once all W shards are complete."""
    folder = Path(folder)
    count, complete, partial = shard_status(folder)
    if count is None:
        raise UserError(f"no shard files (shard-RRRRR-of-WWWWW.h5) in {folder}")
    missing = [shard_name(i, count) for i in range(count) if i not in complete]
    if missing:
        note = f"; {len(partial)} partial file(s) show an interrupted writer" if partial else ""
        raise UserError(f"{len(missing)} of {count} shards missing or incomplete in {folder} "
                        f"(e.g. {missing[0]}){note}; run the remaining shards first")
    return write_index(index_path_for(folder), [complete[i] for i in range(count)])
