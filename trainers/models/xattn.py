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
numbers for the real positions. Padded vectors are zeroed first, so padded positions have ``D = 0``: they then
add nothing to an l2 norm, and masks are applied only where a zero is not neutral (softmaxes, aggregation) and
only when the block has padding. Blocks with one image or one-word captions are ordinary cases.

Precision: everything runs in ``dtype`` (default: the inputs'); the aggregation over the query axis runs in
``agg_dtype`` (the evaluator's fast pass uses float32 work with float64 aggregation, then rescores the pairs
that decide ranks in float64 throughout: :mod:`retr.trainers.evaluation.similarity`).

Attention: :func:`xattn_block` is the scoring function; with ``keep_attention`` it also returns the weights
``α`` of every pair of the block (SCAN's ``explain`` reads one pair's), and :func:`xattn_scores` is it with the
weights dropped — the scores and the maps come from one computation and cannot disagree.

Speed (no gradient needed, i.e. evaluation): the block is scored in chunks of about ``CHUNK_ELEMENTS`` entries of
``D`` so the ``[I, K, C, L]`` temporaries stay in the CPU's L2/L3 cache, the chunk's temporaries are updated in
place, and float32 products go through :func:`retr.trainers.evaluation.gemm.dot_products`. With gradients the same
arithmetic runs out of place on the whole block. ``bench/eval.py`` measures it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from retr.trainers.evaluation.gemm import dot_products

NORMS = ("clipped_l2norm", "l2norm", "clipped", "softmax", "no_norm")
AGGREGATIONS = ("lse", "avg", "max", "sum")
DIRECTIONS = ("t2i", "i2t")
EPS = 1e-8
_TINY = 1e-30   # keeps sqrt's gradient finite where an attended vector is exactly zero (padding)
CHUNK_ELEMENTS = 1 << 19   # entries of D per chunk without gradients (2 MiB in float32: fits a 2 MiB L2 + L3)


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


def _attention(dots: torch.Tensor, query_mask: torch.Tensor | None, context_mask: torch.Tensor | None,
               query_dim: int, context_dim: int, norm: str, lambda_softmax: float, inplace: bool) -> torch.Tensor:
    """``α = softmax(λ · normalise(D))``: normalised over ``query_dim``, softmax over ``context_dim``.

    Masks (broadcastable to ``dots``, True = real) are ``None`` when every position is real. Padded positions
    hold ``D = 0``, so after clipping they add nothing to the l2 norm and need no mask there.
    """
    if norm in ("clipped_l2norm", "clipped"):
        attn = F.leaky_relu(dots, 0.1)
    elif norm in ("l2norm", "softmax", "no_norm"):
        attn = dots.clone() if inplace else dots
    else:
        raise ValueError(f"unknown attention normalisation {norm!r} (expected one of {', '.join(NORMS)})")
    if norm in ("clipped_l2norm", "l2norm"):
        # λ folded into the per-row scale: one pass over D instead of two
        if inplace:   # PyTorch's vector_norm over a non-innermost axis is ~25× slower than this (no gradient here)
            norm_ = attn.square().sum(dim=query_dim, keepdim=True).sqrt_()
        else:         # vector_norm's gradient is finite at an all-zero (padded) row
            norm_ = torch.linalg.vector_norm(attn, dim=query_dim, keepdim=True)
        scale = lambda_softmax / (norm_ + EPS)
        attn = attn.mul_(scale) if inplace else attn * scale
    else:
        if norm == "softmax":
            if query_mask is not None:
                attn = attn.masked_fill(~query_mask, float("-inf"))
            attn = _softmax(attn, query_dim, inplace)
        attn = attn.mul_(lambda_softmax) if inplace else attn * lambda_softmax
    if context_mask is not None:
        attn = attn.masked_fill_(~context_mask, float("-inf")) if inplace else attn.masked_fill(~context_mask,
                                                                                                 float("-inf"))
    return _softmax(attn, context_dim, inplace)


def _softmax(x: torch.Tensor, dim: int, inplace: bool) -> torch.Tensor:
    """``softmax(x, dim)``; in place over the innermost axis, where PyTorch's kernel is ~3.5× slower for the
    short axes here (L ≤ ~50 words)."""
    if not inplace or dim not in (-1, x.dim() - 1):
        return torch.softmax(x, dim=dim)
    x = x.sub_(x.amax(dim=dim, keepdim=True)).exp_()
    return x.div_(x.sum(dim=dim, keepdim=True))


def _block_dots(regions, rmask, words, wmask):
    """``D`` [I, K, C, L] of a chunk, and its region and word masks as views broadcastable to it (or None)."""
    n_img, k, d = regions.shape
    n_cap, length, _ = words.shape
    dots = dot_products(regions.reshape(n_img * k, d), words.reshape(n_cap * length, d))
    return (dots.view(n_img, k, n_cap, length), None if rmask is None else rmask.view(n_img, k, 1, 1),
            None if wmask is None else wmask.view(1, 1, n_cap, length))


def _t2i(regions, rmask, gram, words, word_norm, wmask, norm, lambda_softmax,
         inplace) -> tuple[torch.Tensor, torch.Tensor]:
    """Relevance ``R`` [I, C, L] of each word to its attended image vector (words attend to regions), and the
    attention ``α`` [I, K, C, L] (softmax over the regions, axis 1) it was computed with."""
    dots, region_axis, word_axis = _block_dots(regions, rmask, words, wmask)
    n_img, k, n_cap, length = dots.shape
    alpha = _attention(dots, word_axis, region_axis, 3, 1, norm, lambda_softmax, inplace)
    along = (dots.mul_(alpha) if inplace else dots * alpha).sum(dim=1)         # e_j · a_j   [I, C, L]
    g_alpha = torch.bmm(gram, alpha.view(n_img, k, n_cap * length)).view(n_img, k, n_cap, length)
    attended_sq = (g_alpha.mul_(alpha) if inplace else g_alpha * alpha).sum(dim=1)   # ‖a_j‖²  [I, C, L]
    rel = along / (word_norm.view(1, n_cap, length) * attended_sq.clamp(min=_TINY).sqrt()).clamp(min=EPS)
    return rel, alpha


def _i2t(regions, rmask, region_norm, words, wmask, gram, norm, lambda_softmax,
         inplace) -> tuple[torch.Tensor, torch.Tensor]:
    """Relevance ``R`` [I, K, C] of each region to its attended caption vector (regions attend to words), and the
    attention ``α`` [I, K, C, L] (softmax over the words, axis 3) it was computed with."""
    dots, region_axis, word_axis = _block_dots(regions, rmask, words, wmask)
    n_img, k, n_cap, length = dots.shape
    alpha = _attention(dots, region_axis, word_axis, 1, 3, norm, lambda_softmax, inplace)
    along = (dots.mul_(alpha) if inplace else dots * alpha).sum(dim=3)         # v_i · a_i   [I, K, C]
    alpha_c = alpha.permute(2, 0, 1, 3).reshape(n_cap, n_img * k, length)         # [C, I·K, L]
    h_alpha = torch.bmm(alpha_c, gram)                                            # gram is symmetric
    attended_sq = (h_alpha.mul_(alpha_c) if inplace else h_alpha * alpha_c).sum(dim=2)   # ‖a_i‖²  [C, I·K]
    attended_sq = attended_sq.view(n_cap, n_img, k).permute(1, 2, 0)
    rel = along / (region_norm.view(n_img, k, 1) * attended_sq.clamp(min=_TINY).sqrt()).clamp(min=EPS)
    return rel, alpha


def _chunks(total: int, step: int):
    return [slice(s, min(s + step, total)) for s in range(0, total, step)]


def xattn_scores(regions: torch.Tensor, region_mask: torch.Tensor, words: torch.Tensor, word_mask: torch.Tensor,
                 direction: str = "t2i", norm: str = "clipped_l2norm", agg: str = "lse",
                 lambda_softmax: float = 9.0, lambda_lse: float = 6.0,
                 dtype: torch.dtype | None = None, agg_dtype: torch.dtype | None = None) -> torch.Tensor:
    """SCAN similarities ``[n_img, n_cap]`` of a block, in ``agg_dtype``.

    Args:
        regions: ``[n_img, K, d]`` region vectors; ``region_mask`` ``[n_img, K]`` bool (True = real region).
        words: ``[n_cap, L, d]`` word vectors; ``word_mask`` ``[n_cap, L]`` bool (True = real word).
        direction: ``t2i`` (words attend to regions, aggregate over words) or ``i2t`` (the reverse).
        dtype: dtype of the products and attention (default: the inputs').
        agg_dtype: dtype of the relevance aggregation over the query axis (default: ``dtype``).
    """
    return xattn_block(regions, region_mask, words, word_mask, direction, norm, agg, lambda_softmax, lambda_lse,
                       dtype, agg_dtype, keep_attention=False)[0]


def xattn_block(regions: torch.Tensor, region_mask: torch.Tensor, words: torch.Tensor, word_mask: torch.Tensor,
                direction: str = "t2i", norm: str = "clipped_l2norm", agg: str = "lse",
                lambda_softmax: float = 9.0, lambda_lse: float = 6.0,
                dtype: torch.dtype | None = None, agg_dtype: torch.dtype | None = None,
                keep_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`xattn_scores` (arguments as there) and, with ``keep_attention``, the attention weights the scores
    were computed from: ``α`` ``[n_img, K, n_cap, L]`` in ``dtype`` (else None).

    ``α[i, k, c, j]`` is, for ``t2i``, the weight of region k in word j's attended image vector (a softmax over
    k: each real word's weights over the real regions sum to 1); for ``i2t``, the weight of word j in region k's
    attended caption vector (a softmax over j). Padded regions (t2i) / words (i2t) have weight 0; the rows of
    padded queries are meaningless. :func:`xattn_scores` is this function with the attention dropped, so the
    weights are the very ones behind the scores (SCAN's ``explain``).
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r} (expected t2i or i2t)")
    if norm not in NORMS:
        raise ValueError(f"unknown attention normalisation {norm!r} (expected one of {', '.join(NORMS)})")
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {agg!r} (expected one of {', '.join(AGGREGATIONS)})")
    dtype = dtype or regions.dtype
    agg_dtype = agg_dtype or dtype
    n_img, k, _ = regions.shape
    n_cap, length, _ = words.shape
    region_mask, word_mask = region_mask.bool(), word_mask.bool()
    regions = regions.to(dtype)
    words = words.to(dtype) * word_mask.unsqueeze(-1).to(dtype)                  # padded words → 0
    rmask = None if bool(region_mask.all()) else region_mask
    if rmask is not None:
        regions = regions * rmask.unsqueeze(-1).to(dtype)
    wmask = None if bool(word_mask.all()) else word_mask
    needs_grad = torch.is_grad_enabled() and (regions.requires_grad or words.requires_grad)
    inplace = not needs_grad
    attention = regions.new_empty(n_img, k, n_cap, length) if keep_attention else None

    def part(mask: torch.Tensor | None, index: slice) -> torch.Tensor | None:
        return None if mask is None else mask[index]

    def keep(i: slice, c: slice, alpha: torch.Tensor) -> None:
        if attention is not None:
            attention[i, :, c] = alpha.detach()

    if direction == "t2i":
        gram = regions @ regions.transpose(1, 2)                                  # [I, K, K]
        word_norm = words.norm(dim=-1)                                            # [C, L]

        def chunk(i: slice, c: slice) -> torch.Tensor:
            rel, alpha = _t2i(regions[i], part(rmask, i), gram[i], words[c], word_norm[c], part(wmask, c), norm,
                              lambda_softmax, inplace)
            keep(i, c, alpha)
            return _aggregate(rel.to(agg_dtype), word_mask[c].unsqueeze(0), 2, agg, lambda_lse)
    else:
        gram = words @ words.transpose(1, 2)                                      # [C, L, L]
        region_norm = regions.norm(dim=-1)                                        # [I, K]

        def chunk(i: slice, c: slice) -> torch.Tensor:
            rel, alpha = _i2t(regions[i], part(rmask, i), region_norm[i], words[c], part(wmask, c), gram[c], norm,
                              lambda_softmax, inplace)
            keep(i, c, alpha)
            return _aggregate(rel.to(agg_dtype), region_mask[i].unsqueeze(-1), 1, agg, lambda_lse)

    everything = slice(None)
    if needs_grad:
        return chunk(everything, everything), attention
    img_step = min(n_img, 16)
    cap_step = max(1, CHUNK_ELEMENTS // (img_step * k * max(1, length)))
    out = torch.empty(n_img, n_cap, dtype=agg_dtype, device=regions.device)
    for i in _chunks(n_img, img_step):
        for c in _chunks(n_cap, cap_step):
            out[i, c] = chunk(i, c)
    return out, attention
