"""Where each query's positives land in its ranked list, and the metrics ECCV Caption's evaluator computes from
those places (R@K, R-Precision, mAP@R), for every query of a similarity matrix at once.

A query's ranked list is its gallery sorted by score, best first. Ties are ordered by a rule (``ties``, as
``retr-train eval --ties``): ``pessimistic`` puts the query's positives after every other item of equal score (a
tie counts against the query); ``official`` takes the order of ``np.argsort(scores)[::-1]``, as the authors'
evaluation code ranks (docs/evaluation.md).

No metric here reads past position ``depth`` of a list (R@K: the first K; R-Precision and mAP@R: the first R, R a
query's number of positives), so no list is sorted: :class:`TopOfLists` keeps, per query, every item scoring at
least the query's ``depth``-th best score (a partial sort of each block of rows), and a positive's place comes from
counting those above it. A positive below that score is beyond ``depth`` and gets :data:`NOT_RANKED`. Only under
``official`` ties, a query whose positive ties another item within the top needs its whole order: that row is
argsorted as the authors do (matrices with exact ties only).

Every mean is taken as the package takes it (``np.mean`` of the per-query values, in its order; a query's mAP@R the
``np.mean`` of its R precisions), so the numbers are its own to the last bit (tests/test_coco_extended.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

#: the position given to a positive that lies beyond its list's ``depth`` (or is not in the gallery at all)
NOT_RANKED = np.iinfo(np.int64).max // 4
TIE_RULES = ("pessimistic", "official")
#: elements of one block of rows read at a time (a partial sort works on a copy of the block)
BLOCK_ELEMENTS = 1 << 20
#: rows of a matrix transposed at a time when its columns are read as rows (:class:`QueryRows`)
TRANSPOSE_TILE = 256

#: ``read_rows(start, stop)`` → the scores ``[stop - start, G]`` of queries ``start:stop`` against the gallery, an
#: array the reader lets the caller overwrite (:class:`QueryRows`)
RowReader = Callable[[int, int], np.ndarray]
#: ``ranked_order(query)`` → ``[G]`` gallery indices of that query's list under ``official`` ties, best first
OrderReader = Callable[[int], np.ndarray]


class QueryRows:
    """The queries ``a:b`` of ``matrix`` [N, M] as rows: its rows (i2t), or with ``columns`` its columns ``[b - a, N]``
    (t2i, transposed :data:`TRANSPOSE_TILE` rows at a time: measured 4× faster than one strided copy). Each call
    returns a scratch copy the caller may overwrite, valid until the next call (one buffer, reused: a fresh
    allocation per block costs its page faults again)."""

    def __init__(self, matrix: np.ndarray, columns: bool = False):
        self.matrix, self.columns = matrix, columns
        self.width = matrix.shape[0] if columns else matrix.shape[1]
        self._buffer: np.ndarray | None = None

    def __call__(self, a: int, b: int) -> np.ndarray:
        if self._buffer is None or len(self._buffer) < b - a:
            self._buffer = np.empty((b - a, self.width), dtype=self.matrix.dtype)
        out = self._buffer[:b - a]
        if not self.columns:
            np.copyto(out, self.matrix[a:b])
            return out
        for r in range(0, self.matrix.shape[0], TRANSPOSE_TILE):
            out[:, r:r + TRANSPOSE_TILE] = self.matrix[r:r + TRANSPOSE_TILE, a:b].T
        return out


@dataclass(frozen=True)
class TopOfLists:
    """The top of every query's ranked list: each query's items scoring at least its ``depth``-th best score
    (more than ``depth`` where scores tie), their scores best first, all queries' concatenated.

    ``threshold`` [Q]: each query's ``depth``-th best score; ``scores`` [C]: the kept scores, query by query, each
    query's in descending order; ``offsets`` [Q + 1]: where each query's start in ``scores``."""

    threshold: np.ndarray
    scores: np.ndarray
    offsets: np.ndarray
    depth: int
    gallery: int

    @classmethod
    def of(cls, read_rows: RowReader, num_queries: int, gallery: int, depth: int) -> "TopOfLists":
        """The top ``depth`` (at least) of the lists of ``num_queries`` queries over a gallery of ``gallery`` items,
        read ``BLOCK_ELEMENTS`` scores at a time through ``read_rows``."""
        depth = int(min(max(depth, 1), gallery))
        block = max(1, BLOCK_ELEMENTS // max(gallery, 1))
        cut = gallery - depth
        thresholds, kept, counts = [], [], []
        for start in range(0, num_queries, block):
            part = read_rows(start, min(start + block, num_queries))
            part.partition(cut, axis=1)                   # in place: the reader's scratch copy
            threshold = part[:, cut].copy()            # part is the reader's buffer, reused
            # part[:, cut:] holds the top depth (each ≥ threshold), part[:, :cut] the rest (each ≤ threshold):
            # items of the rest equal to the threshold tie with the last kept one, and are kept too
            ties = np.count_nonzero(part[:, :cut] == threshold[:, None], axis=1)
            top = -np.sort(-part[:, cut:], axis=1)
            width = depth + ties
            rows = np.full((len(part), depth + int(ties.max(initial=0))), np.nan)
            rows[:, :depth] = top
            rows[:, depth:] = threshold[:, None]
            kept.append(rows[np.arange(rows.shape[1])[None, :] < width[:, None]])
            thresholds.append(threshold)
            counts.append(width)
        counts = np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
        offsets = np.zeros(num_queries + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        empty = np.zeros(0)
        return cls(np.concatenate(thresholds) if thresholds else empty, np.concatenate(kept) if kept else empty,
                   offsets, depth, int(gallery))

    def count(self, queries: np.ndarray, values: np.ndarray, strict: bool) -> np.ndarray:
        """How many kept items of each query in ``queries`` score ``>= values`` (``> values`` if ``strict``); exact
        for a value at or above the query's threshold. ``queries`` and ``values`` broadcast together."""
        queries, values = np.broadcast_arrays(np.asarray(queries, dtype=np.int64), np.asarray(values))
        lo, hi = self.offsets[queries], self.offsets[queries + 1]
        start = lo.copy()
        last = max(len(self.scores) - 1, 0)
        while True:                                       # binary search in each query's descending scores
            active = lo < hi
            if not active.any():
                break
            mid = (lo + hi) // 2
            score = self.scores[np.minimum(mid, last)]
            inside = (score > values) if strict else (score >= values)
            lo = np.where(active & inside, mid + 1, lo)
            hi = np.where(active & ~inside, mid, hi)
        return lo - start


def positive_positions(top: TopOfLists, queries: np.ndarray, items: np.ndarray, scores: np.ndarray,
                       ties: str, ranked_order: OrderReader | None = None) -> np.ndarray:
    """``[Q, P]`` int64: the 0-based place of each positive in its query's ranked list, :data:`NOT_RANKED` where
    it lies beyond ``top.depth`` or is padding.

    ``queries`` [Q]: each query's row of ``top``; ``items`` [Q, P]: its positives' gallery indices (−1: padding, or
    a positive that is not in the gallery); ``scores`` [Q, P]: their scores; ``ranked_order``: the whole order of a
    query, needed under ``official`` ties where a positive ties another item (see the module's docstring)."""
    if ties not in TIE_RULES:
        raise ValueError(f"ties must be one of {', '.join(TIE_RULES)}, not {ties!r}")
    queries = np.asarray(queries, dtype=np.int64)
    items = np.asarray(items, dtype=np.int64)
    valid = items >= 0
    scores = np.where(valid, scores, -np.inf)
    in_top = valid & (scores >= top.threshold[queries][:, None])
    at_least = top.count(queries[:, None], scores, strict=False)
    if ties == "pessimistic":
        # every other item scoring at least as high comes first, then the positives tied with this one and
        # listed before it: place = (#items ≥ s) − (#positives tied with it, itself and those listed after it)
        slot = np.arange(items.shape[1])
        tied_after = ((scores[:, None, :] == scores[:, :, None]) & valid[:, None, :]
                      & (slot[None, None, :] >= slot[None, :, None])).sum(axis=2)
        places = at_least - tied_after
    else:
        above = top.count(queries[:, None], scores, strict=True)
        places = above.copy()
        tied = in_top & (at_least - above > 1) & (above < top.depth)
        for q in np.flatnonzero(tied.any(axis=1)):
            if ranked_order is None:
                raise ValueError("official ties need ranked_order where a positive ties another item")
            order = np.asarray(ranked_order(int(queries[q])))
            place = np.empty(top.gallery, dtype=np.int64)
            place[order] = np.arange(top.gallery)
            places[q] = np.where(valid[q], place[np.maximum(items[q], 0)], NOT_RANKED)
    return np.where(in_top & (places < top.depth), places, NOT_RANKED)


def recall_at(places: np.ndarray, k: int) -> float:
    """R@k as a fraction: the mean over queries (in order) of whether a positive is among the first ``k``."""
    return float(np.mean((np.asarray(places) < k).any(axis=1).astype(np.int64)))


def eccv_metrics(places: np.ndarray, counts: np.ndarray) -> dict[str, float]:
    """``{"map_at_r", "rprecision", "r1"}`` as fractions, as ``eccv_caption``'s ``compute_eccv_metrics`` computes
    them: R = a query's number of positives (``counts`` [Q], those absent from the gallery included);
    precision@r = 1 − (r − hits in the first r)/r; R-Precision = precision@R; mAP@R = the mean over r = 1…R of
    precision@r where the item at place r is a positive, else 0; R@1 = whether the first item is a positive."""
    places = np.asarray(places, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    queries = len(counts)
    longest = int(counts.max()) if queries else 0
    hit = np.zeros((queries, longest + 1), dtype=bool)
    q, p = np.nonzero(places < counts[:, None])
    hit[q, places[q, p]] = True
    hit = hit[:, :longest]
    r = np.arange(1, longest + 1, dtype=np.int64)
    precision = 1 - (r[None, :] - np.cumsum(hit, axis=1)) / r[None, :]      # the package's 1 − misses/r
    values = np.where(hit, precision, 0.0)
    map_at_r = np.empty(queries)
    for size in np.unique(counts):                   # np.mean of R values, R at a time: the package's summation
        rows = np.flatnonzero(counts == size)
        map_at_r[rows] = np.add.reduce(np.ascontiguousarray(values[rows, :size]), axis=1) / size
    rprecision = precision[np.arange(queries), counts - 1]
    r1 = (places < 1).any(axis=1).astype(np.int64)
    return {"map_at_r": float(np.mean(map_at_r)), "rprecision": float(np.mean(rprecision)),
            "r1": float(np.mean(r1))}
