"""Test helper: a ``regions`` feature set made directly from the synthetic dataset's scene descriptions.

The learning tests need region features that carry the scene's content, cheaply and without detector weights
(random-weight CNN features are only weakly informative). Each image gets one region per object — one-hot size
(2), colour (6) and shape (5), centre x/y and radius scaled to [0, 1], plus small noise — and, for every other
image, one or two extra "background" regions of pure noise, so ``num_boxes`` varies and padded rows (K = 4)
must be masked. Written through the real store writer, so the trainer reads it like any extracted set.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from retr.manifests.synthetic import COLOURS, SHAPES, SIZES, generate_synthetic
from retr.store.features import ShardWriter, shard_name, write_index

K, D = 4, 16


def scene_vector(obj: dict, rng: np.random.Generator) -> np.ndarray:
    v = np.zeros(D, dtype=np.float32)
    v[SIZES.index(obj["size"])] = 1
    v[2 + list(COLOURS).index(obj["colour"])] = 1
    v[8 + SHAPES.index(obj["shape"])] = 1
    v[13:15] = np.asarray(obj["centre"], dtype=np.float32) / 224.0
    v[15] = obj["radius"] / 40.0
    return v + 0.05 * rng.standard_normal(D).astype(np.float32)


def write_scene_regions(folder: Path, name: str = "scene-regions", seed: int = 0) -> Path:
    """``folder/<name>.h5`` (2 shards) from ``folder/scenes.jsonl``."""
    rng = np.random.default_rng(seed)
    scenes = [json.loads(line) for line in (folder / "scenes.jsonl").read_text().splitlines() if line.strip()]
    ids = [s["id"] for s in scenes]
    feats = np.zeros((len(ids), K, D), dtype=np.float32)
    num_boxes = np.zeros(len(ids), dtype=np.int32)
    for i, scene in enumerate(scenes):
        regions = [scene_vector(o, rng) for o in scene["objects"]]
        regions += [0.3 * rng.standard_normal(D).astype(np.float32) for _ in range(i % 3)]
        feats[i, :len(regions)] = regions
        num_boxes[i] = len(regions)
    attrs = dict(kind="regions", extractor=name, backbone="scene-description", weights="random", image_size=224,
                 manifest_sha256="0" * 64)
    shard_dir = folder / name
    paths, half = [], len(ids) // 2
    for s, (a, b) in enumerate(((0, half), (half, len(ids)))):
        path = shard_dir / shard_name(s, 2)
        with ShardWriter(path, attrs, (K, D), extras={"num_boxes": ((), "int32")}, shard_index=s,
                         num_shards=2) as writer:
            writer.append(ids[a:b], feats[a:b], num_boxes=num_boxes[a:b])
        paths.append(path)
    return write_index(folder / f"{name}.h5", paths)


def make_synthetic(folder: Path, images: int = 300, seed: int = 0) -> tuple[Path, Path]:
    """(manifest, scene-region feature set) of a fresh synthetic dataset in ``folder``."""
    generate_synthetic(folder, images, seed)
    return folder / "manifest.jsonl", write_scene_regions(folder)


def write_trees_and_concepts(manifest: Path, out: Path) -> tuple[Path, Path]:
    """``out/trees.h5`` and ``out/concepts.h5`` made from the gold parses beside ``manifest``
    (``captions.conllu``) through the real commands (``retr-pipeline parse-trees`` and ``build-concepts``)."""
    from click.testing import CliRunner

    from retr.pipeline.commands import cli as pipeline

    conllu = Path(manifest).parent / "captions.conllu"
    for args in (["parse-trees", "--manifest", manifest, "--conllu", conllu, "--out", out / "trees.h5", "--quiet"],
                 ["build-concepts", "--manifest", manifest, "--conllu", conllu, "--out", out / "concepts.h5"]):
        result = CliRunner().invoke(pipeline, [str(a) for a in args])
        assert result.exit_code == 0, result.output
    return out / "trees.h5", out / "concepts.h5"


def write_uninformative_regions(folder: Path, name: str = "same-regions", seed: int = 0,
                                out: Path | None = None) -> Path:
    """``out/<name>.h5`` (``out`` defaults to ``folder``): every image of ``folder/scenes.jsonl`` gets the same
    regions, so no model can rank images, and every image-side score ties (the state a collapsed run ends in)."""
    out = folder if out is None else out
    scenes = [json.loads(line) for line in (folder / "scenes.jsonl").read_text().splitlines() if line.strip()]
    ids = [s["id"] for s in scenes]
    regions = np.random.default_rng(seed).standard_normal((K, D)).astype(np.float32)
    feats = np.broadcast_to(regions, (len(ids), K, D)).copy()
    attrs = dict(kind="regions", extractor=name, backbone="constant", weights="random", image_size=224,
                 manifest_sha256="0" * 64)
    path = out / name / shard_name(0, 1)
    with ShardWriter(path, attrs, (K, D), extras={"num_boxes": ((), "int32")}, shard_index=0, num_shards=1) as writer:
        writer.append(ids, feats, num_boxes=np.full(len(ids), K, dtype=np.int32))
    return write_index(out / f"{name}.h5", [path])
