"""``a @ b.T`` for scoring: oneDNN's float32 GEMM on CPU without gradients, else ``torch.mm``
(why, fallback, ``RETR_ONEDNN_GEMM=0``: docs/trainer.md#evaluation).
"""
from __future__ import annotations

import os

import torch

_onednn_ok: bool | None = None   # None: not tried yet


def _onednn_available() -> bool:
    return (os.environ.get("RETR_ONEDNN_GEMM", "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _use_onednn(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (_onednn_ok is not False and a.device.type == "cpu" and a.dtype == torch.float32
            and b.dtype == torch.float32 and a.numel() > 0 and b.numel() > 0 and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)))


def dot_products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """All dot products ``[M, N]`` of the rows of ``a`` [M, d] with the rows of ``b`` [N, d]."""
    global _onednn_ok
    if _use_onednn(a, b):
        if _onednn_ok is None:
            _onednn_ok = _onednn_available()
        if _onednn_ok:
            try:
                return torch.ops.mkldnn._linear_pointwise(a.contiguous(), b.contiguous(), None, "none", [], "")
            except RuntimeError:
                _onednn_ok = False
    return a @ b.t()
