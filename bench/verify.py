"""What checking every row costs: ``retr-pipeline verify`` (all rows streamed, checksums) against the old sampled
verify, and the shard writer with checksums against the old writer — both baselines run in the same process.

Builds a ``regions`` feature set of ``--rows`` images, 36 × 2048 float16 (the bottom-up-attention shape, with
its boxes and labels), in ``--shards`` shards plus the index, in a temporary folder, then times:

* ``write``        — writing the shards with this version's :class:`ShardWriter` (NaN/inf refusal, one CRC-32
  per row); baseline: the writer of ``--baseline-ref`` (the commit before checksums), writing the same rows;
* ``verify``       — :func:`retr.pipeline.verify.verify_report` in its modes: every row with checksums (the
  default), every row without (``--no-checksum``), ``--sample 64`` with and without checksums; baseline: the
  ``verify_feature_set`` of ``--baseline-ref``, which read 64 random rows (plus the first and last);
* ``before work``  — :func:`retr.store.integrity.verify_rows`, the check training and evaluation run first: on
  first use (every row read, the files remembered in a fresh ``$RETR_CACHE``) and once remembered (the files'
  states only); baseline: the full ``verify`` of this run.

The baselines' code is read from git (``git show REF:store/features.py`` / ``pipeline/verify.py``) and run as
it was. Reads come from the page cache (the files were just written): this measures the checks' own cost, not
the disk; on a cold disk a full verify is bounded by the disk's read rate instead. ``peak_mb`` is the largest
Python/numpy allocation seen by ``tracemalloc`` during the call (the memory bound of streaming).

Prints one JSON line per result, each with its baseline measured in the same run.

    .venv/bin/python bench/verify.py [--rows 4000] [--shards 4] [--baseline-ref f3b9165]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
import types
from pathlib import Path

import numpy as np

from retr.store.features import REGION_DATASETS, REGION_IMAGE_DATASETS, ShardWriter, shard_name, write_index
from retr.pipeline.verify import verify_report
from retr.store.integrity import verify_rows

REPO = Path(__file__).resolve().parents[1]
K, D = 36, 2048
ATTRS = dict(kind="regions", extractor="butd-regions", backbone="resnet101-c4-caffe", weights="random",
             image_size=600, manifest_sha256="0" * 64)
EXTRAS = {**{name: ((K, *shape), dtype) for name, (shape, dtype) in REGION_DATASETS.items()},
          **{name: (shape, dtype) for name, (shape, dtype) in REGION_IMAGE_DATASETS.items()}}


def old_module(ref: str, path: str, name: str) -> types.ModuleType:
    """The module at ``path`` as it was at git ``ref``, executed under ``name``."""
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{ref}:{path}"], capture_output=True, text=True,
                            check=True).stdout
    module = types.ModuleType(name)
    module.__file__ = f"{ref}:{path}"
    sys.modules[name] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def batches(lo: int, hi: int, seed: int, block: int = 64):
    """``(ids [B], features [B, 36, 2048] float32, extras)`` blocks of synthetic region rows ``lo..hi``."""
    rng = np.random.default_rng([seed, lo])
    for start in range(lo, hi, block):
        b = min(block, hi - start)
        extras = {"boxes": rng.uniform(0, 600, (b, K, 4)).astype(np.float32),
                  "object_ids": rng.integers(0, 1600, (b, K)).astype(np.int32),
                  "object_conf": rng.random((b, K), dtype=np.float32),
                  "attr_ids": rng.integers(0, 400, (b, K)).astype(np.int32),
                  "attr_conf": rng.random((b, K), dtype=np.float32),
                  "num_boxes": np.full(b, K, np.int32), "image_hw": np.tile([[480, 640]], (b, 1)).astype(np.int32)}
        yield [f"img_{start + i}" for i in range(b)], rng.standard_normal((b, K, D), dtype=np.float32), extras


def write_set(folder: Path, writer_class, rows: int, shards: int, seed: int) -> Path:
    paths = []
    for s in range(shards):
        lo, hi = s * rows // shards, (s + 1) * rows // shards
        path = folder / "butd-regions" / shard_name(s, shards)
        with writer_class(path, ATTRS, (K, D), extras=EXTRAS, shard_index=s, num_shards=shards) as writer:
            for ids, features, extras in batches(lo, hi, seed):
                writer.append(ids, features, **extras)
        paths.append(path)
    return write_index(folder / "butd-regions.h5", paths)


def timed(call):
    tracemalloc.start()
    start = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return result, seconds, peak / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--baseline-ref", default="f3b9165", help="git commit of the baselines' code")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    old_features = old_module(args.baseline_ref, "store/features.py", "retr_baseline_features")
    old_verify = old_module(args.baseline_ref, "pipeline/verify.py", "retr_baseline_verify")
    row_mb = (K * D * 2 + sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in EXTRAS.values())) / 2**20
    common = {"rows": args.rows, "row_shape": [K, D], "dtype": "float16", "shards": args.shards,
              "set_mb": round(args.rows * row_mb, 1), "baseline_ref": args.baseline_ref}

    with tempfile.TemporaryDirectory(prefix="retr-bench-verify-") as tmp:
        tmp = Path(tmp)
        _, old_write_s, old_write_peak = timed(lambda: write_set(tmp / "old", old_features.ShardWriter, args.rows,
                                                                 args.shards, args.seed))
        index, write_s, write_peak = timed(lambda: write_set(tmp / "new", ShardWriter, args.rows, args.shards,
                                                             args.seed))
        print(json.dumps({"bench": "verify", "what": "write", **common, "seconds": round(write_s, 2),
                          "mb_per_s": round(args.rows * row_mb / write_s, 1), "peak_mb": round(write_peak, 1),
                          "baseline": "the old ShardWriter (no checksums, NaN refused in float16 only)",
                          "baseline_seconds": round(old_write_s, 2), "x_baseline": round(write_s / old_write_s, 2)}),
              flush=True)

        problems, base_s, base_peak = timed(lambda: old_verify.verify_feature_set(index))
        assert problems == [], problems
        sampled = np.random.default_rng(0).choice(args.rows, size=min(64, args.rows), replace=False)
        baseline = {"baseline": "the old verify: 64 random rows + first and last", "baseline_seconds": round(base_s, 3),
                    "baseline_rows_read": int(np.unique(np.concatenate([[0, args.rows - 1], sampled])).size),
                    "baseline_peak_mb": round(base_peak, 1)}
        full_s = None
        for mode, options in (("all rows, checksums (default)", {}),
                              ("all rows, --no-checksum", {"checksum": False}),
                              ("--sample 64, checksums", {"sample": 64}),
                              ("--sample 64 --no-checksum", {"sample": 64, "checksum": False})):
            report, seconds, peak = timed(lambda: verify_report(index, **options))
            assert report.ok, report.problems
            full_s = seconds if full_s is None else full_s
            print(json.dumps({"bench": "verify", "what": "verify", "mode": mode, **common,
                              "rows_read": report.rows_read, "rows_checksummed": report.rows_checksummed,
                              "seconds": round(seconds, 3),
                              "mb_per_s": round(report.rows_read * row_mb / seconds, 1), "peak_mb": round(peak, 1),
                              **baseline, "x_baseline": round(seconds / base_s, 1)}), flush=True)

        os.environ["RETR_CACHE"] = str(tmp / "cache")          # nothing remembered yet
        for mode in ("first use: every row read", "remembered: the files' states only"):
            read, seconds, peak = timed(lambda: verify_rows(index, quiet=True))
            print(json.dumps({"bench": "verify", "what": "before work", "mode": mode, **common, "rows_read": read,
                              "seconds": round(seconds, 4), "peak_mb": round(peak, 1),
                              "baseline": "retr-pipeline verify, all rows with checksums, in this run",
                              "baseline_seconds": round(full_s, 3), "x_baseline": round(seconds / full_s, 4)}),
                  flush=True)


if __name__ == "__main__":
    main()
