"""Two-step retrieval (JGCAR §2.4): shortlist by ``global_score`` ``[n_img, n_cap]``, re-rank the shortlist with
``pair_score`` ``[P]``. Shortlists, ranks and folds: docs/models-jgcar.md ("Two-step retrieval")."""
from __future__ import annotations

import time

import numpy as np
import torch

from retr.common.errors import UserError
from retr.trainers.data.splits import ImageFeatures, SplitData
from retr.trainers.evaluation.metrics import (COCO_FOLDS, METRIC_KEYS, check_split_size, coco_folds, i2t_ranks,
                                     rank_metrics, retrieval_metrics, t2i_ranks)
from retr.trainers.evaluation.similarity import _concat, encode_split

DEFAULT_SHORTLIST = 100


@torch.no_grad()
def encode_all(model, data: SplitData, features: ImageFeatures, device: torch.device, batch_size: int = 128,
               dtype: torch.dtype | None = None, quiet: bool = True) -> tuple[dict, dict]:
    """Image and caption embeddings of a split, both in manifest order, cast to ``dtype`` (None: as encoded; the
    scoring calls cast what they score, chunk by chunk, so no float64 copy of every embedding is needed)."""
    images, caption_blocks = encode_split(model, data, features, device, batch_size, quiet)
    captions = _concat([emb for _, emb in caption_blocks])
    order = torch.from_numpy(np.concatenate([idx for idx, _ in caption_blocks])).to(device)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=device)
    captions = {k: v[inverse] for k, v in captions.items()}

    def cast(e: dict) -> dict:
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in e.items()}
    return (cast(images), cast(captions)) if dtype is not None else (images, captions)


def rerank_matrices(global_sims: torch.Tensor, pair_score, shortlist: int,
                    in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(i2t matrix, t2i matrix) ``[N_img, M]`` from global scores and ``pair_score(img_idx, cap_idx) -> [P]``
    (``in_place``: the i2t matrix is ``global_sims`` itself, rewritten: one ``[N_img, M]`` matrix fewer)."""
    n_img, n_cap = global_sims.shape
    k_cap, k_img = min(shortlist, n_cap), min(shortlist, n_img)
    device = global_sims.device
    top_caps = global_sims.topk(k_cap, dim=1).indices                            # [N_img, k]
    top_imgs = global_sims.topk(k_img, dim=0).indices                            # [k, M]
    img_idx = torch.cat([torch.arange(n_img, device=device).repeat_interleave(k_cap), top_imgs.t().reshape(-1)])
    cap_idx = torch.cat([top_caps.reshape(-1), torch.arange(n_cap, device=device).repeat_interleave(k_img)])
    alpha = pair_score(img_idx, cap_idx).to(global_sims.dtype)
    top = global_sims.max()
    below = global_sims.sub_(top).sub_(2) if in_place else global_sims - top - 2
    t2i = below.clone()
    t2i.scatter_(0, top_imgs, alpha[n_img * k_cap:].view(n_cap, k_img).t())
    i2t = below
    i2t.scatter_(1, top_caps, alpha[:n_img * k_cap].view(n_img, k_cap))
    return i2t, t2i


def _directions(i2t_sims: np.ndarray, t2i_sims: np.ndarray, caption_image: np.ndarray) -> dict:
    i2t = rank_metrics(i2t_ranks(i2t_sims, caption_image))
    t2i = rank_metrics(t2i_ranks(t2i_sims, caption_image))
    return {"i2t": i2t, "t2i": t2i, "rsum": sum(d[k] for d in (i2t, t2i) for k in ("r1", "r5", "r10"))}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def two_step_split(model, data: SplitData, features: ImageFeatures, device: torch.device | str = "cpu",
                   shortlist: int = DEFAULT_SHORTLIST, precision: str = "float64", encode_batch: int = 128,
                   full: bool = False, quiet: bool = True) -> dict:
    """One-step and two-step numbers of one split, with times: ``{"one_step", "two_step", "seconds",
    "pairs_scored"}`` (``full=True`` adds ``"full"``: every pair through ``model.score``).
    """
    if shortlist < 1:
        raise UserError("--shortlist must be ≥ 1")
    if not model.has_global_stage:
        raise UserError(f"model {model.name or type(model).__name__} has no global score to shortlist by")
    device = torch.device(device)
    model.eval()
    dtype = torch.float32 if precision == "float32" else torch.float64   # "refined": the re-rank is cheap, so float64
    # the scoring dtype is passed to every call: nothing is set on the model
    t0 = time.perf_counter()
    images, captions = encode_all(model, data, features, device, encode_batch, quiet=quiet)
    _sync(device)
    t1 = time.perf_counter()
    global_sims = model.global_score(images, captions, dtype=dtype)
    _sync(device)
    t2 = time.perf_counter()
    ci = data.caption_image
    one_step = retrieval_metrics(global_sims.double().cpu().numpy(), ci)
    # the global matrix becomes the i2t matrix: two [N_img, M] matrices held, not four
    i2t, t2i = rerank_matrices(global_sims, lambda ii, cc: model.pair_score(images, captions, ii, cc, dtype=dtype),
                               shortlist, in_place=True)
    _sync(device)
    t3 = time.perf_counter()
    result = {"one_step": one_step,
              "two_step": _directions(i2t.double().cpu().numpy(), t2i.double().cpu().numpy(), ci),
              "shortlist": shortlist,
              "seconds": {"encode": t1 - t0, "global": t2 - t1, "rerank": t3 - t2,
                          "one_step": t2 - t0, "two_step": t3 - t0},
              "pairs_scored": {"two_step": int(data.num_images * min(shortlist, data.num_captions)
                                               + data.num_captions * min(shortlist, data.num_images)),
                               "full": int(data.num_images * data.num_captions)}}
    if full:
        t4 = time.perf_counter()
        sims = full_scores(model, images, captions, dtype=dtype)
        _sync(device)
        result["full"] = retrieval_metrics(sims.double().cpu().numpy(), ci)
        result["seconds"]["full_rerank"] = time.perf_counter() - t4
        result["seconds"]["full"] = result["seconds"]["full_rerank"] + result["seconds"]["encode"]
    return result


@torch.no_grad()
def full_scores(model, images: dict, captions: dict, image_block: int = 128, caption_block: int = 512,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """``model.score`` of every pair (in ``dtype``), block by block → ``[N_img, M]``."""
    n_img, n_cap = next(iter(images.values())).shape[0], next(iter(captions.values())).shape[0]
    out = None
    for i in range(0, n_img, image_block):
        block = {k: v[i:i + image_block] for k, v in images.items()}
        for c in range(0, n_cap, caption_block):
            caps = {k: v[c:c + caption_block] for k, v in captions.items()}
            s = model.score(block, caps, dtype=dtype)
            if out is None:
                out = s.new_empty(n_img, n_cap)
            out[i:i + s.shape[0], c:c + s.shape[1]] = s
    return out


def two_step_protocol(model, data: SplitData, features: ImageFeatures, protocol: str,
                      device: torch.device | str = "cpu", shortlist: int = DEFAULT_SHORTLIST,
                      precision: str = "float64", full: bool = False, allow_size_mismatch: bool = False,
                      quiet: bool = True) -> dict:
    """Every number of ``protocol`` for both steps; ``coco-1k`` runs each fold on its own and averages,
    ``coco-1k-first`` runs the first fold only."""
    mismatch = check_split_size(protocol, data.num_images, allow_size_mismatch)
    result = _two_step_numbers(model, data, features, protocol, device, shortlist, precision, full, quiet)
    if mismatch:
        result["size_mismatch"] = mismatch
    return result


def _two_step_numbers(model, data: SplitData, features: ImageFeatures, protocol: str, device, shortlist: int,
                      precision: str, full: bool, quiet: bool = True) -> dict:
    if protocol == "coco-1k-first":
        start, stop = coco_folds(data.num_images, COCO_FOLDS)[0]
        data, features = data.subset_images(start, stop), _SubsetFeatures(features, start)
    if protocol != "coco-1k":
        result = two_step_split(model, data, features, device, shortlist, precision, full=full, quiet=quiet)
        result.update(images=data.num_images, captions=data.num_captions)
        return result
    folds = []
    for start, stop in coco_folds(data.num_images, COCO_FOLDS):
        sub = data.subset_images(start, stop)
        sub_feats = _SubsetFeatures(features, start)
        fold = two_step_split(model, sub, sub_feats, device, shortlist, precision, full=full, quiet=quiet)
        fold.update(images=sub.num_images, captions=sub.num_captions)
        folds.append(fold)
    out: dict = {"folds": folds, "images": data.num_images, "captions": data.num_captions, "shortlist": shortlist}
    for stage in ("one_step", "two_step", *(("full",) if full else ())):
        out[stage] = {side: {k: float(np.mean([f[stage][side][k] for f in folds])) for k in METRIC_KEYS}
                      for side in ("i2t", "t2i")}
        out[stage]["rsum"] = float(np.mean([f[stage]["rsum"] for f in folds]))
    out["seconds"] = {k: float(sum(f["seconds"][k] for f in folds)) for k in folds[0]["seconds"]}
    return out


class _SubsetFeatures:
    """The rows ``offset:`` of an :class:`ImageFeatures` (a COCO fold) with the same ``get``."""

    def __init__(self, features: ImageFeatures, offset: int):
        self.features, self.offset = features, offset

    def get(self, images):
        return self.features.get(np.asarray(images, dtype=np.int64) + self.offset)
