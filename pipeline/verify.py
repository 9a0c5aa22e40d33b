"""Checks of a feature set (``retr-pipeline verify``) and its one-screen summary (``retr-pipeline inspect``)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np

from retr.store.features import (FEATURE_DTYPES, FORMAT_VERSION, KINDS, PARTIAL_SUFFIX, REGION_DATASETS,
                                 REGION_IMAGE_DATASETS, ROOT_ATTRS, SHARED_ATTRS, decode_str, is_complete)

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


def verify_feature_set(path: str | os.PathLike, sample_rows: int = 64, seed: int = 0) -> list[str]:
    """Every problem found in a feature set (an empty list means sound).

    Checks: root attributes present, known and consistent with the data (and, for an index, with every shard);
    every shard listed by an index present and complete with the row count recorded; shapes as ``kind``
    requires (plus the regions datasets); ids non-empty and unique; error ids absent from the rows; a random
    sample of ``sample_rows`` rows (plus the first and last) finite.
    """
    path = Path(path)
    if not path.is_file():
        return [f"{path} does not exist"]
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        return [f"{path} is not a readable HDF5 file ({exc})"]
    problems: list[str] = []
    with f:
        attrs = {k: f.attrs[k] for k in f.attrs}
        missing = [a for a in ROOT_ATTRS if a not in attrs]
        if missing:
            problems.append(f"missing root attributes: {', '.join(missing)}")
        if not attrs.get("complete", False):
            problems.append("file is not marked complete (its writer did not finish)")
        if "format_version" in attrs and int(attrs["format_version"]) != FORMAT_VERSION:
            problems.append(f"format_version {attrs['format_version']} is not {FORMAT_VERSION}")
        kind = decode_str(attrs.get("kind", ""))
        if "kind" in attrs and kind not in KINDS:
            problems.append(f"unknown kind {kind!r} (expected one of {', '.join(KINDS)})")
        if "ids" not in f or "features" not in f:
            return problems + ["no 'ids' or no 'features' dataset"]
        if "shards" in attrs:
            problems += _shard_problems(path, attrs)
            if problems and any("shard" in p for p in problems):
                return problems  # the virtual datasets would read fill values: stop before reading data
        features = f["features"]
        n = features.shape[0]
        problems += _shape_problems(kind, tuple(features.shape[1:]))
        declared = decode_str(attrs.get("dtype", ""))
        if declared and declared not in FEATURE_DTYPES:
            problems.append(f"dtype attribute {declared!r} is not one of {', '.join(FEATURE_DTYPES)}")
        if declared and str(features.dtype) != declared:
            problems.append(f"dtype attribute says {declared}, features are {features.dtype}")
        ids = [decode_str(v) for v in f["ids"][:]]
        if len(ids) != n:
            problems.append(f"{len(ids)} ids for {n} feature rows")
        if "num_rows" in attrs and int(attrs["num_rows"]) != n:
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
            if name not in ("ids", "errors") and other.shape[0] != n:
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
        if n:
            rng = np.random.default_rng(seed)
            rows = np.unique(np.concatenate([[0, n - 1], rng.choice(n, size=min(sample_rows, n), replace=False)]))
            for name in ("features", "boxes", "object_conf", "attr_conf"):
                if name in f and f[name].dtype.kind == "f":
                    block = f[name][rows]
                    bad = ~np.isfinite(block.reshape(len(rows), -1)).all(axis=1)
                    if bad.any():
                        problems.append(f"{int(bad.sum())} of {len(rows)} sampled rows of {name!r} are not finite, "
                                        f"e.g. row {int(rows[bad][0])} (id {ids[int(rows[bad][0])]!r})")
    return problems


def _shard_problems(path: Path, attrs: dict) -> list[str]:
    problems = []
    try:
        shards = json.loads(decode_str(attrs["shards"]))
    except (json.JSONDecodeError, TypeError):
        return ["the 'shards' attribute is not a JSON list"]
    if "num_shards" in attrs and int(attrs["num_shards"]) != len(shards):
        problems.append(f"num_shards says {attrs['num_shards']}, the index lists {len(shards)}")
    total = 0
    for shard in shards:
        source = path.resolve().parent / shard["file"]
        total += int(shard["rows"])
        if not source.is_file():
            hint = " (a writer was interrupted: re-run the stage)" if Path(str(source) + PARTIAL_SUFFIX).exists() else ""
            problems.append(f"shard {shard['file']} is missing{hint}")
            continue
        if not is_complete(source):
            problems.append(f"shard {shard['file']} is incomplete")
            continue
        with h5py.File(source, "r") as s:
            rows = s["features"].shape[0]
            if rows != int(shard["rows"]):
                problems.append(f"shard {shard['file']} has {rows} rows, the index expects {shard['rows']}")
            for key in SHARED_ATTRS:
                if key in attrs and key in s.attrs and not _same(s.attrs[key], attrs[key]):
                    problems.append(f"shard {shard['file']} has {key} = {s.attrs[key]!r}, the index {attrs[key]!r}")
    return problems


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
    with h5py.File(path, "r") as f:
        attrs = {k: f.attrs[k] for k in f.attrs}
        n, k, d = f["features"].shape
        size = path.stat().st_size
        shards = json.loads(decode_str(attrs["shards"])) if "shards" in attrs else []
        for shard in shards:
            source = path.resolve().parent / shard["file"]
            size += source.stat().st_size if source.is_file() else 0
        errors = [tuple(decode_str(v) for v in row) for row in f["errors"][:]] if "errors" in f else []
        others = [name for name in f if name not in ("ids", "features", "errors")]
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
    lines.append(f"  errors     {len(errors)}")
    for image_id, reason in errors[:10]:
        lines.append(f"    {image_id}: {reason}")
    if len(errors) > 10:
        lines.append(f"    … {len(errors) - 10} more")
    return lines
