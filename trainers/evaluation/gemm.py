"""``a @ b.T`` for scoring: oneDNN's float32 GEMM on CPU when no gradient is needed, ``torch.mm`` otherwise.

Why not just ``torch.mm``: on CPU, PyTorch sends float32 ``mm`` to MKL's sgemm, which on AMD processors runs a
generic code path. oneDNN's GEMM (which PyTorch also ships, for its own fused linear layers) is 2–2.5× faster
there: on the 2-core AMD EPYC of CI, 310–380 GFLOP/s against 140–180 for region–word products of evaluation
blocks (``bench/eval.py`` reports the effect on the whole evaluator). Both are IEEE float32 products with float32
accumulation; results differ only by rounding (≈1e-7 relative).

oneDNN is reached through ``torch.ops.mkldnn._linear_pointwise`` (the op PyTorch's compiler emits for a linear
layer with a dense weight). It has no autograd formula, so it is used only when neither operand needs a gradient;
if the op is missing or fails (another PyTorch build), :func:`dot_products` falls back to
``torch.mm`` for the rest of the process. ``RETR_ONEDNN_GEMM=0`` turns it off.
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
