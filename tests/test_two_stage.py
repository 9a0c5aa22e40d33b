"""Two-stage search for cross-attention models (``trainers/search/two_stage.py``): with the whole
gallery shortlisted it is the exhaustive ranking; with a small shortlist every returned score is the exhaustive
score of that pair and the items are the shortlist's best; its recall@k against the exhaustive top k is counted
correctly."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from retr.common.errors import UserError
from retr.trainers.models import create_model
from retr.trainers.search.two_stage import SHORTLIST_VECTORS, TwoStageSearch, shortlist_vectors
from retr.trainers.search.vector_index import recall_at_k

pytestmark = pytest.mark.numerical
N, Q, K, D, V = 120, 12, 4, 16, 40
SIZES = {"scan": {}, "seam": {"hops": 2, "attention_hidden": 8, "conv_filters": 4}, "sman": {}}


def _encoded(name: str):
    """A random-weight float64 model (the scores then tie only where the arithmetic does) and its encodings of
    N images (some with padded regions) and N captions of varied lengths."""
    torch.manual_seed(0)
    model = create_model(name, vocab_size=V, img_dim=D, embed_size=16, word_dim=8, **SIZES[name]).double().eval()
    mask = torch.ones(N, K, dtype=torch.bool)
    mask[::3, 3] = False
    lengths = torch.randint(3, 10, (N,))
    with torch.no_grad():
        images = model.encode_images(torch.randn(N, K, D, dtype=torch.float64), mask)
        captions = model.encode_captions(torch.randint(4, V, (N, int(lengths.max()))), lengths)
    return model, images, captions


def _both_sides(name: str):
    """(model, gallery side, gallery, queries) for text → images and image → texts."""
    model, images, captions = _encoded(name)
    yield model, "image", images, {k: v[:Q] for k, v in captions.items()}
    yield model, "caption", captions, {k: v[:Q] for k, v in images.items()}


@pytest.mark.parametrize("name", sorted(SHORTLIST_VECTORS))
def test_the_whole_gallery_shortlisted_is_the_exhaustive_ranking(name):
    for model, side, gallery, queries in _both_sides(name):
        search = TwoStageSearch(model, gallery, side, shortlist=N)
        scores, rows = search.search(queries, 10)
        want_scores, want_rows = search.exhaustive(queries, 10)
        assert np.array_equal(rows, want_rows)
        # the same pairs through ``score`` in other blocks: float64 rounding of reordered sums only
        assert np.allclose(scores, want_scores, rtol=0, atol=1e-12)
        assert search.recall(queries) == {1: 1.0, 5: 1.0, 10: 1.0}


@pytest.mark.parametrize("name", sorted(SHORTLIST_VECTORS))
def test_a_small_shortlist_returns_its_best_with_the_exhaustive_scores(name):
    for model, side, gallery, queries in _both_sides(name):
        search = TwoStageSearch(model, gallery, side, shortlist=15)
        scores, rows = search.search(queries, 5)
        with torch.no_grad():
            full = model.score(gallery, queries) if side == "image" else model.score(queries, gallery).t()
        full = full.t().numpy()                                    # [Q, N]: every pair, one block
        assert np.allclose(scores, np.take_along_axis(full, rows, 1), rtol=0, atol=1e-12)
        vectors = shortlist_vectors(model, gallery, side).double()
        query_vectors = shortlist_vectors(model, queries, search.query_side).double()
        for q in range(len(rows)):                                # the 15 best by inner product, then by score
            inner = (query_vectors[q] @ vectors.t()).numpy()
            listed = np.argsort(-inner, kind="stable")[:15]
            # the 15th and 16th apart by far more than the index's float32 rounding (~1e-7): the same 15
            assert -np.diff(np.sort(inner)[::-1][14:16])[0] > 1e-5
            best = listed[np.lexsort((listed, -full[q, listed]))[:5]]
            assert np.array_equal(rows[q], best)
        assert (np.diff(scores, axis=1) <= 0).all()


def test_recall_counts_the_exhaustive_top_k_found():
    model, images, captions = _encoded("scan")
    captions = {k: v[:Q] for k, v in captions.items()}
    search = TwoStageSearch(model, images, "image", shortlist=10)
    found, truth = search.search(captions, 10)[1], search.exhaustive(captions, 10)[1]
    recall = search.recall(captions, ks=(1, 5, 10))
    for k in (1, 5, 10):
        hits = sum(len(set(f[:k]) & set(t[:k])) for f, t in zip(found.tolist(), truth.tolist()))
        assert recall[k] == pytest.approx(hits / (k * Q)) == recall_at_k(found, truth, k)
    assert recall[10] < 1.0          # random weights: a 10-item shortlist misses part of the exhaustive top 10


def test_models_the_shortlist_does_not_know_are_refused():
    model = create_model("vsepp", vocab_size=V, img_dim=D, embed_size=16, word_dim=8).eval()
    with torch.no_grad():
        images = model.encode_images(torch.randn(5, K, D), torch.ones(5, K, dtype=torch.bool))
    assert torch.equal(shortlist_vectors(model, images, "image"), model.index_vectors(images, "image"))
    model.index_vectors = lambda embeddings, side: None            # as a cross-attention model without a rule
    with pytest.raises(UserError, match="no shortlist vectors"):
        shortlist_vectors(model, images, "image")
    with pytest.raises(UserError, match="at least 1"):
        TwoStageSearch(model, images, "image", shortlist=0)
