"""GPU-first throughput: each stage on one device against its baseline measured in the same run (issue 15).

One JSON line per stage and device, each holding its own baseline, measured in the same process on the same
data and weights (random weights: the arithmetic of real ones, nothing to download):

* ``backbone`` (per extractor) — the extraction loop (:func:`retr.pipeline.extract.extract_paths`: DataLoader
  workers reading bytes, decoding on the device with ``--decode auto`` on CUDA, autocast, next batch copied on a
  side stream) in images/s, against
  - ``baseline``: a plain one-image torchvision loop (Pillow decode → ``transforms`` → forward in float32 →
    ``.cpu()``), what a first script does;
  - ``bound``: forward-only throughput on preloaded device tensors with the loop's precision
    (:meth:`BackboneExtractor.forward_only`); ``of_bound`` is the loop's fraction of it.
  ``agreement_min_cosine`` compares the loop's features with the baseline's, row by row.
* ``butd`` — ``butd-regions`` detection of preprocessed images (:func:`retr.extractors.butd.model.run_detector`)
  ``--detector-batch`` images per forward, against one image per forward (the original's), with the largest
  box and feature differences and the share of images that keep the same boxes (within 0.01 px).
* not yet: a training step per model against an authors'-style loop, and SCAN evaluation at COCO 5K's
  sizes against the per-caption loop (issue 15 items 2–3; ``bench/eval.py`` and ``bench/models.py`` time
  those on CPU today).

Every timed section ends with a device synchronisation; each is preceded by an untimed warm-up.

    .venv/bin/python bench/gpu.py [--device auto] [--stages backbone,butd] [--tiny] [--out FILE]

``--tiny`` runs every stage at sizes a CPU finishes in well under a minute (what ``tests/test_bench_gpu.py``
runs); the figures it prints mean nothing, only that each path runs and agrees with its baseline.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from extract import make_images, plain_transform  # noqa: E402  (bench/extract.py: the same images, transforms)

STAGES = ("backbone", "butd")


@dataclass(frozen=True)
class Sizes:
    """How much work each stage does (``full``: sizes that give stable figures on a GPU; ``tiny``: CI)."""

    images: int                     # backbone and butd images
    source_size: tuple[int, int]    # the JPEGs' size on disk (W, H)
    image_size: int | None          # backbone input size (None: each extractor's default)
    batch_size: int                 # extraction batch
    extractors: tuple[str, ...]
    butd: dict                      # butd-regions builder options
    detector_batch: int


FULL = Sizes(images=256, source_size=(640, 480), image_size=None, batch_size=32,
             extractors=("resnet152-grid", "vgg16-maps", "tencrop-resnet152"), butd={}, detector_batch=4)
TINY = Sizes(images=4, source_size=(96, 72), image_size=64, batch_size=2, extractors=("tencrop-resnet152",),
             butd={"short_side": 64, "max_side": 96, "post_nms_topk": 36, "pooled_size": 7}, detector_batch=2)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """``(seconds, fn())``, the clock stopped after the device has finished."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def min_row_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The smallest cosine between matching rows of two ``[N, K, D]`` arrays (flattened per row)."""
    a, b = a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1).astype(np.float64)
    cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)
    return float(cos.min()) if len(cos) else 1.0


def bench_backbone(name: str, paths: list[str], device: torch.device, sizes: Sizes, autocast: str,
                   workers: int) -> dict:
    """The extraction loop of ``name`` against a plain one-image loop and against forward-only throughput."""
    from PIL import Image

    from retr.extractors.base import build_extractor
    from retr.pipeline.extract import extract_paths

    common = {"weights": "random", "device": str(device)}
    if sizes.image_size is not None:
        common["image_size"] = sizes.image_size
    fast = build_extractor(name, decode="auto", autocast=autocast, **common)
    plain = build_extractor(name, decode="cpu", **common)
    plain.network.load_state_dict(fast.network.state_dict())          # the same random weights in both

    # baseline: Pillow + torchvision transforms + float32 forward, one image at a time
    transform = plain_transform(plain)

    def baseline() -> np.ndarray:
        rows = []
        for path in paths:
            with Image.open(path) as image:
                x = transform(image.convert("RGB"))
            rows.append(plain.forward_only(x[None].to(device)).cpu().numpy())
        return np.concatenate(rows)

    baseline()                                                          # warm-up
    t_base, base_features = timed(baseline, device)

    extract_paths(fast, paths[:sizes.batch_size], batch_size=sizes.batch_size, workers=workers)   # warm-up
    t_loop, (outputs, failures) = timed(
        lambda: extract_paths(fast, paths, batch_size=sizes.batch_size, workers=workers), device)
    if failures:
        raise RuntimeError(f"{name}: the loop refused {failures}")

    # bound: the loop's network and precision on batches already on the device
    stacked = torch.stack([plain.load(path) for path in paths]).to(device)     # Pillow-decoded tensors
    batches = list(torch.split(stacked, sizes.batch_size))
    fast.forward_only(batches[0])                                       # warm-up
    t_bound, _ = timed(lambda: [fast.forward_only(b) for b in batches], device)

    n = len(paths)
    return {"bench": "gpu", "stage": "backbone", "extractor": name, "device": device_name(device),
            "images": n, "batch_size": sizes.batch_size, "decode": fast.attrs().get("decode"),
            "autocast": autocast, "images_per_s": round(n / t_loop, 2),
            "baseline": {"what": "one image at a time: Pillow, torchvision transforms, float32 forward",
                         "images_per_s": round(n / t_base, 2)},
            "bound": {"what": "forward only, preloaded device tensors, the loop's precision",
                      "images_per_s": round(n / t_bound, 2)},
            "speedup": round(t_base / t_loop, 2), "of_bound": round(t_bound / t_loop, 3),
            "agreement_min_cosine": round(min_row_cosine(outputs["features"], base_features), 6)}


def bench_butd(paths: list[str], device: torch.device, sizes: Sizes) -> dict:
    """Batched ``butd-regions`` detection against one image per forward, on the same loaded images."""
    from retr.extractors.base import build_extractor

    extractor = build_extractor("butd-regions", weights="random", device=str(device), **sizes.butd)
    images = [extractor.load(path) for path in paths]

    def detect(batch_size: int):
        return extractor.regions_batched(images, batch_size=batch_size)

    detect(1), detect(sizes.detector_batch)                             # warm-up (kernel selection)
    t_one, one = timed(lambda: detect(1), device)
    t_batched, batched = timed(lambda: detect(sizes.detector_batch), device)
    same = [a.boxes.shape == b.boxes.shape for a, b in zip(one, batched)]
    box_difference = max((float((a.boxes - b.boxes).abs().max()) for a, b, s in zip(one, batched, same)
                          if s and a.boxes.numel()), default=0.0)
    feature_difference = max((float((a.features - b.features).abs().max()) for a, b, s in zip(one, batched, same)
                              if s and a.features.numel()), default=0.0)
    # the same boxes kept: the batch's convolutions may sum in another order (pixels differ by ~1e-3 at most)
    same_boxes = sum(s and (a.boxes.numel() == 0 or float((a.boxes - b.boxes).abs().max()) < 0.01)
                     for a, b, s in zip(one, batched, same))
    n = len(images)
    return {"bench": "gpu", "stage": "butd", "device": device_name(device), "images": n,
            "detector_batch": sizes.detector_batch, "settings": sizes.butd or "the original's",
            "images_per_s": round(n / t_batched, 2),
            "baseline": {"what": "one image per forward (the original's)", "images_per_s": round(n / t_one, 2)},
            "speedup": round(t_one / t_batched, 2), "same_boxes": f"{same_boxes}/{n}",
            "max_box_difference_px": box_difference, "max_feature_difference": feature_difference}


def run(stages: tuple[str, ...], device: torch.device, sizes: Sizes, autocast: str, workers: int) -> Iterator[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        paths: list[str] = []
        if {"backbone", "butd"} & set(stages):
            manifest = make_images(Path(tmp), sizes.images, sizes.source_size)
            paths = [str(Path(tmp) / json.loads(line)["path"]) for line in manifest.read_text().splitlines()]
        if "backbone" in stages:
            for name in sizes.extractors:
                yield bench_backbone(name, paths, device, sizes, autocast, workers)
        if "butd" in stages:
            yield bench_butd(paths, device, sizes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (cuda when there is one), cpu, cuda, cuda:N")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated, of " + ", ".join(STAGES))
    parser.add_argument("--tiny", action="store_true", help="CI sizes: every path runs, the figures mean nothing")
    parser.add_argument("--autocast", default=None, choices=("none", "bfloat16", "float16"),
                        help="extraction precision (default: bfloat16 on CUDA, none on CPU)")
    parser.add_argument("--workers", type=int, default=None, help="DataLoader workers (default: 4 on CUDA, 0 on CPU)")
    parser.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    args = parser.parse_args(argv)
    from retr.common.devices import resolve_device
    device = torch.device(resolve_device(args.device))
    stages = tuple(s for s in args.stages.split(",") if s)
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        parser.error(f"unknown stage {unknown[0]!r} (of {', '.join(STAGES)})")
    cuda = device.type == "cuda"
    autocast = args.autocast or ("bfloat16" if cuda else "none")
    workers = args.workers if args.workers is not None else (4 if cuda else 0)
    for record in run(stages, device, TINY if args.tiny else FULL, autocast, workers):
        line = json.dumps(record)
        print(line, flush=True)
        if args.out is not None:
            with open(args.out, "a") as handle:
                handle.write(line + "\n")


if __name__ == "__main__":
    main()
