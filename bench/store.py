"""Random-batch read throughput of a 49×2048 float16 feature set through the reader.

Writes a sharded grid feature set (index + shards) to a temporary folder, then reads random batches of rows
(the access pattern of a shuffled training loader) these ways, in one run:

* ``reader-index`` — :class:`retr.store.features.FeatureSet` on the index: positional reads at each row's offset in
  the shards (``retr.store.row_reader``, ``how`` in the line says which path read);
* ``reader-shard`` — the same reader on a single shard file;
* ``h5py-slices-index`` — h5py's slice reads of each contiguous run of the sorted rows through the index's virtual
  datasets (the reader before the positional one, and still the path for compressed sets);
* ``baseline``  — the same rows gathered from an in-memory numpy array (the upper bound: no I/O at all);
* ``h5py-fancy-index`` — h5py's own point-list selection on the index (what a naive reader does; the reader
  reads sorted contiguous runs as slices instead).

The file was just written, so reads come from the page cache: this measures the reader's overhead, not the disk.
With ``--cold``, ``reader-index`` and ``h5py-slices-index`` are measured again from a cold page cache (the shards
evicted with ``posix_fadvise(DONTNEED)`` before each, no root needed), reading batches of half the rows in all,
so that most rows come from the disk; each is the other's baseline.

Prints one JSON line per result: samples/s and MB/s, with the baseline measured in the same run.

    .venv/bin/python bench/store.py [--rows 4000] [--batch 128] [--batches 40] [--shards 4] [--cold] [--dir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

from retr.store.features import FeatureSet, ShardWriter, shard_name, write_index


def build(folder: Path, rows: int, shards: int, seed: int) -> tuple[Path, np.ndarray]:
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((rows, 49, 2048), dtype=np.float32).astype(np.float16)
    attrs = dict(kind="grid", extractor="resnet152-grid", backbone="resnet152", weights="random",
                 image_size=448, manifest_sha256="0" * 64)
    per = -(-rows // shards)
    paths = []
    for s in range(shards):
        lo, hi = s * per, min(rows, (s + 1) * per)
        path = folder / "resnet152-grid" / shard_name(s, shards)
        with ShardWriter(path, attrs, (49, 2048), shard_index=s, num_shards=shards) as writer:
            for start in range(lo, hi, 256):
                stop = min(hi, start + 256)
                writer.append([f"img_{i}" for i in range(start, stop)], data[start:stop])
        paths.append(path)
    return write_index(folder / "resnet152-grid.h5", paths), data


def measure(read, batches: list[np.ndarray], bytes_per_row: int) -> dict:
    read(batches[0])  # warm the handle / page cache once
    start = time.perf_counter()
    for rows in batches:
        out = read(rows)
        assert out.shape[0] == len(rows)
    elapsed = time.perf_counter() - start
    samples = sum(len(b) for b in batches)
    return {"samples_per_s": round(samples / elapsed, 1), "mb_per_s": round(samples * bytes_per_row / elapsed / 2**20, 1),
            "seconds": round(elapsed, 3), "samples": samples}


def evict(paths) -> None:
    """Drop ``paths`` from the page cache (their pages are clean once synced)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure_cold(read, batches: list[np.ndarray], bytes_per_row: int, files) -> dict:
    evict(files)
    start = time.perf_counter()
    for rows in batches:
        read(rows)
    elapsed = time.perf_counter() - start
    samples = sum(len(b) for b in batches)
    return {"samples_per_s": round(samples / elapsed, 1), "seconds": round(elapsed, 3), "samples": samples,
            "mb_per_s": round(samples * bytes_per_row / elapsed / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cold", action="store_true", help="also read from a cold page cache")
    parser.add_argument("--dir", default=None, help="write the set under this folder (default: the temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        index, data = build(Path(tmp), args.rows, args.shards, args.seed)
        rng = np.random.default_rng(args.seed + 1)
        batches = [rng.choice(args.rows, size=args.batch, replace=False) for _ in range(args.batches)]
        bytes_per_row = 49 * 2048 * 2
        baseline = measure(lambda rows: data[rows], batches, bytes_per_row)
        fs = FeatureSet(index)
        via_index = measure(fs.read_rows, batches, bytes_per_row)
        np.testing.assert_array_equal(fs.read_rows(batches[0]), data[batches[0]])
        shard = FeatureSet(Path(tmp) / "resnet152-grid" / shard_name(0, args.shards))
        shard_rows = len(shard)
        shard_batches = [rng.choice(shard_rows, size=min(args.batch, shard_rows), replace=False)
                         for _ in range(args.batches)]
        via_shard = measure(shard.read_rows, shard_batches, bytes_per_row)
        with h5py.File(index, "r") as f:
            dataset = f["features"]

            def slices(rows):
                wanted = np.unique(rows)
                block = np.empty((wanted.size, *dataset.shape[1:]), dtype=dataset.dtype)
                at = 0
                for run in np.split(wanted, np.flatnonzero(np.diff(wanted) != 1) + 1):
                    dataset.read_direct(block, np.s_[int(run[0]):int(run[-1]) + 1], np.s_[at:at + run.size])
                    at += run.size
                return block

            h5py_slices = measure(slices, batches, bytes_per_row)
            fancy = measure(lambda rows: dataset[np.sort(rows)], batches[: max(2, args.batches // 10)],
                            bytes_per_row)
        common = {"bench": "store", "rows": args.rows, "batch": args.batch, "shape": [49, 2048],
                  "dtype": "float16", "shards": args.shards}
        for name, result in (("baseline-numpy", baseline), ("reader-index", via_index),
                             ("reader-shard", via_shard), ("h5py-slices-index", h5py_slices),
                             ("h5py-fancy-index", fancy)):
            line = dict(common, method=name, **result)
            if name.startswith("reader"):
                line["how"] = (fs if name == "reader-index" else shard).how_read()[0]
            if name != "baseline-numpy":
                line["fraction_of_baseline"] = round(result["samples_per_s"] / baseline["samples_per_s"], 4)
            print(json.dumps(line), flush=True)
        if args.cold:
            files = sorted(Path(tmp).rglob("*.h5"))
            half = [rng.choice(args.rows, size=args.batch, replace=False)
                    for _ in range(max(1, args.rows // 2 // args.batch))]
            with h5py.File(index, "r") as f:
                dataset = f["features"]
                cold = {"reader-index-cold": measure_cold(fs.read_rows, half, bytes_per_row, files),
                        "h5py-slices-index-cold": measure_cold(slices, half, bytes_per_row, files)}
            for name, other in (("reader-index-cold", "h5py-slices-index-cold"),
                                ("h5py-slices-index-cold", "reader-index-cold")):
                print(json.dumps(dict(common, method=name, **cold[name], baseline=other,
                                      vs_baseline=round(cold[name]["samples_per_s"]
                                                        / cold[other]["samples_per_s"], 3))), flush=True)


if __name__ == "__main__":
    main()
