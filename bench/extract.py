"""Extraction throughput (images/s) and peak memory of each extractor on CPU, against a plain baseline.

For every extractor, two runs over the same COCO-sized JPEGs (synthetic scenes scaled to 640×480, quality 90),
each in a fresh process (``spawn``) so its peak memory is its own:

* ``baseline`` — one image at a time in the main process: PIL decode → ``convert("RGB")`` → a plain
  ``torchvision.transforms`` pipeline (Resize / ToTensor / Normalize, TenCrop for 10-crop) → forward of the
  same cut network. What a first script does.
* ``pipeline`` — the extraction stage (:func:`retr.pipeline.extract.extract_features`): DataLoader workers
  decoding while the network runs on batches, rows written to HDF5 shards, the index written at the end.

Both use the same network object and random weights (``--weights random``: the arithmetic is that of the real
weights), and both get one warm-up forward before the clock starts; model building is not timed. Prints one
JSON line per extractor: images/s of both, the speed-up, and the peak resident memory (MB) of each process
(``ru_maxrss``; for the pipeline also the largest DataLoader worker).

    .venv/bin/python bench/extract.py [--images 8] [--batch-size 8] [--workers 2] [--threads 2]
        [--extractors resnet152-grid,vgg16-maps,tencrop-vgg19,tencrop-resnet152] [--image-size N]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import tempfile
import time
from pathlib import Path

EXTRACTORS = ("resnet152-grid", "vgg16-maps", "tencrop-vgg19", "tencrop-resnet152")


def make_images(folder: Path, count: int, size: tuple[int, int]) -> Path:
    """``count`` synthetic scenes scaled to ``size`` (COCO-like JPEGs) and their manifest; returns the manifest."""
    from PIL import Image

    from retr.manifests.synthetic import generate_synthetic

    generate_synthetic(folder, num_images=max(count, 3), seed=0)
    manifest = folder / "manifest.jsonl"
    lines = manifest.read_text().splitlines()[:count]
    for line in lines:
        path = folder / json.loads(line)["path"]
        with Image.open(path) as image:
            image.convert("RGB").resize(size, Image.BILINEAR).save(path, quality=90)
    bench_manifest = folder / "bench.jsonl"
    bench_manifest.write_text("\n".join(lines) + "\n")
    return bench_manifest


def plain_transform(extractor):
    """The baseline's torchvision transform, equivalent to the extractor's own preprocessing."""
    import torch
    from torchvision import transforms as T

    attrs = extractor.attrs()
    normalize = T.Normalize(attrs["normalize_mean"], attrs["normalize_std"])
    if attrs["kind"] == "tencrop":
        return T.Compose([T.Resize(attrs["resize_short_side"]), T.ToTensor(), normalize,
                          T.TenCrop(attrs["image_size"]), T.Lambda(lambda crops: torch.stack(crops))])
    size = attrs["image_size"]
    return T.Compose([T.Resize((size, size)), T.ToTensor(), normalize])


def peak_rss_mb(who: int = resource.RUSAGE_SELF) -> float:
    return round(resource.getrusage(who).ru_maxrss / 1024, 1)  # Linux reports KiB


def run_one(mode: str, name: str, options: dict, manifest: str, args: dict, queue) -> None:
    """In a fresh process: build the extractor, warm up, time ``mode`` over the manifest, report."""
    import torch
    from PIL import Image

    from retr.extractors.base import build_extractor
    from retr.manifests.schema import read_manifest
    from retr.pipeline.extract import extract_features

    torch.set_num_threads(args["threads"])
    extractor = build_extractor(name, **options)
    records = read_manifest(manifest)
    root = Path(manifest).parent
    paths = [str(root / r.path) for r in records]
    with torch.inference_mode():
        extractor.extract(extractor.collate([extractor.load(paths[0])]))  # warm-up, untimed
    if mode == "baseline":
        transform = plain_transform(extractor)
        start = time.perf_counter()
        for path in paths:
            with Image.open(path) as image:
                x = transform(image.convert("RGB")).unsqueeze(0)
            extractor.extract(x)
        seconds = time.perf_counter() - start
        extra = {}
    else:
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            summary = extract_features(manifest, name, out, options=options, batch_size=args["batch_size"],
                                       workers=args["workers"], quiet=True, build=lambda n, **o: extractor)
            seconds = time.perf_counter() - start
        assert summary.rows == len(paths), summary.line()
        extra = {"workers_peak_rss_mb": peak_rss_mb(resource.RUSAGE_CHILDREN)}
    queue.put({"seconds": seconds, "images_per_s": len(paths) / seconds, "peak_rss_mb": peak_rss_mb(), **extra})


def measure(mode: str, name: str, options: dict, manifest: Path, args: dict) -> dict:
    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=run_one, args=(mode, name, options, str(manifest), args, queue))
    process.start()
    result = queue.get()
    process.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")),
                        help="torch intra-op threads in both runs")
    parser.add_argument("--extractors", default=",".join(EXTRACTORS))
    parser.add_argument("--image-size", type=int, default=None,
                        help="override every extractor's input size (e.g. 224), default: each one's own")
    parser.add_argument("--source-size", default="640x480", help="size of the JPEGs on disk, WxH")
    args = parser.parse_args()
    width, height = (int(v) for v in args.source_size.lower().split("x"))
    settings = {"threads": args.threads, "batch_size": args.batch_size, "workers": args.workers}
    with tempfile.TemporaryDirectory() as tmp:
        manifest = make_images(Path(tmp), args.images, (width, height))
        for name in args.extractors.split(","):
            options = {"weights": "random", "device": "cpu"}
            if args.image_size is not None:
                options["image_size"] = args.image_size
            baseline = measure("baseline", name, options, manifest, settings)
            pipeline = measure("pipeline", name, options, manifest, settings)
            print(json.dumps({
                "bench": "extract", "extractor": name, "device": "cpu", "images": args.images,
                "source_size": args.source_size, "image_size": args.image_size or "default",
                "images_per_s": round(pipeline["images_per_s"], 3),
                "baseline_images_per_s": round(baseline["images_per_s"], 3),
                "speedup": round(pipeline["images_per_s"] / baseline["images_per_s"], 2),
                "peak_rss_mb": pipeline["peak_rss_mb"], "workers_peak_rss_mb": pipeline["workers_peak_rss_mb"],
                "baseline_peak_rss_mb": baseline["peak_rss_mb"],
                **settings,
                "baseline": "one image at a time: PIL decode, torchvision transforms, forward; no workers",
            }), flush=True)


if __name__ == "__main__":
    main()
