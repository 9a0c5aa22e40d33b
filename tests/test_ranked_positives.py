"""Places of positives in ranked lists and the metrics read from them (trainers/evaluation/ranked_positives.py),
against brute force (whole lists sorted by the tie rule) and eccv_caption's own per-query loops on small matrices
full of ties. Every comparison is exact: the metrics must be eccv_caption's to the last bit."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

with warnings.catch_warnings():                      # eccv_caption warns that ujson is not installed
    warnings.simplefilter("ignore")
    from eccv_caption._metrics import compute_eccv_metrics, compute_r_at_k

from retr.trainers.evaluation.ranked_positives import (NOT_RANKED, QueryRows, TopOfLists, eccv_metrics,
                                                       positive_positions, recall_at)


def _lists(scores: np.ndarray, items: np.ndarray, ties: str) -> list[np.ndarray]:
    """Each query's whole ranked list by the rule's definition: official = ``np.argsort(row)[::-1]``,
    pessimistic = by score, then every non-positive before the positives it ties."""
    out = []
    for q, row in enumerate(scores):
        if ties == "official":
            out.append(np.argsort(row)[::-1])
        else:
            positive = np.isin(np.arange(len(row)), items[q][items[q] >= 0])
            out.append(np.lexsort((positive, -row)))
    return out


def _case(rng: np.random.Generator):
    """A small matrix of few distinct scores (ties everywhere), each query's positives (padded with −1), and
    their number R (one positive absent from the gallery now and then: counted in R, never retrieved)."""
    queries, gallery = int(rng.integers(1, 8)), int(rng.integers(2, 40))
    scores = rng.integers(0, int(rng.integers(1, 6)), (queries, gallery)).astype(float)
    width = int(rng.integers(1, min(gallery, 8) + 1))
    items = np.full((queries, width), -1)
    counts = np.zeros(queries, dtype=np.int64)
    truth = {}
    for q in range(queries):
        k = int(rng.integers(1, width + 1))
        items[q, :k] = rng.choice(gallery, k, replace=False)
        absent = int(k < gallery and rng.integers(0, 2))
        counts[q] = k + absent
        truth[q] = items[q, :k].tolist() + [10_000 + q] * absent
    return scores, items, counts, truth


@pytest.mark.parametrize("ties", ["pessimistic", "official"])
def test_places_and_metrics_equal_brute_force_and_the_packages_loops(ties):
    rng = np.random.default_rng(0)
    for _ in range(200):
        scores, items, counts, truth = _case(rng)
        depth = int(max(counts.max(), 3))
        top = TopOfLists.of(QueryRows(scores), len(scores), scores.shape[1], depth)
        positive_scores = np.take_along_axis(scores, np.maximum(items, 0), 1)
        places = positive_positions(top, np.arange(len(scores)), items, positive_scores, ties,
                                    lambda q: np.argsort(scores[q])[::-1])
        lists = _lists(scores, items, ties)
        for q, order in enumerate(lists):
            where = {int(c): n for n, c in enumerate(order)}
            # within the top, the places of a query's positives (which tied positive is first is no matter)
            want = sorted(where[c] for c in items[q] if c >= 0 and where[c] < depth)
            assert sorted(p for p in places[q] if p < depth) == want
            assert all(p == NOT_RANKED for p in places[q] if p >= depth)
        retrieved = {q: order.tolist() for q, order in enumerate(lists)}
        reference = compute_eccv_metrics(retrieved, truth)
        ours = eccv_metrics(places, counts)
        assert (ours["map_at_r"], ours["rprecision"], ours["r1"]) == (
            reference["eccv_map_at_r"], reference["eccv_rprecision"], reference["eccv_r1"])
        for k in (1, 2, 3):
            assert recall_at(places, k) == compute_r_at_k(retrieved, truth, k)


def test_pessimistic_ties_count_against_the_query_official_ones_follow_argsort():
    # one query, gallery of 4: the positive (item 2) ties items 0 and 3 for the best score
    scores = np.array([[0.5, 0.1, 0.5, 0.5]])
    items = np.array([[2]])
    top = TopOfLists.of(QueryRows(scores), 1, 4, 4)
    pessimistic = positive_positions(top, np.array([0]), items, scores[:, [2]], "pessimistic")
    official = positive_positions(top, np.array([0]), items, scores[:, [2]], "official",
                                  lambda q: np.argsort(scores[q])[::-1])
    assert pessimistic.tolist() == [[2]]              # after both items it ties
    assert official.tolist() == [[list(np.argsort(scores[0])[::-1]).index(2)]]
    with pytest.raises(ValueError, match="ties must be one of"):
        positive_positions(top, np.array([0]), items, scores[:, [2]], "optimistic")


def test_the_top_keeps_every_item_tied_with_the_last_one_and_columns_read_as_rows():
    scores = np.array([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    top = TopOfLists.of(QueryRows(scores), 1, 6, 2)           # 2nd best is 2.0, which three items have
    assert top.threshold.tolist() == [2.0] and top.scores.tolist() == [3.0, 2.0, 2.0, 2.0]
    assert top.count(np.array([0]), np.array([2.0]), strict=False).tolist() == [4]
    assert top.count(np.array([0]), np.array([2.0]), strict=True).tolist() == [1]
    matrix = np.arange(600, dtype=float).reshape(300, 2) % 7    # taller than one transposed tile
    reader = QueryRows(matrix, columns=True)
    np.testing.assert_array_equal(reader(0, 2), matrix.T)
    first = reader(1, 2).copy()
    reader(0, 1)[:] = -1                                       # a scratch copy: the matrix is untouched
    np.testing.assert_array_equal(first, matrix.T[1:2])
    assert (matrix >= 0).all()
