"""Two-stage search for models whose score needs both sides at once (SCAN's cross attention, SEAM's order
violation, SMAN's multi-modal step), where scoring the whole gallery costs one ``score`` per item and query.

Stage one shortlists ``shortlist`` gallery items by the inner product of cheap pair-independent vectors
(:func:`shortlist_vectors`, through :class:`~retr.trainers.search.vector_index.InnerProductIndex`, exact or
approximate); stage two scores only those with the model's own ``score`` and ranks them. With a shortlist as
large as the gallery it is the exhaustive ranking; how much a smaller one keeps of the exhaustive top k is
:meth:`TwoStageSearch.recall` (``bench/two_stage_recall.py``; the figures per model are in
``docs/models-scan.md`` and ``docs/models-seam-sman.md``). The exhaustive pass stays search's default.

The shortlist vectors, per model (the model's ``index_vectors`` where it has them: VSE++, SMFEA, JGCAR):

* ``scan`` — the l2-normalised mean of an image's (masked) region vectors and of a caption's word vectors: the
  cosine of the two means, the attention-free summary of what cross attention compares;
* ``seam`` — the image and caption vectors themselves (unit, non-negative): their cosine bounds the order
  violation, ``‖max(0, c − i)‖² ≤ ‖c − i‖² = 2 − 2 c·i``;
* ``sman`` — ``[v0/‖v0‖, v1/‖v1‖]`` and ``[t0/‖t0‖, t1/‖t1‖]``: the inner product is SMAN's ``global_score``
  (cos(v0, t0) + cos(v1, t1)), the stage its two-step evaluation shortlists by.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from retr.common.errors import UserError
from retr.trainers.models.base import Embeddings, slice_embeddings
from retr.trainers.models.layers import l2norm, masked_mean
from retr.trainers.search.vector_index import InnerProductIndex, recall_at_k

SIDES = ("image", "caption")


def _scan(e: Embeddings, side: str) -> torch.Tensor:
    return l2norm(masked_mean(e["regions"] if side == "image" else e["words"], e["mask"].bool()))


def _sman(e: Embeddings, side: str) -> torch.Tensor:
    a, b = ("v0", "v1") if side == "image" else ("t0", "t1")
    return torch.cat([l2norm(e[a]), l2norm(e[b])], -1)


#: model name → ``(embeddings, side) -> [n, d]`` shortlist vectors (module docstring)
SHORTLIST_VECTORS: dict[str, Callable[[Embeddings, str], torch.Tensor]] = {
    "scan": _scan, "seam": lambda e, side: e["vector"], "sman": _sman}


def shortlist_vectors(model, embeddings: Embeddings, side: str) -> torch.Tensor:
    """Pair-independent vectors ``[n, d]`` of encoder outputs ``embeddings`` of ``side`` (``"image"`` or
    ``"caption"``) whose inner products shortlist for ``model`` (module docstring)."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {', '.join(SIDES)}, not {side!r}")
    vectors = model.index_vectors(embeddings, side)
    if vectors is None:
        if model.name not in SHORTLIST_VECTORS:
            raise UserError(f"model {model.name or type(model).__name__} has no shortlist vectors for two-stage search "
                            f"(models with them: {', '.join(sorted(SHORTLIST_VECTORS))} and inner-product models)")
        vectors = SHORTLIST_VECTORS[model.name](embeddings, side)
    return vectors.detach().float()


class TwoStageSearch:
    """A gallery of one ``side`` (``"image"``: images searched by captions; ``"caption"``: the reverse), encoder
    outputs ``gallery`` ``{…}`` ``[N, …]``, searched by queries of the other side.

    ``shortlist``: items scored per query; ``kind`` and ``index_options``: the index of the shortlist vectors
    (:class:`~retr.trainers.search.vector_index.InnerProductIndex`); ``dtype``: the scoring arithmetic's (None:
    the embeddings'). ``block``: gallery items per ``score`` call of :meth:`exhaustive`.
    """

    def __init__(self, model, gallery: Embeddings, side: str, shortlist: int = 100, kind: str = "exact",
                 dtype: torch.dtype | None = None, block: int = 256, **index_options):
        if shortlist < 1:
            raise UserError(f"the shortlist must hold at least 1 item, not {shortlist}")
        self.model, self.gallery, self.side, self.shortlist = model, gallery, side, int(shortlist)
        self.dtype, self.block = dtype, block
        with torch.no_grad():
            self.index = InnerProductIndex(shortlist_vectors(model, gallery, side), kind=kind, **index_options)
        self.query_side = SIDES[1 - SIDES.index(side)]

    def _score(self, rows, queries: Embeddings) -> torch.Tensor:
        """``score`` of gallery ``rows`` × ``queries`` → ``[Q, len(rows)]``."""
        items = slice_embeddings(self.gallery, rows)
        if self.side == "image":
            return self.model.score(items, queries, dtype=self.dtype).t()
        return self.model.score(queries, items, dtype=self.dtype)

    @torch.no_grad()
    def search(self, queries: Embeddings, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores ``[Q, k]``, gallery rows ``[Q, k]``) for ``queries`` ``[Q, …]``: the shortlist's best ``k`` by
        ``score``, equal scores in row order (k is at most the shortlist)."""
        k = min(k, self.shortlist, len(self.index))
        _, shortlists = self.index.search(shortlist_vectors(self.model, queries, self.query_side), self.shortlist)
        scores, rows = np.empty((len(shortlists), k)), np.empty((len(shortlists), k), np.int64)
        for q, found in enumerate(shortlists):
            found = np.sort(found[found >= 0])
            s = self._score(torch.from_numpy(found), slice_embeddings(queries, slice(q, q + 1)))[0]
            s = s.double().cpu().numpy()
            order = np.lexsort((found, -s))[:k]
            scores[q, :len(order)], rows[q, :len(order)] = s[order], found[order]
            scores[q, len(order):], rows[q, len(order):] = -np.inf, -1     # an approximate index found < k
        return scores, rows

    @torch.no_grad()
    def exhaustive(self, queries: Embeddings, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores ``[Q, k]``, rows ``[Q, k]``) of the ``k`` best of the whole gallery by ``score``, equal scores in
        row order: what :meth:`search` approximates."""
        n = len(self.index)
        s = torch.cat([self._score(slice(b, b + self.block), queries) for b in range(0, n, self.block)], 1)
        s = s.double().cpu().numpy()
        rows = np.argsort(-s, axis=1, kind="stable")[:, :min(k, n)]
        return np.take_along_axis(s, rows, 1), rows

    def recall(self, queries: Embeddings, ks=(1, 5, 10)) -> dict[int, float]:
        """recall@k (:func:`~retr.trainers.search.vector_index.recall_at_k`) of :meth:`search` against
        :meth:`exhaustive` on ``queries``, for each k of ``ks``."""
        found, truth = self.search(queries, max(ks))[1], self.exhaustive(queries, max(ks))[1]
        return {k: recall_at_k(found, truth, k) for k in ks}
