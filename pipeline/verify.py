"""Checks of a feature set (``retr-pipeline verify``) and its one-screen summary (``retr-pipeline inspect``).

Streams every row (or a ``sample``) in ``chunk_bytes`` blocks (:func:`retr.store.integrity.check_rows`, which the
trainer's check before work shares): finite values, stored CRC-32s, shard ids against the index
(docs/extraction.md, "Checking a feature set")."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from retr.common.errors import UserError
from retr.store.features import (CHECKSUMS, FEATURE_DTYPES, FORMAT_VERSION, KINDS, NOT_ROW_DATA, PARTIAL_SUFFIX,
                                 REGION_DATASETS, REGION_IMAGE_DATASETS, ROOT_ATTRS, SHARED_ATTRS, decode_str,
                                 is_complete)
from retr.store.integrity import DEFAULT_CHUNK_BYTES, RowNames, check_rows

#: What each kind's per-sample shape (K, D) may be. ``None`` means any positive size.
#: grid: 7×7 (448 input pooled 2×2, or 224 input) or the raw 14×14; maps: 14×14 (448) or 7×7 (224);
#: tencrop: 10 crops of fc7 (4096) or ResNet pool (2048); regions: MAX_BOXES boxes (36 by default) × 2048.
KIND_SHAPES: dict[str, tuple[tuple[int, ...] | None, tuple[int, ...] | None]] = {
    "grid": ((49, 196), (2048,)),
    "maps": ((196, 49), (512,)),
    "tencrop": ((10,), (4096, 2048)),
    "regions": (None, (2048,)),
}


def _shape_problems(kind: str, shape: tuple[int, ...]) -> list[str]:
    if len(shape) != 2:
        return [f"features have {len(shape) + 1} dimensions, expected 3 ([N, K, D])"]
    if kind not in KIND_SHAPES:
        return []
    (ks, ds), (k, d) = KIND_SHAPES[kind], shape
    problems = []
    if ks is not None and k not in ks:
        problems.append(f"kind {kind!r} expects K in {ks}, features have K = {k}")
    if ds is not None and d not in ds:
        problems.append(f"kind {kind!r} expects D in {ds}, features have D = {d}")
    return problems


@dataclass
class VerifyReport:
    """What :func:`verify_report` found: ``problems`` (empty: sound), ``notes``, ``rows``, ``rows_read``,
    ``rows_checksummed``."""

    path: Path
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rows: int = 0
    rows_read: int = 0
    rows_checksummed: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_feature_set(path: str | os.PathLike, sample: int | None = None, checksum: bool = True, seed: int = 0,
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[str]:
    """Every problem found in a feature set (an empty list means sound); see :func:`verify_report`."""
    return verify_report(path, sample=sample, checksum=checksum, seed=seed, chunk_bytes=chunk_bytes).problems


def verify_report(path: str | os.PathLike, sample: int | None = None, checksum: bool = True, seed: int = 0,
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> VerifyReport:
    """Check a feature set (an index or a single shard): attributes, shards, shapes, ids, then every row's values
    (or ``sample`` rows) and, unless ``checksum`` is false, their stored checksums."""
    path = Path(path)
    report = VerifyReport(path)
    if sample is not None and sample < 0:
        raise UserError(f"sample must be 0 or more, not {sample}", parameters=["sample"])
    if path.is_dir():
        report.problems.append(f"{path} is a folder, not a feature-set file (give DIR/NAME.h5)")
        return report
    if not path.is_file():
        report.problems.append(f"{path} does not exist")
        return report
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        report.problems.append(f"{path} is not a readable HDF5 file ({exc})")
        return report
    with f:
        try:
            _verify_open_file(f, path, report, sample, checksum, seed, chunk_bytes)
        except OSError as exc:  # HDF5 could not read a block: the file is damaged there
            report.problems.append(f"reading {path} failed ({str(exc).splitlines()[0]})")
    return report


def _verify_open_file(f: h5py.File, path: Path, report: VerifyReport, sample: int | None, checksum: bool,
                      seed: int, chunk_bytes: int) -> None:
    problems = report.problems
    attrs = {k: f.attrs[k] for k in f.attrs}
    missing = [a for a in ROOT_ATTRS if a not in attrs]
    if missing:
        problems.append(f"missing root attributes: {', '.join(missing)}")
    if not attrs.get("complete", False):
        problems.append("file is not marked complete (its writer did not finish)")
    if "format_version" in attrs and _int(attrs["format_version"]) != FORMAT_VERSION:
        problems.append(f"format_version {attrs['format_version']} is not {FORMAT_VERSION}")
    kind = decode_str(attrs.get("kind", ""))
    if "kind" in attrs and kind not in KINDS:
        problems.append(f"unknown kind {kind!r} (expected one of {', '.join(KINDS)})")
    if not isinstance(f.get("ids"), h5py.Dataset) or not isinstance(f.get("features"), h5py.Dataset):
        problems.append("no 'ids' or no 'features' dataset (is this a feature set?)")
        return
    features = f["features"]
    if features.ndim != 3 or f["ids"].ndim != 1:
        problems.append(f"features have shape {features.shape} and ids {f['ids'].shape}; a feature set has "
                        f"features [N, K, D] and ids [N]")
        return
    shards = None
    if "shards" in attrs:
        shards, shard_problems = _shard_problems(path, attrs, f)
        if shard_problems:
            problems += shard_problems
            return  # the virtual datasets would read fill values: stop before reading data
    n = features.shape[0]
    report.rows = n
    problems += _shape_problems(kind, tuple(features.shape[1:]))
    declared = decode_str(attrs.get("dtype", ""))
    if declared and declared not in FEATURE_DTYPES:
        problems.append(f"dtype attribute {declared!r} is not one of {', '.join(FEATURE_DTYPES)}")
    if declared and str(features.dtype) != declared:
        problems.append(f"dtype attribute says {declared}, features are {features.dtype}")
    ids = [decode_str(v) for v in f["ids"][:]]
    if len(ids) != n:
        problems.append(f"{len(ids)} ids for {n} feature rows")
    if "num_rows" in attrs and _int(attrs["num_rows"]) != n:
        problems.append(f"num_rows attribute says {attrs['num_rows']}, features have {n} rows")
    empty = sum(1 for i in ids if not i)
    if empty:
        problems.append(f"{empty} empty ids")
    seen, duplicates = set(), []
    for image_id in ids:
        if image_id in seen:
            duplicates.append(image_id)
        seen.add(image_id)
    if duplicates:
        problems.append(f"{len(duplicates)} duplicate ids, e.g. {duplicates[0]!r}")
    for name, other in f.items():
        if name in ("ids", "errors"):
            continue
        if not isinstance(other, h5py.Dataset) or other.ndim == 0:
            problems.append(f"{name!r} is not a per-row dataset")
        elif other.shape[0] != n:
            problems.append(f"dataset {name!r} has {other.shape[0]} rows, features have {n}")
    if kind == "regions":
        problems += _region_problems(f, tuple(features.shape[1:]))
    if "errors" in f:
        errors = f["errors"]
        if errors.ndim != 2 or errors.shape[1] != 2:
            problems.append(f"errors has shape {errors.shape}, expected [E, 2] (id, reason)")
        else:
            both = sorted({decode_str(v) for v in errors[:, 0]} & seen) if len(errors) else []
            if both:
                problems.append(f"{len(both)} ids are both rows and errors, e.g. {both[0]!r}")
    if problems or n == 0:
        return
    rows = None
    if sample is not None:
        rng = np.random.default_rng(seed)
        rows = np.unique(np.concatenate([[0, n - 1], rng.choice(n, size=min(sample, n), replace=False)]))
    if shards is None:
        _check_rows(f, RowNames(path.name, 0, None), rows, checksum, chunk_bytes, report)
        return
    offset, without_sums = 0, []
    for shard in shards:
        count = int(shard["rows"])
        source = path.resolve().parent / shard["file"]
        mine = None if rows is None else rows[(rows >= offset) & (rows < offset + count)] - offset
        with h5py.File(source, "r") as s:
            problems += _compare_ids(s, shard["file"], ids[offset:offset + count], offset)
            if checksum and CHECKSUMS not in s:
                without_sums.append(shard["file"])
            _check_rows(s, RowNames(path.name, offset, shard["file"]), mine, checksum, chunk_bytes, report,
                        note_missing=False)
        offset += count
    if "errors" in f and not problems:
        problems += _compare_errors(f, path, shards)
    if without_sums:
        report.notes.append(f"no checksums in {len(without_sums)} of {len(shards)} shards (e.g. {without_sums[0]}; "
                            f"written before retr stored them): their rows were checked for finite values only")


def _check_rows(f: h5py.File, names: RowNames, rows: np.ndarray | None, checksum: bool, chunk_bytes: int,
                report: VerifyReport, note_missing: bool = True) -> None:
    """One file's rows (:func:`retr.store.integrity.check_rows`) into ``report``."""
    found = check_rows(f, names, rows, checksum, chunk_bytes)
    report.problems += found.problems
    report.rows_read += found.rows_read
    report.rows_checksummed += found.rows_checksummed
    if found.without_checksums and note_missing:
        report.notes.append(f"no checksums in {names.shard or names.set_name} (written before retr stored them): "
                            f"rows were checked for finite values only")


def _compare_ids(shard: h5py.File, shard_file: str, index_ids: list[str], offset: int) -> list[str]:
    """The index's copy of ``ids`` against the shard's own, row by row."""
    own = [decode_str(v) for v in shard["ids"][:]]
    if len(own) != len(index_ids):
        return [f"shard {shard_file} has {len(own)} ids, the index lists {len(index_ids)} for it"]
    differ = [r for r, (a, b) in enumerate(zip(index_ids, own)) if a != b]
    if not differ:
        return []
    r = differ[0]
    return [f"{len(differ)} ids of shard {shard_file} differ from the index's copy, e.g. index row {offset + r} is "
            f"{index_ids[r]!r}, row {r} of the shard is {own[r]!r} (re-write the index with `retr-pipeline index`, "
            f"or find out which file was changed)"]


def _compare_errors(f: h5py.File, path: Path, shards: list[dict]) -> list[str]:
    """The index's copy of ``errors`` against the concatenation of its shards' own."""
    index_errors = [tuple(decode_str(v) for v in row) for row in f["errors"][:]]
    shard_errors = []
    for shard in shards:
        with h5py.File(path.resolve().parent / shard["file"], "r") as s:
            if "errors" in s:
                shard_errors += [tuple(decode_str(v) for v in row) for row in s["errors"][:]]
    if index_errors != shard_errors:
        return [f"the index's errors ({len(index_errors)} rows) differ from its shards' ({len(shard_errors)} rows)"]
    return []


def _int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _shard_problems(path: Path, attrs: dict, index: h5py.File) -> tuple[list[dict], list[str]]:
    """The shards an index lists, and what is wrong with them (missing, incomplete, other rows/attrs/shapes)."""
    problems = []
    try:
        shards = json.loads(decode_str(attrs["shards"]))
        shards = [{"file": str(s["file"]), "rows": int(s["rows"])} for s in shards]
    except (json.JSONDecodeError, TypeError, KeyError, ValueError):
        return [], ["the 'shards' attribute is not a JSON list of {file, rows}"]
    if "num_shards" in attrs and _int(attrs["num_shards"]) != len(shards):
        problems.append(f"num_shards says {attrs['num_shards']}, the index lists {len(shards)}")
    shapes = {name: tuple(d.shape[1:]) for name, d in index.items()
              if name not in NOT_ROW_DATA and isinstance(d, h5py.Dataset) and d.ndim}
    total = 0
    for shard in shards:
        source = path.resolve().parent / shard["file"]
        total += shard["rows"]
        if not source.is_file():
            hint = " (a writer was interrupted: re-run the stage)" if Path(str(source) + PARTIAL_SUFFIX).exists() else ""
            problems.append(f"shard {shard['file']} is missing{hint}")
            continue
        if not is_complete(source):
            problems.append(f"shard {shard['file']} is incomplete")
            continue
        with h5py.File(source, "r") as s:
            if not isinstance(s.get("features"), h5py.Dataset) or not isinstance(s.get("ids"), h5py.Dataset):
                problems.append(f"shard {shard['file']} has no 'ids' or no 'features' dataset")
                continue
            rows = s["features"].shape[0] if s["features"].ndim else -1
            if rows != shard["rows"]:
                problems.append(f"shard {shard['file']} has {rows} rows, the index expects {shard['rows']}")
            for key in SHARED_ATTRS:
                if key in attrs and key in s.attrs and not _same(s.attrs[key], attrs[key]):
                    problems.append(f"shard {shard['file']} has {key} = {s.attrs[key]!r}, the index {attrs[key]!r}")
            for name, shape in shapes.items():
                have = tuple(s[name].shape[1:]) if isinstance(s.get(name), h5py.Dataset) else None
                if have != shape:
                    problems.append(f"shard {shard['file']} has {name!r} rows of shape {have}, the index {shape}")
    if "features" in index and index["features"].ndim and index["features"].shape[0] != total:
        problems.append(f"the index has {index['features'].shape[0]} rows, its shards list {total}")
    return shards, problems


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    return a == b


def _region_problems(f: h5py.File, feature_shape: tuple[int, ...]) -> list[str]:
    problems = []
    k = feature_shape[0]
    for name, (shape, _dtype) in REGION_DATASETS.items():
        expected = (k, *shape)
        if name not in f:
            problems.append(f"regions feature set has no {name!r} dataset")
        elif tuple(f[name].shape[1:]) != expected:
            problems.append(f"{name!r} rows have shape {tuple(f[name].shape[1:])}, expected {expected}")
    for name, (shape, _dtype) in REGION_IMAGE_DATASETS.items():
        if name not in f:
            problems.append(f"regions feature set has no {name!r} dataset")
        elif tuple(f[name].shape[1:]) != shape:
            problems.append(f"{name!r} rows have shape {tuple(f[name].shape[1:])}, expected {shape}")
    if "num_boxes" in f and len(f["num_boxes"]):
        counts = f["num_boxes"][:]
        if counts.min() < 0 or counts.max() > k:
            problems.append(f"num_boxes outside 0..{k}")
    return problems


def _human_bytes(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    raise AssertionError


def summarize_feature_set(path: str | os.PathLike) -> list[str]:
    """Lines describing a feature set: kind, extractor, weights, N, K×D, dtype, size on disk, errors."""
    path = Path(path)
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise UserError(f"{path} is not a readable HDF5 file ({str(exc).splitlines()[0]})") from None
    with f:
        if not isinstance(f.get("features"), h5py.Dataset) or f["features"].ndim != 3:
            raise UserError(f"{path} is not a feature set (no 'features' dataset [N, K, D]); "
                            f"`retr-pipeline verify {path}` says more")
        attrs = {k: f.attrs[k] for k in f.attrs}
        n, k, d = f["features"].shape
        size = path.stat().st_size
        try:
            shards = json.loads(decode_str(attrs["shards"])) if "shards" in attrs else []
            files = [str(shard["file"]) for shard in shards]
        except (json.JSONDecodeError, TypeError, KeyError) as exc:
            raise UserError(f"{path}: the 'shards' attribute is not a JSON list of shards ({exc})") from None
        for name in files:
            source = path.resolve().parent / name
            size += source.stat().st_size if source.is_file() else 0
        errors = ([tuple(decode_str(v) for v in row) for row in f["errors"][:]]
                  if isinstance(f.get("errors"), h5py.Dataset) and f["errors"].ndim == 2 else [])
        others = [name for name in f if name not in NOT_ROW_DATA and name != "features"]
        with_sums = int(CHECKSUMS in f)
        if files:
            with_sums = 0
            for name in files:
                source = path.resolve().parent / name
                if is_complete(source):
                    with h5py.File(source, "r") as s:
                        with_sums += CHECKSUMS in s
    get = lambda key: decode_str(attrs[key]) if key in attrs else "?"  # noqa: E731
    lines = [
        f"{path}",
        f"  kind       {get('kind')}  (extractor {get('extractor')}, backbone {get('backbone')})",
        f"  weights    {get('weights')}",
        f"  rows       {n:,}  × K×D = {k}×{d}  {get('dtype')}",
        f"  image size {get('image_size')}",
        f"  on disk    {_human_bytes(size)}" + (f" in {len(shards)} shards" if shards else " (single file)"),
        f"  manifest   sha256 {get('manifest_sha256')[:16]}…",
        f"  created    {get('created')} by retr {get('retr_version')}",
    ]
    if others:
        lines.append(f"  also       {', '.join(others)}")
    if files:
        lines.append(f"  checksums  per row in {with_sums} of {len(files)} shards")
    else:
        lines.append(f"  checksums  {'per row' if with_sums else 'none (written before retr stored them)'}")
    lines.append(f"  errors     {len(errors)}")
    for image_id, reason in errors[:10]:
        lines.append(f"    {image_id}: {reason}")
    if len(errors) > 10:
        lines.append(f"    … {len(errors) - 10} more")
    return lines
