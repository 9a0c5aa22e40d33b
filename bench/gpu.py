"""GPU-first throughput: each stage on one device against its baseline measured in the same run.

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
  box and feature differences and the share of images that keep the same boxes (within 0.01 px); on CUDA once
  in exact float32 (the default) and once with ``--tf32``.
* ``train`` (per model) — training steps as ``retr-train`` runs them (:func:`retr.trainers.training.loop.train_step` over
  the loop's :class:`CaptionBatches` loader; on CUDA: features held on the GPU, ``--preload gpu``, the fused
  optimiser, ``--amp bf16``; with ``--compile``, also compiled), in steps/s, against an authors'-style loop:
  float32 everywhere, features indexed from a float32 array in host memory and copied per batch, the
  per-parameter optimiser (``foreach=False``), one batch at a time. Both run the same batches from the same
  weights; ``first_loss_relative_difference`` compares their first losses (0 up to rounding without autocast).
  ``per_step``: what one more step dispatches (:func:`dispatch_counts`: operators, and on CUDA the kernels and
  the GPU's busy share); ``tf32``: the precisions in force.
* ``eval`` — SCAN t-i over COCO 5K's sizes (5,000 images × 25,000 captions, 36 regions, d = 1024) as ``retr-train
  eval`` scores it (``refined`` precision; on CUDA with GPU block sizes and the refinement on the device), in
  seconds, against the authors'-style loop (per caption, blocks of 128 images, attended vectors formed; float32,
  as their code runs on a GPU) timed on ``eval_baseline_captions`` captions and extrapolated to the matrix;
  ``identical_ranks_vs_float64`` compares every t2i and i2t rank with a float64 matrix of the same embeddings;
  ``per_caption``: what the ``refined`` matrix dispatches per caption (as ``per_step``).

Every timed section ends with a device synchronisation; each is preceded by an untimed warm-up (``--tiny``
skips the extraction stages' warm-ups: its figures mean nothing, and they were half of its CPU time).

    .venv/bin/python bench/gpu.py [--device auto] [--stages backbone,butd,train,eval] [--tiny] [--compile]
                                  [--out FILE]

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

STAGES = ("backbone", "butd", "train", "eval")
TRAIN_MODELS = ("vsepp", "scan", "sman", "jgcar", "seam", "smfea")


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
    train_images: int               # training stage: images (5 captions each) …
    train_batch: int                # … batch size …
    train_steps: int                # … timed steps per path
    train_shapes: dict              # model → (K, D) of its features
    train_settings: dict            # model → settings (published sizes on FULL)
    eval_images: int                # eval stage: images (5 captions each), regions, embedding size …
    eval_regions: int
    eval_dim: int
    eval_baseline_captions: int     # … captions the authors'-style loop is timed on
    warm_up_extraction: bool = True  # an untimed pass before each timed extraction section


#: the features each model trains on: regions, grid, maps, ten-crop globals (DESIGN.md)
TRAIN_SHAPES = {"vsepp": (36, 2048), "scan": (36, 2048), "smfea": (36, 2048), "sman": (49, 2048),
                "jgcar": (196, 512), "seam": (10, 2048)}
TINY_MODEL = dict(embed_size=16, word_dim=8)
FULL = Sizes(images=256, source_size=(640, 480), image_size=None, batch_size=32,
             extractors=("resnet152-grid", "vgg16-maps", "tencrop-resnet152"), butd={}, detector_batch=4,
             train_images=2560, train_batch=128, train_steps=20, train_shapes=TRAIN_SHAPES,
             train_settings={name: {} for name in TRAIN_MODELS},
             eval_images=5000, eval_regions=36, eval_dim=1024, eval_baseline_captions=100)
TINY = Sizes(images=4, source_size=(96, 72), image_size=32, batch_size=2, extractors=("tencrop-resnet152",),
             butd={"short_side": 64, "max_side": 96, "post_nms_topk": 12, "pooled_size": 7, "min_boxes": 10,
                   "max_boxes": 10}, detector_batch=2,
             train_images=24, train_batch=8, train_steps=2,
             train_shapes={"vsepp": (4, 16), "scan": (4, 16), "smfea": (4, 16), "sman": (4, 16), "jgcar": (4, 16),
                           "seam": (4, 16)},
             train_settings={"vsepp": TINY_MODEL, "scan": TINY_MODEL,
                             "smfea": {**TINY_MODEL, "tree_hidden": 8, "num_regions": 4},
                             "sman": TINY_MODEL, "jgcar": {**TINY_MODEL, "hidden_size": 8, "num_regions": 4},
                             "seam": {**TINY_MODEL, "attention_hidden": 8, "gru_size": 8}},
             eval_images=40, eval_regions=6, eval_dim=16, eval_baseline_captions=20, warm_up_extraction=False)


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


def tf32_state() -> dict:
    """The float32 precisions in force outside retr's own ``exact_float32`` sections (per backend on torch >= 2.9:
    ``ieee`` exact, ``tf32``, or ``none`` for PyTorch's default, which lets cuDNN use TF32)."""
    b = torch.backends
    if hasattr(b.cudnn, "conv"):
        return {"cudnn_conv": b.cudnn.conv.fp32_precision, "cudnn_rnn": b.cudnn.rnn.fp32_precision,
                "matmul": b.cuda.matmul.fp32_precision}
    return {"cudnn_allow_tf32": b.cudnn.allow_tf32, "matmul_allow_tf32": b.cuda.matmul.allow_tf32}


def dispatch_counts(fn: Callable[[], object], device: torch.device, per: int = 1) -> dict:
    """What ``fn()`` dispatches, divided by ``per`` (steps, captions): ATen operators (:class:`OpCounter`; on CUDA
    nearly each one a kernel launch), the launching ones and the host reads; on CUDA also, from a second run under
    torch.profiler, the kernels it ran and ``gpu_busy``, their summed time over the wall time (kernels on several
    streams may overlap, so this can exceed 1 there)."""
    from retr.common.op_count import OpCounter

    with OpCounter() as ops:
        fn()
    synchronize(device)
    out = {"ops": round(ops.total / per, 2), "launching": round(ops.launching / per, 2),
           "host_syncs": round(ops.host_syncs / per, 2)}
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            synchronize(device)
        wall = time.perf_counter() - start
        kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
                   for e in kernels) / 1e6
        out.update(kernels=round(sum(e.count for e in kernels) / per, 2), gpu_busy=round(busy / wall, 3))
    return out


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

    if sizes.warm_up_extraction:
        baseline()
    t_base, base_features = timed(baseline, device)

    if sizes.warm_up_extraction:
        extract_paths(fast, paths[:sizes.batch_size], batch_size=sizes.batch_size, workers=workers)
    t_loop, (outputs, failures) = timed(
        lambda: extract_paths(fast, paths, batch_size=sizes.batch_size, workers=workers), device)
    if failures:
        raise RuntimeError(f"{name}: the loop refused {failures}")

    # bound: the loop's network and precision on batches already on the device
    stacked = torch.stack([plain.load(path) for path in paths]).to(device)     # Pillow-decoded tensors
    batches = list(torch.split(stacked, sizes.batch_size))
    if sizes.warm_up_extraction:
        fast.forward_only(batches[0])
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


def bench_butd(paths: list[str], device: torch.device, sizes: Sizes, tf32: bool = False) -> dict:
    """Batched ``butd-regions`` detection against one image per forward, on the same loaded images (``tf32``: the
    ``--tf32`` option, TF32 convolutions on CUDA)."""
    from retr.extractors.base import build_extractor

    extractor = build_extractor("butd-regions", weights="random", device=str(device), tf32=tf32, **sizes.butd)
    images = [extractor.load(path) for path in paths]

    def detect(batch_size: int):
        return extractor.regions_batched(images, batch_size=batch_size)

    if sizes.warm_up_extraction:                                        # kernel selection
        detect(1), detect(sizes.detector_batch)
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
            "detector_batch": sizes.detector_batch, "settings": sizes.butd or "the original's", "tf32": tf32,
            "images_per_s": round(n / t_batched, 2),
            "baseline": {"what": "one image per forward (the original's)", "images_per_s": round(n / t_one, 2)},
            "speedup": round(t_one / t_batched, 2), "same_boxes": f"{same_boxes}/{n}",
            "max_box_difference_px": box_difference, "max_feature_difference": feature_difference}


# ------------------------------------------------------------------------------------------------ training

VOCAB = 1000


def smfea_side_inputs(vocab_size: int, captions: int, seed: int = 0) -> tuple[dict, dict]:
    """Random SMFEA side data of the shapes ``load_smfea_inputs`` gives (30 concepts, 50 entities, 20 relations;
    tokens 4–33 name the concepts): the model's size settings and the tensors for ``prepare_training``."""
    concepts, entities, relations = 30, 50, 20
    g = torch.Generator().manual_seed(seed)
    token_concepts = torch.full((vocab_size,), -1, dtype=torch.long)
    token_concepts[4:4 + concepts] = torch.arange(concepts)
    nodes = torch.stack([torch.randint(0, entities if slot % 2 == 0 else relations, (captions,), generator=g)
                         for slot in range(7)], dim=1)
    tensors = {"adjacency": torch.rand(concepts, concepts, generator=g), "token_concepts": token_concepts,
               "image_labels": torch.rand(captions, concepts, generator=g) < 0.1, "nodes": nodes}
    return {"num_concepts": concepts, "num_entities": entities, "num_relations": relations}, tensors


def _training_set(folder: Path, name: str, sizes: Sizes, seed: int = 0):
    """A float16 feature set of ``name``'s shape written through the store (as extraction writes one), a
    manifest of 5 random captions per image, and the model built at ``sizes``' settings with its side tensors."""
    from retr.store.features import FeatureSet, ShardWriter, shard_name, write_index
    from retr.store.vocab import Vocabulary
    from retr.trainers.data.splits import load_split
    from retr.trainers.models import create_model

    rng = np.random.default_rng(seed)
    k, d = sizes.train_shapes[name]
    n = sizes.train_images
    ids = [f"img{i:06d}" for i in range(n)]
    words = [f"w{i}" for i in range(VOCAB)]
    manifest = folder / f"{name}-manifest.jsonl"
    with open(manifest, "w") as handle:
        for i in ids:
            captions = [" ".join(rng.choice(words, size=int(rng.integers(8, 17)))) for _ in range(5)]
            handle.write(json.dumps({"id": i, "path": f"{i}.jpg", "split": "train", "captions": captions}) + "\n")
    attrs = dict(kind="regions", extractor=f"bench-{name}", backbone="random", weights="random", image_size=0,
                 manifest_sha256="0" * 64)
    shard = folder / f"{name}-features" / shard_name(0, 1)
    with ShardWriter(shard, attrs, (k, d), shard_index=0, num_shards=1) as writer:
        for start in range(0, n, 256):
            block = rng.random((min(256, n - start), k, d), dtype=np.float32)
            writer.append(ids[start:start + block.shape[0]], block)
    features = FeatureSet(write_index(folder / f"{name}-features.h5", [shard]))
    vocab = Vocabulary(words)
    data, _ = load_split(manifest, ["train"], vocab, features)
    extra_sizes, tensors = smfea_side_inputs(len(vocab), data.num_captions, seed) if name == "smfea" else ({}, {})
    torch.manual_seed(seed)
    model = create_model(name, vocab_size=len(vocab), img_dim=d, **extra_sizes, **sizes.train_settings[name])
    if tensors:
        model.prepare_training(tensors)
    return features, data, model


def bench_train(name: str, folder: Path, device: torch.device, sizes: Sizes, compile_too: bool) -> list[dict]:
    """Training steps of ``name`` as the loop runs them against an authors'-style loop (module docstring)."""
    import copy

    from retr.trainers.data.splits import CaptionBatches, EpochBatchSampler, ImageFeatures, pad_tokens
    from retr.trainers.training.loop import train_step
    from retr.trainers.models.optim import apply_implementation

    features, data, model = _training_set(folder, name, sizes)
    model.max_violation = False                        # the sum of violations: no collapse to time
    initial = copy.deepcopy(model.state_dict())
    batches = EpochBatchSampler(data.num_captions, sizes.train_batch, seed=0).global_batches()
    steps = min(sizes.train_steps, len(batches) - 1)
    cuda = device.type == "cuda"

    # baseline: float32 array in host memory, copied per batch; per-parameter Adam; float32; one batch at a time
    host = ImageFeatures(features, data.image_ids, "host")
    host32, num_boxes = host._memory.astype(np.float32), host.num_boxes
    model.load_state_dict(initial)
    model.to(device).train()
    optimizer = model.configure_optimizer(2e-4)
    apply_implementation(optimizer, "loop", device)

    def baseline_step(captions) -> float:
        images = data.caption_image[captions]
        feats = torch.from_numpy(host32[images]).to(device)
        k = feats.shape[1]
        mask = (torch.arange(k).view(1, -1) < torch.from_numpy(num_boxes[images]).view(-1, 1)).to(device)
        tokens, lengths = pad_tokens([data.tokens[m] for m in captions])
        extras = {"image_index": torch.from_numpy(images), "caption_index": torch.from_numpy(np.asarray(captions))}
        optimizer.zero_grad(set_to_none=True)
        loss = model(feats, mask, tokens.to(device), lengths.to(device),
                     **{key: extras[key].to(device) for key in model.batch_extras})
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
        optimizer.step()
        return float(loss.detach())

    torch.manual_seed(1)                                               # the same dropout masks in both paths
    first_baseline = baseline_step(batches[0])                         # warm-up, and the first loss
    t_base, _ = timed(lambda: [baseline_step(b) for b in batches[1:1 + steps]], device)

    records = []
    variants = [("eager", "off")] + ([("compiled", "default")] if compile_too else [])
    for label, compile_mode in variants:
        model.load_state_dict(initial)
        if compile_mode != "off":
            torch._dynamo.reset()
            model.compile_scoring(mode=compile_mode)
        held = ImageFeatures(features, data.image_ids, "gpu" if cuda else "host", device=device)
        loader = torch.utils.data.DataLoader(CaptionBatches(data, held, as_stored=True), batch_size=None,
                                             sampler=batches[:1 + steps], pin_memory=cuda and held.where != "gpu")
        optimizer = model.configure_optimizer(2e-4)
        impls = apply_implementation(optimizer, "auto", device)
        amp = "bf16" if cuda else "off"
        loaded = iter(loader)
        torch.manual_seed(1)
        first = train_step(model, next(loaded), optimizer, None, 2.0, device, amp=amp)   # warm-up (and compile)
        t_loop, _ = timed(lambda: [train_step(model, b, optimizer, None, 2.0, device, amp=amp) for b in loaded],
                          device)
        again = next(iter(torch.utils.data.DataLoader(CaptionBatches(data, held, as_stored=True), batch_size=None,
                                                      sampler=batches[1:2])))
        counts = dispatch_counts(lambda: train_step(model, again, optimizer, None, 2.0, device, amp=amp), device)
        model.__dict__.pop("_compiled", None)
        records.append({
            "bench": "gpu", "stage": "train", "model": name, "variant": label, "device": device_name(device),
            "batch_size": sizes.train_batch, "steps": steps, "features": list(sizes.train_shapes[name]),
            "preload": held.where, "optimizer": "+".join(impls), "amp": amp, "compile": compile_mode,
            "steps_per_s": round(steps / t_loop, 3), "per_step": counts, "tf32": tf32_state(),
            "baseline": {"what": "authors'-style: float32, features from host memory per batch, per-parameter "
                                 "optimiser, one batch at a time", "steps_per_s": round(steps / t_base, 3)},
            "speedup": round(t_base / t_loop, 2),
            "first_loss": first, "baseline_first_loss": first_baseline,
            "first_loss_relative_difference": abs(first - first_baseline) / max(abs(first_baseline), 1e-12)})
    return records


# ------------------------------------------------------------------------------------------------ evaluation

def bench_eval(device: torch.device, sizes: Sizes) -> dict:
    """SCAN t-i over COCO 5K's sizes as ``retr-train eval`` scores it, against the authors'-style loop."""
    from eval import baseline, embeddings  # noqa: E402  (bench/eval.py: the authors' loop, the encoder outputs)

    from retr.trainers.evaluation.metrics import i2t_ranks, t2i_ranks
    from retr.trainers.models import create_model
    from retr.trainers.evaluation.similarity import Scorer, SplitEmbeddings, combined_matrix

    g = torch.Generator().manual_seed(0)
    norm = torch.nn.functional.normalize
    n_img, n_cap = sizes.eval_images, 5 * sizes.eval_images
    images = norm(torch.randn(n_img, sizes.eval_regions, sizes.eval_dim, generator=g), dim=-1)
    lengths = torch.randint(8, 17, (n_cap,), generator=g)
    words = [norm(torch.randn(int(n), sizes.eval_dim, generator=g), dim=-1) for n in lengths]
    owner = np.arange(n_cap) // 5
    model = create_model("scan", vocab_size=8, img_dim=8, embed_size=sizes.eval_dim, word_dim=8,
                         direction="t2i", lambda_softmax=9.0, lambda_lse=6.0).to(device).eval()
    local = embeddings(images, words)
    on_device = SplitEmbeddings({k: v.to(device) for k, v in local.images.items()},
                                [(idx, {k: v.to(device) for k, v in e.items()}) for idx, e in local.caption_blocks])
    scorer = Scorer(model, on_device)
    stats: dict = {}
    t_retr, sims = timed(lambda: combined_matrix([scorer], "refined", owner, stats=stats), device)
    t_wide, wide = timed(lambda: combined_matrix([scorer], "float64", owner), device)
    counts = dispatch_counts(lambda: combined_matrix([scorer], "refined", owner), device, per=n_cap)

    # the authors' loop, float32 on the device, on the first captions (all images), extrapolated
    nb = min(sizes.eval_baseline_captions, n_cap)
    sample = [w.to(device) for w in words[:nb]]
    images_device = images.to(device)
    baseline(images_device, sample[:1], "t2i", 9.0, 6.0)                 # warm-up
    t_base, base = timed(lambda: baseline(images_device, sample, "t2i", 9.0, 6.0), device)
    base_estimate = t_base * n_cap / nb
    same = lambda a, b: float(np.mean(a == b))                          # noqa: E731
    return {"bench": "gpu", "stage": "eval", "model": "scan t-i LSE (λ 9, 6)", "device": device_name(device),
            "images": n_img, "captions": n_cap, "regions": sizes.eval_regions, "dim": sizes.eval_dim,
            "precision": "refined", "seconds": round(t_retr, 2), "per_caption": counts, "tf32": tf32_state(),
            "rescored_fraction": round(stats["rescored_fraction"], 6), "refine_rounds": stats["rounds"],
            "baseline": {"what": "authors'-style: per caption, 128-image blocks, attended vectors formed, float32",
                         "captions_timed": nb, "seconds_timed": round(t_base, 2),
                         "seconds_estimated": round(base_estimate, 1)},
            "speedup": round(base_estimate / t_retr, 1),
            "identical_ranks_vs_float64": {"t2i": same(t2i_ranks(sims, owner), t2i_ranks(wide, owner)),
                                           "i2t": same(i2t_ranks(sims, owner), i2t_ranks(wide, owner))},
            "float64_seconds": round(t_wide, 2),
            "identical_t2i_ranks_vs_baseline": same(t2i_ranks(sims[:, :nb], owner[:nb]),
                                                    t2i_ranks(base, owner[:nb]))}


def run(stages: tuple[str, ...], device: torch.device, sizes: Sizes, autocast: str, workers: int,
        compile_too: bool = False, models: tuple[str, ...] = TRAIN_MODELS) -> Iterator[dict]:
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
            if device.type == "cuda":                                   # TF32 exists on CUDA only
                yield bench_butd(paths, device, sizes, tf32=True)
        if "train" in stages:
            for name in models:
                yield from bench_train(name, Path(tmp), device, sizes, compile_too)
        if "eval" in stages:
            yield bench_eval(device, sizes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (cuda when there is one), cpu, cuda, cuda:N")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated, of " + ", ".join(STAGES))
    parser.add_argument("--tiny", action="store_true", help="CI sizes: every path runs, the figures mean nothing")
    parser.add_argument("--autocast", default=None, choices=("none", "bfloat16", "float16"),
                        help="extraction precision (default: bfloat16 on CUDA, none on CPU)")
    parser.add_argument("--workers", type=int, default=None, help="DataLoader workers (default: 4 on CUDA, 0 on CPU)")
    parser.add_argument("--compile", action="store_true", help="train stage: also time --compile")
    parser.add_argument("--models", default=",".join(TRAIN_MODELS), help="train stage: comma-separated models")
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
    models = tuple(m for m in args.models.split(",") if m)
    if set(models) - set(TRAIN_MODELS):
        parser.error(f"unknown model {sorted(set(models) - set(TRAIN_MODELS))[0]!r} (of {', '.join(TRAIN_MODELS)})")
    for record in run(stages, device, TINY if args.tiny else FULL, autocast, workers, args.compile, models):
        line = json.dumps(record)
        print(line, flush=True)
        if args.out is not None:
            with open(args.out, "a") as handle:
                handle.write(line + "\n")


if __name__ == "__main__":
    main()
