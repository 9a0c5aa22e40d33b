"""Pieces every model shares, written once (as timm's ``layers/``): masks, masked pooling and softmax, norms.

Shapes: ``B`` batch, ``K``/``L`` items (regions, cells, crops, words), ``d`` features."""
from __future__ import annotations

import torch

EPS = 1e-8


def lengths_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """``[B, max_len]`` bool, True at positions ``< lengths[b]`` (``lengths`` ``[B]`` long)."""
    return torch.arange(max_len, device=lengths.device).view(1, -1) < lengths.view(-1, 1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` ``[B, K, d]`` over K where ``mask`` ``[B, K]`` is True → ``[B, d]`` (0 for an empty row)."""
    weights = mask.to(x.dtype).unsqueeze(-1)
    return (x * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)


def masked_softmax(logits: torch.Tensor, mask: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax of ``logits`` over ``dim`` where ``mask`` (broadcastable bool) is True; exactly 0 elsewhere."""
    logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
    return torch.softmax(logits, dim=dim) * mask


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = EPS) -> torch.Tensor:
    """``x / (‖x‖ + eps)`` along ``dim`` (zero gradient at a zero vector)."""
    return x / (torch.linalg.vector_norm(x, dim=dim, keepdim=True) + eps)


def cosine(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cosine along the last axis (broadcasting), ``x·y / max(‖x‖‖y‖, 1e-8)`` (the authors' form)."""
    return (x * y).sum(-1) / (x.norm(dim=-1) * y.norm(dim=-1)).clamp(min=EPS)


def scale_grad(p: torch.Tensor, scale: float) -> torch.Tensor:
    """``p`` unchanged in value, its gradient multiplied by ``scale`` (1/world size for parameters used only after
    the gather)."""
    return p if scale == 1.0 else p * scale + p.detach() * (1 - scale)
