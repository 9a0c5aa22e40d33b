"""Test helper for the report tests: synthetic images with feature sets that carry boxes or grid cells.

* :func:`write_scene_boxes` — a ``regions`` set like ``trainer_synthetic.write_scene_regions`` (one region per
  object, the scene's content one-hot, background regions of noise) that also stores what extracted region
  sets store: ``boxes`` ``[N, K, 4]`` (x1, y1, x2, y2 in original pixels: the object's circumscribed square;
  background regions get a box of their own), ``num_boxes`` and ``image_hw`` (224 × 224, the images' size).
* :func:`write_scene_grid` — a ``grid`` set of ``side × side`` cells over the 224-px image (raster order): a
  cell that the object's circle touches holds the object's vector, the others noise.
* :func:`train_tiny` — a run of a few epochs through ``retr-train MODEL`` (in-process), seconds on 2 cores.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from retr.manifests.synthetic import generate_synthetic
from retr.store.features import ShardWriter, shard_name, write_index
from trainer_synthetic import D, K, scene_vector

SIZE = 224


def _scenes(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "scenes.jsonl").read_text().splitlines() if line.strip()]


def write_scene_boxes(folder: Path, name: str = "scene-boxes", seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    scenes = _scenes(folder)
    n = len(scenes)
    feats = np.zeros((n, K, D), dtype=np.float32)
    boxes = np.zeros((n, K, 4), dtype=np.float32)
    num_boxes = np.zeros(n, dtype=np.int32)
    for i, scene in enumerate(scenes):
        rows, rects = [], []
        for obj in scene["objects"]:
            (x, y), r = obj["centre"], obj["radius"]
            rows.append(scene_vector(obj, rng))
            rects.append([x - r, y - r, x + r, y + r])
        for _ in range(i % 3):
            rows.append(0.3 * rng.standard_normal(D).astype(np.float32))
            x1, y1 = rng.uniform(0, SIZE - 60, 2)
            rects.append([x1, y1, x1 + rng.uniform(30, 60), y1 + rng.uniform(30, 60)])
        feats[i, :len(rows)], boxes[i, :len(rows)] = rows, np.clip(rects, 0, SIZE)
        num_boxes[i] = len(rows)
    attrs = dict(kind="regions", extractor=name, backbone="scene-description", weights="random", image_size=SIZE,
                 manifest_sha256="0" * 64)
    path = folder / name / shard_name(0, 1)
    extras = {"num_boxes": ((), "int32"), "boxes": ((K, 4), "float32"), "image_hw": ((2,), "int32")}
    with ShardWriter(path, attrs, (K, D), extras=extras, shard_index=0, num_shards=1) as writer:
        writer.append([s["id"] for s in scenes], feats, num_boxes=num_boxes, boxes=boxes,
                      image_hw=np.full((n, 2), SIZE, dtype=np.int32))
    return write_index(folder / f"{name}.h5", [path])


def write_scene_grid(folder: Path, name: str = "scene-grid", side: int = 4, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    scenes = _scenes(folder)
    feats = 0.2 * rng.standard_normal((len(scenes), side * side, D)).astype(np.float32)
    cell = SIZE / side
    for i, scene in enumerate(scenes):
        for obj in scene["objects"]:
            (x, y), r = obj["centre"], obj["radius"]
            vector = scene_vector(obj, rng)
            for row in range(int((y - r) // cell), int((y + r) // cell) + 1):
                for col in range(int((x - r) // cell), int((x + r) // cell) + 1):
                    if 0 <= row < side and 0 <= col < side:
                        feats[i, row * side + col] = vector
    attrs = dict(kind="grid", extractor=name, backbone="scene-description", weights="random", image_size=SIZE,
                 manifest_sha256="0" * 64)
    path = folder / name / shard_name(0, 1)
    with ShardWriter(path, attrs, (side * side, D), shard_index=0, num_shards=1) as writer:
        writer.append([s["id"] for s in scenes], feats)
    return write_index(folder / f"{name}.h5", [path])


def make_images(folder: Path, images: int = 100, seed: int = 0) -> Path:
    """A synthetic dataset with real images in ``folder``; returns its manifest."""
    generate_synthetic(folder, images, seed)
    return folder / "manifest.jsonl"


def train_tiny(model: str, features: Path, manifest: Path, out: Path, *extra: str) -> Path:
    from retr.trainers.commands import cli

    args = [model, "--features", str(features), "--manifest", str(manifest), "--out", str(out), "--embed-size", "32",
            "--word-dim", "32", "--batch-size", "32", "--lr", "2e-3", "--log-every", "2", "--quiet", *extra]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out
