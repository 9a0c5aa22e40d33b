"""Stacked cross attention scores (SCAN, Lee et al. 2018), vectorised over blocks of images and captions.

The authors' code scores one caption against a block of images at a time and forms every attended vector.
Here a block of ``n_img`` images × ``n_cap`` captions is scored at once, with masks for padded regions and
words, and without forming attended vectors (which costs ``K·L·d`` per pair):

* the region–word dot products of the whole block are one matrix product
  ``D[b, i, c, j] = v_{b,i} · e_{c,j}`` ([n_img·K, d] × [d, n_cap·L]);
* the attended vector's dot product with its query and its norm follow from ``D`` and a Gram matrix:
  t-i: ``e_j · a_j = Σ_i α_ij D_ij`` and ``‖a_j‖² = α_jᵀ G α_j`` with the per-image ``G = V Vᵀ`` [K, K];
  i-t: ``v_i · a_i = Σ_j α_ij D_ij`` and ``‖a_i‖² = α_iᵀ H α_i`` with the per-caption ``H = E Eᵀ`` [L, L].

Equations (paper §3.1–3.2, with the authors' code for what the paper leaves open, ``reference/scan.md``):
``attn = D`` normalised over the *query* axis (``clipped_l2norm``: LeakyReLU(0.1) then l2 norm, the default;
``l2norm``; ``clipped``; ``softmax``; ``no_norm``), then ``α = softmax(λ_softmax · attn)`` over the *context*
axis; ``R = cos(query, attended)`` with the authors' cosine ``x·y / max(‖x‖‖y‖, 1e-8)``; aggregated over the
query axis by LogSumExp ``(1/λ_lse) log Σ exp(λ_lse R)``, mean (AVG), max or sum.

Padding: the authors slice each caption to its length and always have 36 real regions; here padded words and
regions (``mask`` False) are excluded from every normalisation, softmax and aggregation, which gives the same
numbers for the real positions. Blocks with one image or one-word captions are ordinary cases.

Precision: ``D`` is computed in the inputs' dtype (float32 in training); ``dtype`` (e.g. float64 in evaluation)
is used for everything after it, so the sums that decide ranks accumulate in float64.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

NORMS = ("clipped_l2norm", "l2norm", "clipped", "softmax", "no_norm")
AGGREGATIONS = ("lse", "avg", "max", "sum")
DIRECTIONS = ("t2i", "i2t")
EPS = 1e-8
_TINY = 1e-30   # keeps sqrt's gradient finite where an attended vector is exactly zero (padding)


def _normalise(attn: torch.Tensor, mask: torch.Tensor, dim: int, norm: str) -> torch.Tensor:
    """Normalise ``attn`` over the query axis ``dim``; ``mask`` (broadcastable, bool) marks real queries."""
    if norm in ("clipped_l2norm", "clipped"):
        attn = F.leaky_relu(attn, 0.1)
    if norm in ("clipped_l2norm", "l2norm"):
        attn = attn.masked_fill(~mask, 0)
        attn = attn / (torch.linalg.vector_norm(attn, dim=dim, keepdim=True) + EPS)
    elif norm == "softmax":
        attn = torch.softmax(attn.masked_fill(~mask, float("-inf")), dim=dim)
    elif norm not in ("clipped", "no_norm"):
        raise ValueError(f"unknown attention normalisation {norm!r} (expected one of {', '.join(NORMS)})")
    return attn


def _aggregate(r: torch.Tensor, mask: torch.Tensor, dim: int, agg: str, lambda_lse: float) -> torch.Tensor:
    """Aggregate relevance ``r`` over ``dim`` where ``mask`` is True."""
    if agg == "lse":
        return torch.logsumexp((lambda_lse * r).masked_fill(~mask, float("-inf")), dim=dim) / lambda_lse
    if agg == "max":
        return r.masked_fill(~mask, float("-inf")).amax(dim=dim)
    total = r.masked_fill(~mask, 0).sum(dim=dim)
    if agg == "sum":
        return total
    if agg == "avg":
        return total / mask.sum(dim=dim).clamp(min=1).to(total.dtype)
    raise ValueError(f"unknown aggregation {agg!r} (expected one of {', '.join(AGGREGATIONS)})")


def xattn_scores(regions: torch.Tensor, region_mask: torch.Tensor, words: torch.Tensor, word_mask: torch.Tensor,
                 direction: str = "t2i", norm: str = "clipped_l2norm", agg: str = "lse",
                 lambda_softmax: float = 9.0, lambda_lse: float = 6.0,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """SCAN similarities ``[n_img, n_cap]`` of a block.

    Args:
        regions: ``[n_img, K, d]`` region vectors; ``region_mask`` ``[n_img, K]`` bool (True = real region).
        words: ``[n_cap, L, d]`` word vectors; ``word_mask`` ``[n_cap, L]`` bool (True = real word).
        direction: ``t2i`` (words attend to regions, aggregate over words) or ``i2t`` (the reverse).
        dtype: dtype of everything after the region–word product (default: the inputs').
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r} (expected t2i or i2t)")
    n_img, k, d = regions.shape
    n_cap, length, _ = words.shape
    dtype = dtype or regions.dtype
    dots = (regions.reshape(n_img * k, d) @ words.reshape(n_cap * length, d).t()).to(dtype)
    dots = dots.view(n_img, k, n_cap, length)                                   # [I, K, C, L]
    regions_acc, words_acc = regions.to(dtype), words.to(dtype)
    rmask = region_mask.view(n_img, k, 1, 1)
    wmask = word_mask.view(1, 1, n_cap, length)
    if direction == "t2i":
        # query = words (axis 3), context = regions (axis 1)
        attn = _normalise(dots, wmask, 3, norm)
        alpha = torch.softmax((lambda_softmax * attn).masked_fill(~rmask, float("-inf")), dim=1)
        along = (alpha * dots).sum(dim=1)                                         # e_j · a_j   [I, C, L]
        gram = regions_acc @ regions_acc.transpose(1, 2)                          # [I, K, K]
        g_alpha = (gram @ alpha.reshape(n_img, k, n_cap * length)).view_as(alpha)
        attended_sq = (alpha * g_alpha).sum(dim=1)                                # ‖a_j‖²     [I, C, L]
        query_norm = words_acc.norm(dim=-1).view(1, n_cap, length)
        relevance = along / (query_norm * attended_sq.clamp(min=_TINY).sqrt()).clamp(min=EPS)
        return _aggregate(relevance, word_mask.view(1, n_cap, length), 2, agg, lambda_lse)
    # i2t: query = regions (axis 1), context = words (axis 3)
    attn = _normalise(dots, rmask, 1, norm)
    alpha = torch.softmax((lambda_softmax * attn).masked_fill(~wmask, float("-inf")), dim=3)
    along = (alpha * dots).sum(dim=3)                                             # v_i · a_i   [I, K, C]
    gram = words_acc @ words_acc.transpose(1, 2)                                  # [C, L, L]
    alpha_c = alpha.permute(2, 3, 0, 1).reshape(n_cap, length, n_img * k)         # [C, L, I·K]
    attended_sq = (alpha_c * (gram @ alpha_c)).sum(dim=1).view(n_cap, n_img, k).permute(1, 2, 0)  # [I, K, C]
    query_norm = regions_acc.norm(dim=-1).view(n_img, k, 1)
    relevance = along / (query_norm * attended_sq.clamp(min=_TINY).sqrt()).clamp(min=EPS)
    return _aggregate(relevance, region_mask.view(n_img, k, 1), 1, agg, lambda_lse)
