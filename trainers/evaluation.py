"""Retrieval metrics, evaluation protocols and blockwise similarity matrices.

Metrics (``reference/scan.md`` "Evaluation", identical to the authors' ``i2t``/``t2i`` for distinct scores):

* i2t: the rank of an image query is the best (smallest) 0-based rank among its true captions when all
  captions are sorted by decreasing similarity; t2i: the 0-based rank of a caption's true image.
* ``R@K = 100 · mean(rank < K)``, ``medr = floor(median(rank)) + 1``, ``meanr = mean(rank) + 1``,
  ``rsum`` = the sum of the six R@K (the true sum; the authors' 5-fold printout has a known defect).
* Ties: the authors rank with ``np.argsort``, whose order among equal scores is unspecified. Here ties count
  *against* the query: a rank is the number of other items scoring **at least** as high as the true one (for
  i2t, as high as the best true caption, other true captions excluded). A model that scores everything equal
  therefore gets chance-level, not perfect, recall.

Protocols: ``f30k-1k`` and ``coco-5k`` score the split as given; ``coco-1k`` cuts it into five equal folds of
images in file order (with their captions) and reports each fold and the mean of every number over folds.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from retr.common.cli import progress
from retr.common.errors import UserError
from retr.trainers.data import ImageFeatures, SplitData, pad_tokens

PROTOCOLS = ("f30k-1k", "coco-1k", "coco-5k")
COCO_FOLDS = 5
METRIC_KEYS = ("r1", "r5", "r10", "medr", "meanr")
PRECISIONS = ("float64", "mixed", "float32")


# ----------------------------------------------------------------------------------------------- metrics

def i2t_ranks(sims: np.ndarray, caption_image: np.ndarray) -> np.ndarray:
    """0-based rank ``[N_img]`` of each image's best true caption in ``sims`` [N_img, M] (ties pessimistic)."""
    sims = np.asarray(sims)
    n_img = sims.shape[0]
    best = np.full(n_img, -np.inf)
    np.maximum.at(best, caption_image, sims[caption_image, np.arange(sims.shape[1])])
    is_true = np.zeros(sims.shape, dtype=bool)
    is_true[caption_image, np.arange(sims.shape[1])] = True
    ranks = np.empty(n_img, dtype=np.int64)
    for start in range(0, n_img, 256):        # bounded memory: 256 rows at a time
        block = sims[start:start + 256]
        at_least = block >= best[start:start + 256, None]
        ranks[start:start + 256] = (at_least & ~is_true[start:start + 256]).sum(axis=1)
    return ranks


def t2i_ranks(sims: np.ndarray, caption_image: np.ndarray) -> np.ndarray:
    """0-based rank ``[M]`` of each caption's true image (ties pessimistic)."""
    sims = np.asarray(sims)
    true = sims[caption_image, np.arange(sims.shape[1])]
    return (sims >= true[None, :]).sum(axis=0) - 1


def rank_metrics(ranks: np.ndarray) -> dict[str, float]:
    """R@1/5/10 (percent), medr and meanr (1-based) of 0-based ``ranks``."""
    ranks = np.asarray(ranks)
    return {"r1": 100.0 * float(np.mean(ranks < 1)), "r5": 100.0 * float(np.mean(ranks < 5)),
            "r10": 100.0 * float(np.mean(ranks < 10)), "medr": float(math.floor(np.median(ranks)) + 1),
            "meanr": float(np.mean(ranks)) + 1.0}


def retrieval_metrics(sims: np.ndarray, caption_image: np.ndarray) -> dict:
    """``{"i2t": {r1, r5, r10, medr, meanr}, "t2i": {…}, "rsum": …}`` of one similarity matrix."""
    caption_image = np.asarray(caption_image, dtype=np.int64)
    if not np.isfinite(sims).all():
        raise UserError("the similarity matrix contains NaN/inf (a diverged model?); cannot rank")
    if sims.ndim != 2 or sims.shape[1] != caption_image.size or caption_image.max() >= sims.shape[0]:
        raise ValueError(f"similarities {sims.shape} do not fit {caption_image.size} captions")
    i2t = rank_metrics(i2t_ranks(sims, caption_image))
    t2i = rank_metrics(t2i_ranks(sims, caption_image))
    return {"i2t": i2t, "t2i": t2i, "rsum": sum(d[k] for d in (i2t, t2i) for k in ("r1", "r5", "r10"))}


def coco_folds(num_images: int, folds: int = COCO_FOLDS) -> list[tuple[int, int]]:
    """Image ranges ``[(start, stop)]`` of the COCO 1K folds (equal, in file order)."""
    if num_images % folds:
        raise UserError(f"coco-1k needs a test split divisible into {folds} equal folds; it has {num_images} images")
    size = num_images // folds
    return [(f * size, (f + 1) * size) for f in range(folds)]


def protocol_metrics(sims: np.ndarray, data: SplitData, protocol: str) -> dict:
    """Every number of ``protocol`` for ``sims`` [N_img, M] over ``data`` (folds included for ``coco-1k``)."""
    if protocol not in PROTOCOLS:
        raise UserError(f"unknown protocol {protocol!r} (expected one of {', '.join(PROTOCOLS)})")
    if protocol != "coco-1k":
        result = retrieval_metrics(sims, data.caption_image)
        result.update(images=data.num_images, captions=data.num_captions)
        return result
    folds = []
    for start, stop in coco_folds(data.num_images):
        cols = np.flatnonzero((data.caption_image >= start) & (data.caption_image < stop))
        fold = retrieval_metrics(sims[start:stop][:, cols], data.caption_image[cols] - start)
        fold.update(images=stop - start, captions=int(cols.size))
        folds.append(fold)
    mean = {side: {k: float(np.mean([f[side][k] for f in folds])) for k in METRIC_KEYS} for side in ("i2t", "t2i")}
    return {**mean, "rsum": float(np.mean([f["rsum"] for f in folds])), "folds": folds,
            "images": data.num_images, "captions": data.num_captions}


# -------------------------------------------------------------------------------------------- similarities

def _slice(embeddings: dict[str, torch.Tensor], index: slice) -> dict[str, torch.Tensor]:
    return {k: v[index] for k, v in embeddings.items()}


@torch.no_grad()
def encode_split(model, data: SplitData, features: ImageFeatures, device: torch.device, batch_size: int = 128,
                 quiet: bool = False):
    """Image embeddings (one dict per block of images, in order) and caption blocks sorted by length.

    Returns ``(image_blocks, caption_blocks)``; each caption block is ``(caption indices, embeddings)``.
    """
    model.eval()
    image_blocks = []
    for start in progress(range(0, data.num_images, batch_size), desc="encode images", quiet=quiet):
        idx = np.arange(start, min(start + batch_size, data.num_images))
        feats, mask = features.get(idx)
        image_blocks.append(model.encode_images(feats.to(device), mask.to(device)))
    order = np.argsort([len(t) for t in data.tokens], kind="stable")
    caption_blocks = []
    for start in progress(range(0, len(order), batch_size), desc="encode captions", quiet=quiet):
        idx = order[start:start + batch_size]
        tokens, lengths = pad_tokens([data.tokens[m] for m in idx])
        caption_blocks.append((idx, model.encode_captions(tokens.to(device), lengths.to(device))))
    return image_blocks, caption_blocks


def _cast(embeddings: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in embeddings.items()}


def _concat(blocks: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Join per-block embeddings along dim 0, zero-padding other dims to the largest block's."""
    out = {}
    for key in blocks[0]:
        parts = [b[key] for b in blocks]
        shape = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
        padded = []
        for p in parts:
            pad = []
            for d in reversed(range(1, p.dim())):
                pad += [0, shape[d - 1] - p.shape[d]]
            padded.append(torch.nn.functional.pad(p, pad) if any(pad) else p)
        out[key] = torch.cat(padded)
    return out


@torch.no_grad()
def similarity_matrix(model, data: SplitData, features: ImageFeatures, device: torch.device | str = "cpu",
                      precision: str = "float64", encode_batch: int = 128, image_block: int = 128,
                      pair_budget: int = 1 << 16, quiet: bool = False) -> np.ndarray:
    """The images × captions similarity matrix ``[N_img, M]`` float64 (manifest order on both axes).

    Captions are scored in blocks of similar length (sorted by length) against blocks of ``image_block``
    images; a block holds at most ``pair_budget`` image–caption pairs (memory is bounded by the block, not the
    split). ``precision``: ``float64`` — everything in float64 (the authors' evaluation arithmetic); ``mixed`` —
    embeddings and the large products in float32, everything after them in float64; ``float32``.
    """
    if precision not in PRECISIONS:
        raise UserError(f"precision must be one of {', '.join(PRECISIONS)}")
    device = torch.device(device)
    image_blocks, caption_blocks = encode_split(model, data, features, device, encode_batch, quiet)
    images = _concat(image_blocks)
    embed_dtype = torch.float64 if precision == "float64" else torch.float32
    images = _cast(images, embed_dtype)
    previous = getattr(model, "score_dtype", None)
    model.score_dtype = torch.float32 if precision == "float32" else torch.float64
    try:
        sims = score_blocks(model.score, images, [(idx, caps) for idx, caps in caption_blocks], data.num_images,
                            data.num_captions, image_block, pair_budget, cast=embed_dtype, quiet=quiet)
    finally:
        model.score_dtype = previous
    return sims


def score_blocks(score, images: dict[str, torch.Tensor], caption_blocks, num_images: int, num_captions: int,
                 image_block: int = 128, pair_budget: int = 1 << 16, cast: torch.dtype | None = None,
                 quiet: bool = True) -> np.ndarray:
    """Fill ``[num_images, num_captions]`` float64 with ``score(image block, caption block)``.

    ``caption_blocks``: ``[(caption indices, embeddings)]`` (length-sorted blocks waste no padding); each is cut
    so that a scored block holds at most ``pair_budget`` image–caption pairs.
    """
    caption_step = max(1, pair_budget // max(1, min(image_block, num_images)))
    sims = np.empty((num_images, num_captions), dtype=np.float64)
    work = []
    for idx, caps in caption_blocks:
        for s in range(0, len(idx), caption_step):
            work.append((idx[s:s + caption_step], _slice(caps, slice(s, s + caption_step))))
    for cap_idx, caps in progress(work, desc="score", unit="block", quiet=quiet):
        if cast is not None:
            caps = _cast(caps, cast)
        for start in range(0, num_images, image_block):
            block = _slice(images, slice(start, start + image_block))
            scores = score(block, caps)
            sims[start:start + scores.shape[0], cap_idx] = scores.double().cpu().numpy()
    return sims
