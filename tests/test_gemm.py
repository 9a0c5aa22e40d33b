"""dot_products: oneDNN's float32 GEMM where it may be used, torch.mm elsewhere; both give the same numbers."""
from __future__ import annotations

import torch

import retr.trainers.models.gemm as gemm


def _operands(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(70, 33, generator=g, dtype=dtype), torch.randn(45, 33, generator=g, dtype=dtype)


def test_products_match_float64_and_torch_mm():
    a, b = _operands()
    got = gemm.dot_products(a, b)
    assert got.shape == (70, 45) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), a.double() @ b.double().t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemm.dot_products(a[:, :20], b[::2, :20]), a[:, :20] @ b[::2, :20].t())
    assert gemm.dot_products(a[:0], b).shape == (0, 45)
    wide = gemm.dot_products(a.double(), b.double())
    assert wide.dtype == torch.float64


def test_onednn_is_used_only_without_gradients(monkeypatch):
    a, b = _operands()
    used = []
    real = gemm._onednn_available

    def spy():
        used.append(True)
        return real()
    monkeypatch.setattr(gemm, "_onednn_ok", None)
    monkeypatch.setattr(gemm, "_onednn_available", spy)
    a.requires_grad_(True)
    out = gemm.dot_products(a, b)
    out.sum().backward()                         # torch.mm: the gradient is b summed over rows
    torch.testing.assert_close(a.grad, b.sum(0).expand_as(a))
    assert not used
    with torch.no_grad():
        gemm.dot_products(a, b)
    assert used


def test_fallback_when_turned_off_or_failing(monkeypatch):
    a, b = _operands()
    monkeypatch.setenv("RETR_ONEDNN_GEMM", "0")
    monkeypatch.setattr(gemm, "_onednn_ok", None)
    torch.testing.assert_close(gemm.dot_products(a, b), a @ b.t())
    assert gemm._onednn_ok is False
    monkeypatch.delenv("RETR_ONEDNN_GEMM")
    monkeypatch.setattr(gemm, "_onednn_ok", None)

    def broken(*args):
        raise RuntimeError("no oneDNN here")
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", broken, raising=False)
    monkeypatch.setattr(gemm, "_onednn_available", lambda: True)
    torch.testing.assert_close(gemm.dot_products(a, b), a @ b.t())
    assert gemm._onednn_ok is False
