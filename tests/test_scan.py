"""SCAN's vectorised cross attention against a direct, per-pair implementation of the paper's equations."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from retr.trainers.models import create_model
from retr.trainers.models.scan import AGGREGATIONS, NORMS, xattn_scores


def _normalise_direct(attn: list[list[float]], norm: str) -> list[list[float]]:
    """attn[context][query]; normalise over the query axis for each context item (as the authors' code)."""
    out = []
    for row in attn:
        if norm in ("clipped_l2norm", "clipped"):
            row = [x if x > 0 else 0.1 * x for x in row]
        if norm in ("clipped_l2norm", "l2norm"):
            n = math.sqrt(sum(x * x for x in row)) + 1e-8
            row = [x / n for x in row]
        elif norm == "softmax":
            z = sum(math.exp(x) for x in row)
            row = [math.exp(x) / z for x in row]
        out.append(row)
    return out


def _cos(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x * y).sum() / max(float(x.norm() * y.norm()), 1e-8))


def direct_score(v: torch.Tensor, e: torch.Tensor, direction: str, norm: str, agg: str, lsm: float,
                 lse: float) -> float:
    """One image (v [k, d], real regions only) vs one caption (e [n, d], real words only), loops and floats."""
    if direction == "t2i":
        query, context = e, v
    else:
        query, context = v, e
    attn = [[float(c @ q) for q in query] for c in context]         # [context][query]
    attn = _normalise_direct(attn, norm)
    rel = []
    for j, q in enumerate(query):
        weights = [math.exp(lsm * attn[i][j]) for i in range(len(context))]
        z = sum(weights)
        attended = sum((w / z) * context[i] for i, w in enumerate(weights))
        rel.append(_cos(q, attended))
    if agg == "lse":
        return math.log(sum(math.exp(lse * r) for r in rel)) / lse
    if agg == "avg":
        return sum(rel) / len(rel)
    if agg == "max":
        return max(rel)
    return sum(rel)


def _random_block(n_img=3, n_cap=4, k=5, length=6, d=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    regions = torch.nn.functional.normalize(torch.randn(n_img, k, d, generator=g, dtype=torch.float64), dim=-1)
    words = torch.nn.functional.normalize(torch.randn(n_cap, length, d, generator=g, dtype=torch.float64), dim=-1)
    num_boxes = torch.tensor([k, 2, 1][:n_img])                     # includes an image with one region
    lengths = torch.tensor([length, 1, 3, 4][:n_cap])               # includes a one-word caption
    rmask = torch.arange(k).view(1, -1) < num_boxes.view(-1, 1)
    wmask = torch.arange(length).view(1, -1) < lengths.view(-1, 1)
    words = words * wmask.unsqueeze(-1)                            # the encoder's padding is zero
    return regions, rmask, words, wmask, num_boxes, lengths


@pytest.mark.parametrize("direction,norm,agg", list(itertools.product(("t2i", "i2t"), NORMS, AGGREGATIONS)))
def test_vectorised_scores_equal_direct_equations(direction, norm, agg):
    regions, rmask, words, wmask, num_boxes, lengths = _random_block(seed=hash((direction, norm, agg)) % 1000)
    got = xattn_scores(regions, rmask, words, wmask, direction, norm, agg, lambda_softmax=4.0, lambda_lse=5.0)
    for b, c in itertools.product(range(regions.shape[0]), range(words.shape[0])):
        want = direct_score(regions[b, :num_boxes[b]], words[c, :lengths[c]], direction, norm, agg, 4.0, 5.0)
        assert got[b, c].item() == pytest.approx(want, rel=1e-9, abs=1e-12), (b, c)


def test_unnormalised_regions_and_float32_products():
    """no_imgnorm: region norms ≠ 1 enter the cosine; float32 products with float64 accumulation stay close."""
    regions, rmask, words, wmask, num_boxes, lengths = _random_block(seed=5)
    regions = regions * torch.linspace(0.5, 3.0, regions.shape[1]).view(1, -1, 1).double()
    for direction in ("t2i", "i2t"):
        exact = xattn_scores(regions, rmask, words, wmask, direction)
        mixed = xattn_scores(regions.float(), rmask, words.float(), wmask, direction, dtype=torch.float64)
        assert mixed.dtype == torch.float64
        for b, c in itertools.product(range(3), range(4)):
            want = direct_score(regions[b, :num_boxes[b]], words[c, :lengths[c]], direction, "clipped_l2norm",
                                "lse", 9.0, 6.0)
            assert exact[b, c].item() == pytest.approx(want, rel=1e-9)
        torch.testing.assert_close(mixed, exact, rtol=1e-5, atol=1e-6)


def test_block_of_one_image_and_one_caption():
    regions, rmask, words, wmask, num_boxes, lengths = _random_block(seed=2)
    full = xattn_scores(regions, rmask, words, wmask, "i2t", agg="avg")
    single = xattn_scores(regions[2:3], rmask[2:3], words[1:2, :1], wmask[1:2, :1], "i2t", agg="avg")
    assert single.shape == (1, 1)
    assert single.item() == pytest.approx(full[2, 1].item(), rel=1e-12)


def test_scan_model_gradients_flow():
    """(Padded regions and words changing no score: test_model_registry.py, for every model.)"""
    torch.manual_seed(0)
    model = create_model("scan", vocab_size=30, img_dim=8, embed_size=6, word_dim=5, direction="t2i")
    features = torch.randn(2, 4, 8)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    tokens = torch.randint(4, 30, (3, 6))
    lengths = torch.tensor([6, 3, 1])
    loss = model(features, mask, tokens[:2], lengths[:2])
    loss.backward()
    assert model.img_enc.fc.weight.grad.abs().sum() > 0
    assert model.txt_enc.rnn.weight_ih_l0.grad.abs().sum() > 0


@pytest.mark.parametrize("direction", ["t2i", "i2t"])
def test_gradients_are_finite_with_padded_regions_and_words(direction):
    """Zero vectors at padded positions must not turn gradients into NaN (norms of zero vectors)."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    for agg, norm in itertools.product(AGGREGATIONS, NORMS):
        model = create_model("scan", vocab_size=30, img_dim=16, embed_size=8, word_dim=5, direction=direction,
                             agg=agg, norm=norm)
        loss = model(torch.randn(4, 4, 16), mask, torch.randint(4, 30, (4, 6)), torch.tensor([6, 3, 2, 5]))
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters()), (agg, norm)


@pytest.mark.parametrize("direction,norm,agg", [("t2i", "clipped_l2norm", "lse"), ("i2t", "clipped_l2norm", "lse"),
                                                ("t2i", "softmax", "max"), ("i2t", "no_norm", "avg"),
                                                ("t2i", "l2norm", "sum"), ("i2t", "clipped", "lse")])
def test_chunked_in_place_scoring_equals_the_autograd_path(monkeypatch, direction, norm, agg):
    """Without gradients a block is cut into cache-sized chunks and updated in place: same numbers, float32 too."""
    import retr.trainers.models.scan as xattn
    g = torch.Generator().manual_seed(3)
    n_img, n_cap, k, length, d = 37, 23, 5, 6, 16
    regions = torch.nn.functional.normalize(torch.randn(n_img, k, d, generator=g), dim=-1)
    words = torch.nn.functional.normalize(torch.randn(n_cap, length, d, generator=g), dim=-1)
    rmask = torch.arange(k) < torch.randint(1, k + 1, (n_img, 1), generator=g)
    wmask = torch.arange(length) < torch.randint(1, length + 1, (n_cap, 1), generator=g)
    regions.requires_grad_(True)
    with_grad = xattn_scores(regions, rmask, words, wmask, direction, norm, agg)   # one block, out of place
    assert with_grad.requires_grad
    monkeypatch.setattr(xattn, "CHUNK_ELEMENTS", 2 * k * length * 16)            # 16 images × 2 captions a chunk
    with torch.no_grad():
        chunked = xattn_scores(regions, rmask, words, wmask, direction, norm, agg)
        mixed = xattn_scores(regions, rmask, words, wmask, direction, norm, agg, agg_dtype=torch.float64)
    assert chunked.dtype == torch.float32 and mixed.dtype == torch.float64
    torch.testing.assert_close(chunked, with_grad.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mixed.float(), with_grad.detach(), rtol=1e-5, atol=1e-6)
    wide = xattn_scores(regions.detach().double(), rmask, words.double(), wmask, direction, norm, agg)
    torch.testing.assert_close(mixed, wide, rtol=1e-5, atol=1e-6)
