"""Benchmarks of the butd-regions extractor (CPU by default). Prints one JSON line per result.

1. ``selection``: generate_tsv's box selection on P proposals × 1600 classes — the batched greedy NMS of
   :mod:`retr.extractors.butd.selection` against the baseline, one ``torchvision.ops.nms`` call per class (what
   the detectron2 ports do), measured in the same run on the same scores; also checks they agree.
2. ``extraction``: images/s of the whole extractor (random weights) on synthetic 224×224 images with the
   original settings (600/1000, 300 proposals, 14×14 pool: the baseline) and with the demo's speed settings.

Run:  .venv/bin/python bench/regions.py [--images 3] [--repeats 9] [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torchvision.ops import nms

from retr.extractors.base import build_extractor
from retr.extractors.butd.selection import per_class_max_conf

#: the demo's speed options (Makefile); anything not listed keeps the original's default
DEMO_OPTIONS = dict(short_side=224, max_side=224, post_nms_topk=36, pooled_size=7)


def loop_max_conf(boxes: torch.Tensor, scores: torch.Tensor, threshold: float = 0.3) -> torch.Tensor:
    """The baseline: one legacy ("+1") NMS call per class."""
    shifted = boxes + boxes.new_tensor([0.0, 0.0, 1.0, 1.0])
    max_conf = torch.zeros(len(boxes), device=boxes.device)
    for c in range(scores.shape[1]):
        keep = nms(shifted, scores[:, c], threshold)
        max_conf[keep] = torch.maximum(max_conf[keep], scores[keep, c])
    return max_conf


def _best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_selection(device: str, repeats: int, proposals: int = 300, classes: int = 1600) -> dict:
    gen = torch.Generator().manual_seed(0)
    xy = torch.rand(proposals, 2, generator=gen) * 600
    boxes = torch.cat([xy, xy + 16 + torch.rand(proposals, 2, generator=gen) * 300], dim=1).to(device)
    scores = torch.softmax(torch.randn(proposals, classes + 1, generator=gen) * 4, dim=1)[:, 1:].to(device)
    batched = per_class_max_conf(boxes, scores)
    baseline = loop_max_conf(boxes, scores)
    t_batched = _best_of(lambda: per_class_max_conf(boxes, scores), repeats)
    t_loop = _best_of(lambda: loop_max_conf(boxes, scores), repeats)
    return {"bench": "selection", "device": device, "proposals": proposals, "classes": classes,
            "batched_ms": round(t_batched * 1e3, 2), "baseline": "torchvision nms per class",
            "baseline_ms": round(t_loop * 1e3, 2), "speedup": round(t_loop / t_batched, 2),
            "identical": bool(torch.equal(batched, baseline))}


def bench_extraction(device: str, images: int) -> list[dict]:
    from retr.manifests.synthetic import generate_synthetic
    with tempfile.TemporaryDirectory() as tmp:
        generate_synthetic(tmp, num_images=max(images, 3), seed=0)
        paths = sorted(Path(tmp, "images").glob("*.jpg"))[:images]
        results = {}
        for label, options in (("original", {}), ("demo", DEMO_OPTIONS)):
            extractor = build_extractor("butd-regions", weights="random", device=device, **options)
            batch = [extractor.load(str(p)) for p in paths]
            extractor.extract(batch[:1])                         # warm-up (kernel selection)
            start = time.perf_counter()
            extractor.extract(batch)
            seconds = time.perf_counter() - start
            results[label] = {"images_per_s": round(len(batch) / seconds, 3),
                              "s_per_image": round(seconds / len(batch), 3), "options": options or "defaults"}
    base = results["original"]
    return [{"bench": "extraction", "device": device, "threads": torch.get_num_threads(), "images": images,
             "setting": label, **r, "baseline": "original settings (600/1000, 300 proposals, 14x14 pool)",
             "baseline_images_per_s": base["images_per_s"],
             "speedup": round(r["images_per_s"] / base["images_per_s"], 2)} for label, r in results.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3, help="images per extraction measurement")
    parser.add_argument("--repeats", type=int, default=9, help="best-of repeats for the selection timing")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip-extraction", action="store_true")
    args = parser.parse_args()
    print(json.dumps(bench_selection(args.device, args.repeats)), flush=True)
    if not args.skip_extraction:
        for line in bench_extraction(args.device, args.images):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
