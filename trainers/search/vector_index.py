"""Maximum-inner-product search over item vectors ``[n, d]`` (cosine on l2-normalised vectors).

:class:`InnerProductIndex` is the one vector index of search, of three kinds:

* ``exact`` — faiss's ``IndexFlatIP`` where faiss-cpu is installed (the ``search`` extra), else blockwise float32
  matrix products with ``torch.topk``; top k identical to brute force, ties to the lower id;
* ``ivf`` — ``IndexIVFFlat``: k-means into ``nlist`` lists (trained on the first vectors given, at most
  :data:`IVF_TRAIN_POINTS_PER_LIST` per list), a query scans its ``nprobe`` nearest lists; refused in one line
  (:func:`ivf_size_error`) over fewer than :data:`IVF_MIN_POINTS_PER_LIST` vectors per list, which faiss's
  k-means cannot train (it would print its own ``WARNING clustering …`` and cluster badly);
* ``hnsw`` — ``IndexHNSWFlat``: a graph of ``m`` links per node, built with ``ef_construction``, searched with
  ``ef_search``.

Approximate kinds need faiss. :func:`index_recall` measures one against exact on given queries; the figures
(``bench/search.py``) are in ``docs/benchmarks.md``. ``save`` writes one file through a temporary name (faiss's
own format; the matmul fallback an ``.npz``, read without pickle), ``load`` reads either.
"""
from __future__ import annotations

import math
import os
import zipfile
from pathlib import Path

import numpy as np
import torch

from retr.common.atomic import atomic_file
from retr.common.errors import UserError
from retr.common.optional import MissingExtraError, require

#: float32 candidates within this much of the k-th float32 score are rescored in float64 by search (float32
#: scoring errors of the models are below 1e-5 on cosine-scale scores; see ``bench/eval.py``'s refined mode)
RESCORE_MARGIN = 1e-3
KINDS = ("exact", "ivf", "hnsw")
#: IVF training sample: at most this many vectors per list (faiss warns below 39; its default, 256, makes
#: training at 1M items take minutes on a few cores)
IVF_TRAIN_POINTS_PER_LIST = 64
#: faiss's k-means needs at least this many training vectors per list (its ``min_points_per_centroid``): an ivf
#: index of ``nlist`` lists is refused over fewer than ``nlist`` times as many vectors
IVF_MIN_POINTS_PER_LIST = 39


def _matrix(x) -> np.ndarray:
    """``x`` (tensor or array, ``[d]`` or ``[n, d]``) as a C-contiguous float32 ``[n, d]`` array."""
    if isinstance(x, torch.Tensor):
        x = x.detach().float().cpu().numpy()
    x = np.asarray(x, dtype=np.float32)
    return np.ascontiguousarray(x.reshape(1, -1) if x.ndim == 1 else x)


def default_nlist(n: int) -> int:
    """IVF lists for ``n`` vectors: √n, at most n/39 (faiss's minimum training points per list), at least 1."""
    return max(1, min(round(math.sqrt(n)), n // IVF_MIN_POINTS_PER_LIST))


def ivf_size_error(n: int, nlist: int | None = None, items: str = "vectors",
                   instead: str = "an exact index (as fast at this size)", parameters=()) -> UserError | None:
    """The one-line error for an ivf index of ``nlist`` lists (default :func:`default_nlist`) over ``n`` vectors
    that faiss's k-means cannot train — fewer than :data:`IVF_MIN_POINTS_PER_LIST` per list — or None when it can.
    ``items`` names the vectors, ``instead`` what to use; ``parameters``: those the message names (a command
    rewrites them as its flags)."""
    lists = nlist or default_nlist(n)
    needed = IVF_MIN_POINTS_PER_LIST * lists
    if n >= needed:
        return None
    return UserError(f"an ivf index of {lists} list{'s' * (lists != 1)} needs at least {needed} {items} to train on "
                     f"({IVF_MIN_POINTS_PER_LIST} per list), and there are {n}; use {instead}",
                     parameters=parameters)


class InnerProductIndex:
    """Search ``vectors`` ``[n, d]`` (with ``ids`` ``[n]`` int, default the rows) by inner product.

    ``kind`` and its settings: module docstring (``nlist`` default :func:`default_nlist` of the first vectors,
    ``nprobe`` 16, ``m`` 32, ``ef_construction`` 40, ``ef_search`` 64). ``use_faiss``: None uses faiss when
    installed, False never (exact only), True requires it. ``block``: rows per matrix product of the fallback.
    """

    def __init__(self, vectors, ids=None, use_faiss: bool | None = None, kind: str = "exact", *,
                 nlist: int | None = None, nprobe: int = 16, m: int = 32, ef_construction: int = 40,
                 ef_search: int = 64, block: int = 1 << 16):
        if kind not in KINDS:
            raise UserError(f"index kind must be one of {', '.join(KINDS)}, not {kind!r}")
        vectors = _matrix(vectors)
        self.kind, self.block, self.dim = kind, block, vectors.shape[1]
        faiss = None
        if use_faiss is False and kind != "exact":
            raise UserError(f"the {kind} index is faiss's: it cannot be built with use_faiss=False")
        if use_faiss is not False:
            try:
                faiss = require("faiss", "search", "use_faiss=True" if kind == "exact" else f"the {kind} index")
            except MissingExtraError:
                if use_faiss or kind != "exact":
                    raise
        self.backend = "faiss" if faiss is not None else "matmul"
        self._vectors, self._ids = np.zeros((0, self.dim), np.float32), np.zeros(0, np.int64)   # matmul backend
        if faiss is not None:
            if kind == "exact":
                inner = faiss.IndexFlatIP(self.dim)
            elif kind == "ivf":
                nlist = nlist or default_nlist(len(vectors))
                error = ivf_size_error(len(vectors), nlist)
                if error is not None:
                    raise error
                inner = faiss.IndexIVFFlat(faiss.IndexFlatIP(self.dim), self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
                inner.cp.max_points_per_centroid = IVF_TRAIN_POINTS_PER_LIST
                inner.train(vectors)
                inner.nprobe = min(nprobe, nlist)
            else:
                inner = faiss.IndexHNSWFlat(self.dim, m, faiss.METRIC_INNER_PRODUCT)
                inner.hnsw.efConstruction, inner.hnsw.efSearch = ef_construction, ef_search
            self.index = faiss.IndexIDMap(inner)
        self.add(vectors, ids)

    def _inner(self):
        """The faiss index inside the id map, as its own class."""
        return require("faiss", "search", "the index").downcast_index(self.index.index)

    @property
    def settings(self) -> dict:
        """The kind and the search settings in force (``nlist``/``nprobe``, ``m``/``ef_search``)."""
        out: dict = {"kind": self.kind, "backend": self.backend}
        if self.backend == "faiss" and self.kind != "exact":
            inner = self._inner()
            out.update({"nlist": inner.nlist, "nprobe": inner.nprobe} if self.kind == "ivf" else
                       {"m": inner.hnsw.nb_neighbors(1), "ef_search": inner.hnsw.efSearch})
        return out

    def tune(self, nprobe: int | None = None, ef_search: int | None = None) -> None:
        """Change the search breadth of an ``ivf`` (``nprobe``) or ``hnsw`` (``ef_search``) index in place."""
        if self.backend == "faiss" and self.kind != "exact":
            inner = self._inner()
            if self.kind == "ivf" and nprobe:
                inner.nprobe = min(nprobe, inner.nlist)
            elif self.kind == "hnsw" and ef_search:
                inner.hnsw.efSearch = ef_search

    def __len__(self) -> int:
        return self.index.ntotal if self.backend == "faiss" else len(self._ids)

    def add(self, vectors, ids=None) -> None:
        """Append ``vectors`` ``[n, d]`` with ``ids`` ``[n]`` (default: the next rows, ``len(self)`` onwards)."""
        vectors = _matrix(vectors)
        if vectors.shape[1] != self.dim:
            raise UserError(f"vectors of size {vectors.shape[1]} cannot join an index of size {self.dim}")
        ids = (np.arange(len(self), len(self) + len(vectors)) if ids is None else np.asarray(ids)).astype(np.int64)
        if ids.shape != (len(vectors),):
            raise UserError(f"{len(ids)} ids given for {len(vectors)} vectors")
        if self.backend == "faiss":
            self.index.add_with_ids(vectors, ids)
        else:
            self._vectors, self._ids = np.concatenate([self._vectors, vectors]), np.concatenate([self._ids, ids])

    def _raw(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) ``[Q, k]`` as the backend finds them (ties in any order; id -1: nothing found)."""
        if self.backend == "faiss":
            return self.index.search(queries, k)
        q = torch.from_numpy(queries)
        best = torch.empty(len(q), 0), torch.empty(len(q), 0, dtype=torch.long)
        for start in range(0, len(self), self.block):
            part = q @ torch.from_numpy(self._vectors[start:start + self.block]).t()
            scores = torch.cat([best[0], part], 1)
            rows = torch.cat([best[1], torch.arange(start, start + part.shape[1]).expand(len(q), -1)], 1)
            top = scores.topk(min(k, scores.shape[1]), dim=1)
            best = top.values, rows.gather(1, top.indices)
        return best[0].numpy(), self._ids[best[1].numpy()]

    def _within(self, query: np.ndarray, k: int, margin: float) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) of every item whose score is at least the k-th best minus ``margin``, for one query [1, d]."""
        wanted = min(len(self), k + 16)
        while k > 0:
            scores, ids = self._raw(query, wanted)
            kth = scores[0, k - 1]
            if wanted == len(self) or scores[0, -1] < kth - margin:
                keep = (scores[0] >= kth - margin) & (ids[0] >= 0)     # -1: an approximate index found less
                return scores[0, keep], ids[0, keep]
            wanted = min(len(self), 4 * wanted)
        return np.zeros(0, np.float32), np.zeros(0, np.int64)

    def search(self, queries, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores ``[Q, k]`` float32, ids ``[Q, k]`` int64) of the ``k`` best items for ``queries`` ``[Q, d]``
        (or ``[d]``), best first, equal scores in id order; k is at most ``len(self)``. ``exact`` settles a tie
        across the k-th place by id too; an approximate index may find fewer than k (id -1, score -inf)."""
        queries, k = _matrix(queries), min(k, len(self))
        if k == 0:
            return np.zeros((len(queries), 0), np.float32), np.zeros((len(queries), 0), np.int64)
        extra = int(self.kind == "exact" and k < len(self))
        scores, ids = self._raw(queries, k + extra)
        scores = np.where(ids < 0, -np.inf, scores).astype(np.float32)
        out_scores, out_ids = np.empty((len(queries), k), np.float32), np.empty((len(queries), k), np.int64)
        for q in range(len(queries)):
            s, i = scores[q], ids[q]
            if extra and s[k] == s[k - 1]:                 # a tie across the k-th place: every tied item
                s, i = self._within(queries[q:q + 1], k, 0.0)
            order = np.lexsort((i, -s))[:k]
            out_scores[q], out_ids[q] = s[order], i[order]
        return out_scores, out_ids

    def candidates(self, query, k: int) -> np.ndarray:
        """Sorted ids of every item within :data:`RESCORE_MARGIN` of the k-th best inner product with ``query``
        ``[1, d]`` or ``[d]``: a superset of the exact top k, which search rescores in float64."""
        return np.sort(self._within(_matrix(query), min(k, len(self)), RESCORE_MARGIN)[1])

    def save(self, path: str | os.PathLike) -> None:
        """Write the index to ``path`` through ``<path>.partial`` (faiss's format, or ``.npz`` for the fallback)."""
        with atomic_file(path) as partial:
            if self.backend == "faiss":
                require("faiss", "search", "the index").write_index(self.index, str(partial))
            else:
                with open(partial, "wb") as handle:
                    np.savez(handle, vectors=self._vectors, ids=self._ids)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "InnerProductIndex":
        """The index :meth:`save` wrote to ``path``."""
        path = Path(path)
        if not path.is_file():
            raise UserError(f"no index at {path}")
        if zipfile.is_zipfile(path):
            with np.load(path, allow_pickle=False) as saved:
                return cls(saved["vectors"], saved["ids"], use_faiss=False)
        faiss = require("faiss", "search", "reading a faiss index")
        try:
            index = faiss.read_index(str(path))
        except RuntimeError as exc:
            raise UserError(f"{path} is not an index retr wrote ({str(exc).strip().splitlines()[-1]})") from exc
        inner = faiss.downcast_index(index.index) if isinstance(index, faiss.IndexIDMap) else None
        kinds = {faiss.IndexFlatIP: "exact", faiss.IndexIVFFlat: "ivf", faiss.IndexHNSWFlat: "hnsw"}
        if type(inner) not in kinds or inner.metric_type != faiss.METRIC_INNER_PRODUCT:
            raise UserError(f"{path} is a faiss index of another kind than retr writes ({type(index).__name__})")
        self = cls.__new__(cls)
        self.kind, self.backend, self.block, self.dim, self.index = kinds[type(inner)], "faiss", 1 << 16, index.d, index
        return self


def recall_at_k(found: np.ndarray, truth: np.ndarray, k: int) -> float:
    """Mean over queries of |found top k ∩ true top k| / k, for id lists ``[Q, ≥k]`` best first (1: the same
    k items, in any order)."""
    return float(np.mean([len(set(f[:k].tolist()) & set(t[:k].tolist())) / k for f, t in zip(found, truth)]))


def index_recall(index: InnerProductIndex, exact: InnerProductIndex, queries, ks=(1, 5, 10)) -> dict[int, float]:
    """recall@k (:func:`recall_at_k`) of ``index`` against ``exact`` (an exact index of the same items) on
    ``queries`` ``[Q, d]``, for each k of ``ks``."""
    found, truth = index.search(queries, max(ks))[1], exact.search(queries, max(ks))[1]
    return {k: recall_at_k(found, truth, k) for k in ks}
