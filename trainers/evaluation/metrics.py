"""Retrieval metrics and evaluation protocols over ``[N_img, M]`` similarity matrices (definitions:
docs/trainer.md#evaluation).
"""
from __future__ import annotations

import math

import numpy as np

from retr.common.errors import UserError
from retr.manifests.schema import ManifestRecord, read_manifest
from retr.store.features import FeatureSet
from retr.trainers.data.splits import SplitData

PROTOCOLS = ("f30k-1k", "coco-1k", "coco-5k", "coco-1k-first")
#: the number of images each protocol's split must have (the Karpathy test splits)
EXPECTED_IMAGES = {"f30k-1k": 1000, "coco-1k": 5000, "coco-5k": 5000, "coco-1k-first": 5000}
COCO_FOLDS = 5


def protocols_for(num_images: int) -> list[str]:
    """The protocols a test split of ``num_images`` images is evaluated with (none: its size is no protocol's)."""
    return [p for p in PROTOCOLS if EXPECTED_IMAGES[p] == num_images]
METRIC_KEYS = ("r1", "r5", "r10", "medr", "meanr")


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


def i2t_ranks_official(sims: np.ndarray, caption_image: np.ndarray) -> np.ndarray:
    """``[N_img]`` ranks as the authors' ``i2t``: each image's captions in ``np.argsort(row)[::-1]`` order, the
    smallest position of a true caption."""
    sims = np.asarray(sims)
    ranks = np.empty(sims.shape[0], dtype=np.int64)
    for i in range(sims.shape[0]):
        position = np.empty(sims.shape[1], dtype=np.int64)
        position[np.argsort(sims[i])[::-1]] = np.arange(sims.shape[1])
        ranks[i] = position[caption_image == i].min()
    return ranks


def t2i_ranks_official(sims: np.ndarray, caption_image: np.ndarray) -> np.ndarray:
    """``[M]`` ranks as the authors' ``t2i``: the position of the true image in ``np.argsort(column)[::-1]``."""
    sims = np.asarray(sims)
    ranks = np.empty(sims.shape[1], dtype=np.int64)
    for c in range(sims.shape[1]):
        order = np.argsort(np.ascontiguousarray(sims[:, c]))[::-1]
        ranks[c] = int(np.flatnonzero(order == caption_image[c])[0])
    return ranks


TIE_RULES = ("pessimistic", "official")


def rank_metrics(ranks: np.ndarray) -> dict[str, float]:
    """R@1/5/10 (percent), medr and meanr (1-based) of 0-based ``ranks``."""
    ranks = np.asarray(ranks)
    return {"r1": 100.0 * float(np.mean(ranks < 1)), "r5": 100.0 * float(np.mean(ranks < 5)),
            "r10": 100.0 * float(np.mean(ranks < 10)), "medr": float(math.floor(np.median(ranks)) + 1),
            "meanr": float(np.mean(ranks)) + 1.0}


def retrieval_metrics(sims: np.ndarray, caption_image: np.ndarray, ties: str = "pessimistic") -> dict:
    """``{"i2t": {r1, r5, r10, medr, meanr}, "t2i": {…}, "rsum": …}`` of one similarity matrix (``ties``:
    docs/trainer.md#evaluation)."""
    if ties not in TIE_RULES:
        raise ValueError(f"ties must be one of {', '.join(TIE_RULES)}, not {ties!r}")
    caption_image = np.asarray(caption_image, dtype=np.int64)
    if not np.isfinite(sims).all():
        raise UserError("the similarity matrix contains NaN/inf (a diverged model?); cannot rank")
    if sims.ndim != 2 or sims.shape[1] != caption_image.size or caption_image.max() >= sims.shape[0]:
        raise ValueError(f"similarities {sims.shape} do not fit {caption_image.size} captions")
    official = ties == "official"
    i2t = rank_metrics((i2t_ranks_official if official else i2t_ranks)(sims, caption_image))
    t2i = rank_metrics((t2i_ranks_official if official else t2i_ranks)(sims, caption_image))
    return {"i2t": i2t, "t2i": t2i, "rsum": sum(d[k] for d in (i2t, t2i) for k in ("r1", "r5", "r10"))}


def coco_folds(num_images: int, folds: int = COCO_FOLDS) -> list[tuple[int, int]]:
    """Image ranges ``[(start, stop)]`` of the COCO 1K folds (equal, in file order)."""
    if num_images % folds:
        raise UserError(f"coco-1k needs a test split divisible into {folds} equal folds; it has {num_images} images")
    size = num_images // folds
    return [(f * size, (f + 1) * size) for f in range(folds)]


def check_split_size(protocol: str, num_images: int, allow_size_mismatch: bool = False) -> dict | None:
    """None when the split has the protocol's size; otherwise refuse (one line), or with
    ``allow_size_mismatch`` return ``{"expected": …, "images": …}`` for the result to record."""
    if protocol not in PROTOCOLS:
        raise UserError(f"unknown protocol {protocol!r} (expected one of {', '.join(PROTOCOLS)})")
    expected = EXPECTED_IMAGES[protocol]
    if num_images == expected:
        return None
    if not allow_size_mismatch:
        raise UserError(f"{protocol} expects a split of {expected} images, this one has {num_images}; evaluate "
                        "the right split, or pass --allow-size-mismatch (recorded in the result)")
    return {"expected": expected, "images": int(num_images)}


def check_evaluation_split(features: FeatureSet, manifest: str, split: str, protocol: str,
                           allow_size_mismatch: bool = False) -> list[ManifestRecord]:
    """The records of ``split``, refused (one line) when there are none, when an image has no features (a
    protocol sees the whole split), or when their number is not ``protocol``'s and a mismatch is not allowed
    (:func:`check_split_size`)."""
    records = read_manifest(manifest, splits=[split])
    if not records:
        raise UserError(f"{manifest} has no images in split {split}")
    absent = [r.id for r in records if r.id not in features]
    if absent:
        raise UserError(f"{len(absent)} image(s) of split {split} have no features in {features.path} (first: "
                        f"{absent[0]}); extract them or pick the matching manifest")
    check_split_size(protocol, len(records), allow_size_mismatch)
    return records


def protocol_metrics(sims: np.ndarray, data: SplitData, protocol: str, allow_size_mismatch: bool = False,
                     ties: str = "pessimistic") -> dict:
    """Every number of ``protocol`` for ``sims`` [N_img, M] over ``data`` (folds included for ``coco-1k``)."""
    mismatch = check_split_size(protocol, data.num_images, allow_size_mismatch)
    result = _protocol_numbers(sims, data, protocol, ties)
    result["ties"] = ties
    if mismatch:
        result["size_mismatch"] = mismatch
    return result


def _protocol_numbers(sims: np.ndarray, data: SplitData, protocol: str, ties: str) -> dict:
    if protocol == "coco-1k-first":
        start, stop = coco_folds(data.num_images)[0]
        cols = np.flatnonzero((data.caption_image >= start) & (data.caption_image < stop))
        result = retrieval_metrics(sims[start:stop][:, cols], data.caption_image[cols] - start, ties)
        result.update(images=stop - start, captions=int(cols.size))
        return result
    if protocol != "coco-1k":
        result = retrieval_metrics(sims, data.caption_image, ties)
        result.update(images=data.num_images, captions=data.num_captions)
        return result
    folds = []
    for start, stop in coco_folds(data.num_images):
        cols = np.flatnonzero((data.caption_image >= start) & (data.caption_image < stop))
        fold = retrieval_metrics(sims[start:stop][:, cols], data.caption_image[cols] - start, ties)
        fold.update(images=stop - start, captions=int(cols.size))
        folds.append(fold)
    mean = {side: {k: float(np.mean([f[side][k] for f in folds])) for k in METRIC_KEYS} for side in ("i2t", "t2i")}
    return {**mean, "rsum": float(np.mean([f["rsum"] for f in folds])), "folds": folds,
            "images": data.num_images, "captions": data.num_captions}
