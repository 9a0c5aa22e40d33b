"""Peak memory (RSS) of one training epoch with the features read per batch, against the same epoch with them held.

Where host memory is short, ``--preload auto`` reads each batch's rows from the file
(``retr.trainers.data.splits.place_features``). This benchmark shows what that buys: it writes a synthetic
``regions`` feature set (36×2048 float16, random finite values, ``num_boxes`` 10..36) through the real store
writer (``ShardWriter`` shards + ``write_index``, in chunks, so the benchmark itself stays small), with a manifest
whose training split alone is over 2 GiB, then runs one epoch of ``retr-train vsepp`` on it in fresh processes,
one at a time:

* ``read-per-batch`` — the command with ``--preload off`` (what ``auto`` does when memory is short);
* ``baseline``       — the same command with ``--preload`` (every training row held in memory);
* ``import_floor``   — a process that only imports the trainer (torch, retr) and exits: the fixed cost both
  runs pay, so ``ratio_above_floor`` compares what the two runs hold beyond it.

Peak RSS is each child's own ``ru_maxrss`` (``os.wait4``), in MB of 2**20 bytes. Each run's first line
(``… (read per batch)`` or ``… (preloaded)``) is recorded as ``trainer_says``, so the line shows which path
actually ran. Training images get one caption each by default (``--captions``), which keeps the epoch short on
a CPU; the validation images (``--val-images``) get five. The shards were just written, so reads come from the
page cache (page cache is not part of RSS). Prints one JSON line about the data set, then one with the
read-per-batch run and its ``--preload`` baseline from the same run.

    .venv/bin/python bench/train_memory.py [--rows 15000] [--val-images 100] [--captions 1] [--shards 4]
        [--batch-size 128] [--workdir DIR] [--keep]

Measured (2 CPU cores shared with other jobs, 24 GB RAM, torch CPU) with the defaults,
``.venv/bin/python bench/train_memory.py``: 15,000 rows in 4 shards, 2.214 GB on disk; training split 14,900
images = 2.046 GiB of float16; written in 58 s.

    mode                     trainer says     peak RSS    above import floor   wall
    read-per-batch (off)     read per batch    1163 MB        305 MB            142 s
    baseline (--preload)     preloaded         3209 MB       2351 MB            136 s
    import floor             —                  858 MB          —                 4 s
    ratio 0.362 (0.130 above the floor)

The preloaded run holds 1.12× the training features above the floor (2351 MB for 2095 MB): ``ImageFeatures``
fills one array in 64 MiB slices. (Before, it read a subset of a set's rows as a sorted block and returned
``block[inverse]``, a second full copy alive with the first: 4121 MB above a 703 MB floor in the same benchmark.)
The read-per-batch run holds ~300 MB beyond the imports: the model and its optimiser state, a batch (128 rows:
19 MB float16, 38 MB float32, a few copies of each), not the feature set — the rows are read with positional
reads into the batch (``retr.store.row_reader``), so the file's pages stay in the page cache, outside RSS.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from retr.store.features import ShardWriter, shard_name, write_index

K, D = 36, 2048
COLOURS = ("red", "green", "blue", "yellow", "purple", "orange")
SHAPES = ("circle", "square", "triangle", "star", "hexagon")
RELATIONS = ("left of", "right of", "above", "below")


def caption(rng: np.random.Generator) -> str:
    c1, c2 = rng.choice(COLOURS, 2)
    s1, s2 = rng.choice(SHAPES, 2)
    return f"a {c1} {s1} {rng.choice(RELATIONS)} a {c2} {s2}"


def write_manifest(path: Path, ids: list[str], val_images: int, captions: int, seed: int) -> None:
    """The first ``val_images`` ids in ``val`` (five captions), the rest in ``train`` (``captions`` each)."""
    rng = np.random.default_rng(seed)
    with path.open("w", encoding="utf-8") as f:
        for i, image_id in enumerate(ids):
            split, n = ("val", 5) if i < val_images else ("train", captions)
            record = {"id": image_id, "path": f"images/{image_id}.jpg", "split": split,
                      "captions": [caption(rng) for _ in range(n)]}
            f.write(json.dumps(record) + "\n")


def write_features(folder: Path, ids: list[str], shards: int, chunk: int, seed: int) -> Path:
    """``folder/synthetic-regions.h5`` (index over ``shards`` shards), written ``chunk`` rows at a time."""
    rng = np.random.default_rng(seed)
    attrs = dict(kind="regions", extractor="synthetic-regions", backbone="random", weights="random",
                 image_size=600, manifest_sha256="0" * 64)
    per = -(-len(ids) // shards)
    paths = []
    for s in range(shards):
        lo, hi = s * per, min(len(ids), (s + 1) * per)
        path = folder / "synthetic-regions" / shard_name(s, shards)
        with ShardWriter(path, attrs, (K, D), extras={"num_boxes": ((), "int32")}, shard_index=s,
                         num_shards=shards) as writer:
            for start in range(lo, hi, chunk):
                stop = min(hi, start + chunk)
                block = rng.standard_normal((stop - start, K, D), dtype=np.float32).astype(np.float16)
                writer.append(ids[start:stop], block, num_boxes=rng.integers(10, K + 1, stop - start))
                del block
        paths.append(path)
    return write_index(folder / "synthetic-regions.h5", paths)


def run_child(command: list[str], log_path: Path) -> dict:
    """Run ``command`` to the end (output to ``log_path``); its exit code, wall seconds and own peak RSS."""
    start = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    output = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n{output[-3000:]}")
    # ru_maxrss is in KiB on Linux
    return {"peak_rss_mb": round(usage.ru_maxrss * 1024 / 2**20, 1), "wall_s": round(wall, 1), "output": output}


def train(retr_train: str, folder: Path, features: Path, manifest: Path, name: str, extra: list[str],
          args: argparse.Namespace) -> dict:
    out = folder / "runs" / name
    command = [retr_train, "vsepp", "--features", str(features), "--manifest", str(manifest), "--out", str(out),
               "--preset", "f30k", "--epochs", "1", "--batch-size", str(args.batch_size), "--embed-size", "256",
               "--word-dim", "64", "--val-images", str(args.val_images), "--train-split", "train", "--device", "cpu",
               "--quiet", *extra]
    result = run_child(command, folder / f"{name}.log")
    first = next((line for line in result.pop("output").splitlines()
                  if line.startswith("training ") and " images / " in line), "")     # the start line
    says = "read per batch" if "(read per batch)" in first else "preloaded" if "(preloaded)" in first else "?"
    return {"trainer_says": says, **result, "command": " ".join(["retr-train", *command[1:]])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=15000, help="images (feature rows) in all")
    parser.add_argument("--val-images", type=int, default=100,
                        help="of them in the val split (the rest: train)")
    parser.add_argument("--captions", type=int, default=1, help="captions per training image")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=256, help="rows per writer append")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="write the data and runs here (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the data and runs")
    args = parser.parse_args()

    retr_train = Path(sys.executable).with_name("retr-train")
    retr_train = str(retr_train) if retr_train.is_file() else shutil.which("retr-train")
    if not retr_train:
        raise SystemExit("retr-train not found (install retr into this environment)")
    train_bytes = (args.rows - args.val_images) * K * D * 2

    folder = Path(args.workdir or tempfile.mkdtemp(prefix="retr-train-memory-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        ids = [f"img_{i:06d}" for i in range(args.rows)]
        start = time.perf_counter()
        manifest = folder / "manifest.jsonl"
        write_manifest(manifest, ids, args.val_images, args.captions, args.seed)
        features = write_features(folder, ids, args.shards, args.chunk, args.seed)
        written = time.perf_counter() - start
        on_disk = sum(p.stat().st_size for p in folder.rglob("*.h5"))
        print(json.dumps({"bench": "train_memory", "data": "synthetic-regions", "rows": args.rows,
                          "feature_shape": [K, D], "dtype": "float16", "shards": args.shards,
                          "feature_set_gb_on_disk": round(on_disk / 1e9, 3),
                          "train_images": args.rows - args.val_images,
                          "train_captions": (args.rows - args.val_images) * args.captions,
                          "val_images": args.val_images,
                          "train_features_gib": round(train_bytes / 2**30, 3),
                          "write_s": round(written, 1)}), flush=True)

        floor = run_child([sys.executable, "-c", "import torch, retr.trainers.commands, retr.trainers.training.loop"],
                          folder / "import_floor.log")
        floor.pop("output")
        per_batch = train(retr_train, folder, features, manifest, "read-per-batch", ["--preload", "off"], args)
        preload = train(retr_train, folder, features, manifest, "preload", ["--preload"], args)
        floor_mb = floor["peak_rss_mb"]
        print(json.dumps({"bench": "train_memory", "mode": "read-per-batch", **per_batch,
                          "baseline": {"mode": "preload", **preload},
                          "import_floor": floor,
                          "ratio": round(per_batch["peak_rss_mb"] / preload["peak_rss_mb"], 3),
                          "ratio_above_floor": round((per_batch["peak_rss_mb"] - floor_mb)
                                                     / max(1e-9, preload["peak_rss_mb"] - floor_mb), 3),
                          "train_features_mb": round(train_bytes / 2**20, 1)}), flush=True)
    finally:
        if args.keep:
            print(f"kept {folder}", file=sys.stderr)
        elif args.workdir:
            for name in ("manifest.jsonl", "synthetic-regions.h5", "synthetic-regions", "runs",
                         "import_floor.log", "read-per-batch.log", "preload.log"):
                path = folder / name
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
        else:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
