"""Golden figures computed by the authors' code (``tools/golden/``) and stored in ``tests/data/golden/<name>/``."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

GOLDEN = Path(__file__).resolve().parent / "data" / "golden"


def load_golden(name: str) -> tuple[dict, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(provenance, inputs, figures)`` of one golden set; arrays are read without pickle."""
    folder = GOLDEN / name
    provenance = json.loads((folder / "provenance.json").read_text(encoding="utf-8"))
    with np.load(folder / "inputs.npz", allow_pickle=False) as f:
        inputs = {k: f[k] for k in f.files}
    with np.load(folder / "figures.npz", allow_pickle=False) as f:
        figures = {k: f[k] for k in f.files}
    return provenance, inputs, figures



class WidenFeatures(torch.nn.Module):
    """Hands ``train_step``'s features to a float64 model in float64. ``train_step`` converts them to float32 (the
    loader may give float16); golden features are float32 numbers, so nothing is lost on the way."""

    batch_extras = ()

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, features, mask, tokens, lengths, gather=None):
        return self.model(features.double(), mask, tokens, lengths, gather)


def assert_relative_gap(got, want, what: str, tol: float, scale: float | None = None) -> float:
    """``max |got − want| ≤ tol · scale`` (default scale: ``max |want|``); returns the relative gap."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    scale = max(float(np.abs(want).max()), 1e-300) if scale is None else scale
    gap = float(np.abs(got - want).max()) / scale
    assert gap <= tol, f"{what}: relative gap {gap:.3g} > {tol:.0e} (scale {scale:.3g})"
    return gap


@pytest.fixture
def one_torch_thread():
    """Tiny tensors: one thread is fastest (a golden file's gaps are measured with 1, 2 and 4)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
