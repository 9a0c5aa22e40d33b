"""retr at the datasets' own sizes: import, start-up, the feature loader, training steps and evaluation, each
with its peak memory, on random features in SCAN's precomputed layout.

Three data sets, made in a work folder (``--work``, default a new temporary folder, deleted at the end unless
``--keep``):

* ``f30k``  — Flickr30K's sizes: train 29,000, dev 1,014, test 1,000 images × 36 × 2048 (the npy files take
  9.1 GB as float32 and are deleted once imported; the float16 set takes 4.6 GB);
* ``coco``  — COCO's evaluation sizes: dev 1,000 and testall (5K) 5,000 images × 36 × 2048;
* ``coco-captions`` — COCO's training manifest (train 113,287, dev 5,000, testall 5,000 images × 5 captions) with
  one 2048-d region per image: what start-up costs at COCO size depends on the captions, not the features.

Captions are random sentences of 8 to 20 pseudo-words drawn from a Zipf-distributed vocabulary of 20,000 (COCO's
lengths and word-frequency shape); region features are ReLU'd Gaussians, as a detector's are non-negative.

Stages (``--stages``, each a JSON line with its baseline from the same run where one exists):

* ``import``  — ``retr-pipeline import-scan`` under ``/usr/bin/time -v``: wall time and peak RSS;
* ``startup`` — ``retr-train scan`` with ``--log-every 1``: seconds to the first step's metrics line and the
  peak RSS by then, twice (a second run reuses what the first cached), the progress lines it printed and
  whether any repeated; then the seconds a training step takes (batch 128, d = 1024); the process is stopped
  after ``--steps`` steps;
* ``loader``  — images/s of the training loader (``CaptionBatches`` over shuffled batches of 128 captions, one
  process) reading the features from the file, with the page cache warm and cold (``posix_fadvise``
  DONTNEED), against the same loader reading through h5py (the reader before this version) and against the
  rows held in memory, with the process's resident size after each; the rate a GPU takes (60 steps/s × 128
  images) is the target;
* ``eval``    — a d = 1024 SCAN (trained one epoch on the dev split) evaluated with ``retr-train eval`` on the
  test split (``f30k-1k``; ``coco-5k`` for ``coco``) under ``/usr/bin/time -v``: wall time, peak RSS, the
  pairs rescored.

    .venv/bin/python bench/scale.py --datasets f30k,coco,coco-captions --work /tmp/retr-scale --keep
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from store import evict  # noqa: E402  (bench/store.py: a file dropped from the page cache)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GPU_IMAGES_PER_S = 60 * 128          # a GPU step rate of 60 steps/s at batch 128 (docs/benchmarks.md)

#: name → SCAN split sizes, regions per image, evaluation protocol (None: no evaluation)
DATASETS = {
    "f30k": {"splits": {"train": 29_000, "dev": 1_014, "test": 1_000}, "regions": 36, "protocol": "f30k-1k"},
    "coco": {"splits": {"dev": 1_000, "testall": 5_000}, "regions": 36, "protocol": "coco-5k"},
    "coco-captions": {"splits": {"train": 113_287, "dev": 5_000, "testall": 5_000}, "regions": 1, "protocol": None},
}
STAGES = ("import", "startup", "loader", "eval")


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


# ------------------------------------------------------------------------------------------------ data

def pseudo_words(count: int, rng: np.random.Generator) -> list[str]:
    """``count`` distinct lower-case pseudo-words of 2–4 syllables."""
    onsets, vowels = list("bcdfghjklmnprstvwz") + ["ch", "sh", "th", "st"], list("aeiou") + ["ea", "oo"]
    words: set[str] = set()
    while len(words) < count:
        syllables = rng.integers(2, 5)
        words.add("".join(onsets[rng.integers(len(onsets))] + vowels[rng.integers(len(vowels))]
                          for _ in range(syllables)))
    return sorted(words)


#: what some captions carry, each with its share of captions (COCO-like; these decide how often the tokenizer
#: cannot take its plain path): a comma, a possessive 's, a parenthesis
CAPTION_EXTRAS = ((",", 0.15), ("'s", 0.03), ("(", 0.01))


def write_captions(path: Path, images: int, rng: np.random.Generator, vocabulary: list[str]) -> None:
    """Five captions an image: 8–20 words (mean ≈ 11), Zipf-distributed over ``vocabulary``, a final period; some
    with a comma, a possessive or a parenthesis (:data:`CAPTION_EXTRAS`)."""
    weights = 1.0 / np.arange(1, len(vocabulary) + 1)
    weights /= weights.sum()
    lengths = np.clip(rng.poisson(10.5, size=images * 5), 8, 20)
    words = rng.choice(len(vocabulary), size=int(lengths.sum()), p=weights)
    extras = [(mark, rng.random(len(lengths)) < share) for mark, share in CAPTION_EXTRAS]
    with open(path, "w", encoding="utf-8") as handle:
        start = 0
        for n, length in enumerate(lengths):
            caption = [vocabulary[w] for w in words[start:start + length]]
            for k, (mark, chosen) in enumerate(extras):
                if chosen[n]:
                    at = 1 + (n + 3 * k) % (length - 2)          # each mark on its own word
                    caption[at] = {",": caption[at] + ",", "'s": caption[at] + "'s",
                                   "(": f"({caption[at]})"}[mark]
            handle.write("A " + " ".join(caption) + " .\n")
            start += length


def write_scan_folder(folder: Path, spec: dict, seed: int) -> dict:
    """SCAN's ``{split}_ims.npy`` (float32) and ``{split}_caps.txt`` for every split of ``spec``."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocabulary = pseudo_words(20_000, rng)
    started, total = time.perf_counter(), 0
    for split, images in spec["splits"].items():
        array = np.lib.format.open_memmap(folder / f"{split}_ims.npy", mode="w+", dtype=np.float32,
                                          shape=(images, spec["regions"], 2048))
        for start in range(0, images, 256):
            stop = min(images, start + 256)
            block = rng.standard_normal((stop - start, spec["regions"], 2048), dtype=np.float32)
            array[start:stop] = np.maximum(block, 0.0, out=block)
        array.flush()
        del array
        write_captions(folder / f"{split}_caps.txt", images, rng, vocabulary)
        total += (folder / f"{split}_ims.npy").stat().st_size
    return {"npy_gb": round(total / 1e9, 2), "seconds": round(time.perf_counter() - started, 1)}


# ------------------------------------------------------------------------------------------------ processes

def timed(command: list[str], env: dict | None = None) -> dict:
    """Run ``command`` under ``/usr/bin/time -v``: wall seconds, peak RSS (GB), exit status, stderr's last lines."""
    started = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    seconds = time.perf_counter() - started
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    lines = [line for line in done.stderr.splitlines() if not line.startswith("\t")]
    return {"seconds": round(seconds, 1), "peak_rss_gb": round(int(peak.group(1)) / 2**20, 2) if peak else None,
            "rc": done.returncode, "stdout": done.stdout, "stderr_lines": lines}


def peak_rss_gb(pid: int) -> float:
    """``VmHWM`` of a live process (GB)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 2**20


def step_lines(metrics: Path) -> int:
    if not metrics.is_file():
        return 0
    return sum(1 for line in metrics.read_text().splitlines() if '"type": "step"' in line)


def train_until(command: list[str], metrics: Path, steps: int, timeout: float) -> dict:
    """Start ``command`` (a training run logging every step to ``metrics``) and stop it after ``steps`` steps:
    seconds to the first step, seconds a step then, peak RSS, the lines it printed."""
    env = {**os.environ, "RETR_PROGRESS_SECONDS": "5"}
    err = tempfile.TemporaryFile(mode="w+")
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
    first = last = None
    peak = 0.0
    try:
        while time.perf_counter() - started < timeout and process.poll() is None:
            peak = max(peak, peak_rss_gb(process.pid))
            done = step_lines(metrics)
            now = time.perf_counter() - started
            if done >= 1 and first is None:
                first = now
            if done >= steps:
                last = now
                break
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        process.wait()
    err.seek(0)
    lines = [line.rstrip("\n") for line in err]
    return {"first_step_s": None if first is None else round(first, 1),
            "step_s": None if last is None or first is None else round((last - first) / (steps - 1), 2),
            "peak_rss_gb": round(peak, 2), "lines": lines, "rc": process.returncode}


def repeated_progress(lines: list[str]) -> list[str]:
    """Progress lines printed twice with the same text (a stage that says the same thing again)."""
    seen, repeated = set(), []
    for line in lines:
        if "/" in line and ("it/s" in line or "s/it" in line or "|" in line):
            if line in seen:
                repeated.append(line)
            seen.add(line)
    return repeated


# ------------------------------------------------------------------------------------------------ stages

def stage_import(name: str, source: Path, target: Path) -> dict:
    result = timed([str(BIN / "retr-pipeline"), "import-scan", str(source), "--out", str(target), "--quiet"])
    if result["rc"] != 0:
        raise SystemExit(f"import-scan failed: {result['stderr_lines'][-3:]}")
    size = sum(p.stat().st_size for p in target.rglob("*.h5"))
    return {"bench": "scale", "stage": "import", "dataset": name, "seconds": result["seconds"],
            "peak_rss_gb": result["peak_rss_gb"], "h5_gb": round(size / 1e9, 2)}


def stage_startup(name: str, target: Path, runs: Path, steps: int) -> list[dict]:
    records = []
    for attempt in ("first", "second"):
        out = runs / f"startup-{name}-{attempt}"
        shutil.rmtree(out, ignore_errors=True)
        command = [str(BIN / "retr-train"), "scan", "--features", str(target / "regions.h5"), "--manifest",
                   str(target / "manifest.jsonl"), "--out", str(out), "--epochs", "1", "--log-every", "1",
                   "--batch-size", "128", "--embed-size", "1024", "--device", "cpu"]
        result = train_until(command, out / "metrics.jsonl", steps, timeout=1800)
        records.append({"bench": "scale", "stage": "startup", "dataset": name, "run": attempt,
                        "first_step_s": result["first_step_s"], "step_s": result["step_s"],
                        "peak_rss_gb": result["peak_rss_gb"], "lines_printed": len(result["lines"]),
                        "repeated_progress_lines": repeated_progress(result["lines"]),
                        "printed": result["lines"][:40], "target_first_step_s": 60})
        shutil.rmtree(out, ignore_errors=True)
    return records


def warm_cache(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb") as handle:
            while handle.read(1 << 24):
                pass


def loader_rate(batches, images, seconds: float, limit: int | None = None) -> dict:
    """Images/s of ``images(captions)`` over ``batches`` for about ``seconds`` (or until ``limit`` images), and the
    process's resident size after (GB)."""
    started, done = time.perf_counter(), 0
    for captions in batches:
        images(captions)
        done += len(captions)
        if time.perf_counter() - started > seconds or (limit is not None and done >= limit):
            break
    elapsed = time.perf_counter() - started
    status = Path("/proc/self/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 2**20
    return {"images_per_s": round(done / elapsed), "images": done, "rss_gb": round(rss, 2)}


def stage_loader(name: str, target: Path, seconds: float) -> list[dict]:
    """The training loader's images/s reading the training split's features from the file (warm and cold page
    cache) against the same loader with h5py's reads (what ``FeatureSet`` read with before), and held in memory.
    A cold measurement stops after a quarter of the split's images, so few of its rows come from the page cache
    again (about one in nine)."""
    import torch

    from retr.store.features import FeatureSet
    from retr.store.vocab import Vocabulary
    from retr.trainers.data.splits import CaptionBatches, EpochBatchSampler, ImageFeatures, load_split

    torch.set_num_threads(1)
    files = sorted(target.rglob("*.h5"))
    features = FeatureSet(target / "regions.h5")
    data, _ = load_split(target / "manifest.jsonl", ["train"], Vocabulary(), features, missing="skip")
    batches = list(EpochBatchSampler(data.num_captions, 128, seed=0))
    on_file = ImageFeatures(features, data.image_ids, preload="off")
    reader = getattr(on_file, "reader", "h5py")
    through_h5py = FeatureSet(target / "regions.h5")
    if hasattr(through_h5py, "_direct"):
        through_h5py._direct["features"] = (None, "the baseline: h5py's reads")    # the reader before this version
    loaders = {"measured": CaptionBatches(data, on_file, as_stored=True),
               "baseline": CaptionBatches(data, ImageFeatures(through_h5py, data.image_ids, preload="off"),
                                          as_stored=True)}
    records = []
    for cache in ("warm", "cold"):
        rates = {}
        for what, loader in loaders.items():
            (warm_cache if cache == "warm" else evict)(files)
            rates[what] = loader_rate(itertools.cycle(batches), loader.__getitem__, seconds,
                                      limit=data.num_images // 4 if cache == "cold" else None)
        measured, baseline = rates["measured"], rates["baseline"]
        records.append({"bench": "scale", "stage": "loader", "dataset": name, "page_cache": cache,
                        "reader": reader, **measured, "baseline": "the same loader reading through h5py",
                        "baseline_images_per_s": baseline["images_per_s"],
                        "vs_baseline": round(measured["images_per_s"] / baseline["images_per_s"], 2),
                        "gpu_takes_images_per_s": GPU_IMAGES_PER_S,
                        "vs_gpu": round(measured["images_per_s"] / GPU_IMAGES_PER_S, 2)})
    held = ImageFeatures(features, data.image_ids, preload="host")
    in_memory = loader_rate(itertools.cycle(batches), CaptionBatches(data, held, as_stored=True).__getitem__, seconds)
    records.append({"bench": "scale", "stage": "loader", "dataset": name, "page_cache": "in memory",
                    "reader": "host", **in_memory, "gpu_takes_images_per_s": GPU_IMAGES_PER_S,
                    "vs_gpu": round(in_memory["images_per_s"] / GPU_IMAGES_PER_S, 2)})
    return records


def stage_eval(name: str, target: Path, runs: Path, protocol: str, exact_size: bool = True,
               embed_size: int = 1024) -> dict:
    run = runs / f"eval-{name}-d{embed_size}"
    if not (run / "best.pt").is_file():
        shutil.rmtree(run, ignore_errors=True)
        trained = timed([str(BIN / "retr-train"), "scan", "--features", str(target / "regions.h5"), "--manifest",
                         str(target / "manifest.jsonl"), "--out", str(run), "--train-split", "val", "--val-split",
                         "val", "--val-images", "100", "--epochs", "1", "--batch-size", "128", "--embed-size",
                         str(embed_size), "--device", "cpu", "--quiet"])
        if trained["rc"] != 0:
            raise SystemExit(f"training the evaluated run failed: {trained['stderr_lines'][-3:]}")
    result = timed([str(BIN / "retr-train"), "eval", str(run), "--protocol", protocol, "--device", "cpu", "--json",
                    *([] if exact_size else ["--allow-size-mismatch"])], env={"RETR_PROGRESS_SECONDS": "10"})
    if result["rc"] != 0:
        raise SystemExit(f"eval failed: {result['stderr_lines'][-3:]}")
    evaluated = json.loads(result["stdout"])
    refinement = evaluated.get("refinement", {})
    return {"bench": "scale", "stage": "eval", "dataset": name, "protocol": protocol, "embed_size": embed_size,
            "seconds": result["seconds"], "peak_rss_gb": result["peak_rss_gb"],
            "rescored_pairs": refinement.get("rescored_pairs"), "rsum": evaluated.get("rsum"),
            "repeated_progress_lines": repeated_progress(result["stderr_lines"]),
            "printed": result["stderr_lines"][:40]}


# ------------------------------------------------------------------------------------------------ main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", default="f30k,coco,coco-captions")
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--work", type=Path, default=None, help="work folder (default: a new temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (the imported sets) at the end")
    parser.add_argument("--steps", type=int, default=4, help="training steps of the start-up stage")
    parser.add_argument("--embed-size", type=int, default=1024, help="joint space of the evaluated SCAN")
    parser.add_argument("--loader-seconds", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fraction", type=float, default=1.0,
                        help="scale every split by this (a quick check of the script; not the datasets' sizes)")
    args = parser.parse_args()
    stages = [s for s in args.stages.split(",") if s]
    work = args.work or Path(tempfile.mkdtemp(prefix="retr-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        for name in [d for d in args.datasets.split(",") if d]:
            spec = {**DATASETS[name], "splits": {split: max(200, round(images * args.fraction))
                                                 for split, images in DATASETS[name]["splits"].items()}}
            source, target, runs = work / f"{name}-precomp", work / name, work / "runs"
            runs.mkdir(exist_ok=True)
            if not (target / "regions.h5").is_file():
                made = write_scan_folder(source, spec, args.seed)
                emit({"bench": "scale", "stage": "make", "dataset": name, **made})
                emit(stage_import(name, source, target))
                shutil.rmtree(source)
            elif "import" in stages:
                emit({"bench": "scale", "stage": "import", "dataset": name, "skipped": f"{target} exists"})
            if "startup" in stages and "train" in spec["splits"]:
                for record in stage_startup(name, target, runs, args.steps):
                    emit(record)
            if "loader" in stages and "train" in spec["splits"] and spec["regions"] > 1:
                for record in stage_loader(name, target, args.loader_seconds):
                    emit(record)
            if "eval" in stages and spec["protocol"]:
                emit(stage_eval(name, target, runs, spec["protocol"], exact_size=args.fraction == 1.0,
                                embed_size=args.embed_size))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
