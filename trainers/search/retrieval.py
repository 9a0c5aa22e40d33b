"""Search a split's gallery with a trained run: text → images and image → texts (``retr-train search``).

::

    r = Retriever.from_run("runs/scan", split="test")            # the run's features and manifest by default
    r.text_to_images(["a dog jumps into a lake"], k=10)           # [SearchResult(query, hits, unknown_words)]
    r.image_to_texts(["coco_391895"], k=10)

**The gallery** (the split's images and captions) is encoded once and cached in the run directory,
``RUN/search-cache/<split>-<key>.pt``, where the key hashes the checkpoint file, the feature set's identity (ids
digest, shape, dtype, extraction attributes) and the manifest: a new checkpoint or other data encode anew. The
cache holds tensors only (read with ``weights_only``) and is written through a temporary name.

**Scores are eval's.** Every returned score is the one ``retr-train eval`` gives that pair:

* one-step models: a float32 first pass finds every candidate within :data:`RESCORE_MARGIN` of the k-th best,
  which is rescored in float64 — the scores of eval's float64 matrix, and the top k in float64 order. The first
  pass is an exact inner-product index (:class:`InnerProductIndex`: faiss's ``IndexFlatIP`` where faiss-cpu is
  installed, else blockwise matrix products) for models whose score is an inner product of pair-independent
  vectors (``MatchingModel.index_vectors``: VSE++, SMFEA's fused vector), and the model's own ``score`` over the
  whole gallery, block by block, for the others (SCAN's cross attention; SEAM, whose order-violation score is
  no inner product);
* two-step models (a ``shortlist`` and a global stage: SMAN, JGCAR): eval's two-step rule — the global score
  shortlists ``shortlist`` candidates, ``pair_score`` re-ranks them, both in float64 as eval's default. JGCAR's
  global stage is an inner product, so its shortlist comes from the index (every float32 candidate near the
  boundary rescored in float64); SMAN's (a sum of per-level cosines) is scored over the gallery.

A text query is tokenised and encoded with the run's vocabulary; words outside it are read as ``<unk>`` (as in
training) and reported in ``unknown_words``, never dropped silently.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from retr.common.devices import resolve_device
from retr.common.errors import UserError
from retr.common.hashing import sha256_file
from retr.common.optional import MissingExtraError, require
from retr.store.vocab import Vocabulary, tokenize
from retr.trainers.training import checkpoint as ckpt
from retr.trainers.training.data import ImageFeatures, SplitData, data_identity, open_run_split, pad_tokens
from retr.trainers.evaluation.similarity import SplitEmbeddings, _concat, score_blocks
from retr.trainers.evaluation.two_step import encode_all
from retr.trainers.models.base import Embeddings, cast_embeddings, slice_embeddings

#: float32 candidates within this much of the k-th float32 score are rescored in float64 (float32 scoring errors
#: of the models are below 1e-5 on cosine-scale scores; see ``bench/eval.py``'s refined mode)
RESCORE_MARGIN = 1e-3
CACHE_DIR = "search-cache"



@dataclass
class Hit:
    """One retrieved item: an image (``image_id``) or a caption (``caption``, its index in the split and the
    image it describes)."""

    rank: int
    score: float
    image_id: str
    caption: str | None = None
    caption_index: int | None = None


@dataclass
class SearchResult:
    query: str
    hits: list[Hit]
    unknown_words: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"query": self.query, "unknown_words": self.unknown_words,
                "hits": [{k: v for k, v in vars(h).items() if v is not None} for h in self.hits]}


class Retriever:
    """A trained model over one split's gallery; see the module docstring."""

    def __init__(self, model, vocab: Vocabulary, data: SplitData, gallery: dict, device: torch.device,
                 use_faiss: bool | None = None):
        self.model, self.vocab, self.data, self.device = model, vocab, data, device
        self.gallery = gallery
        self._wide = None
        with torch.no_grad():
            images = model.index_vectors(gallery["images"], "image")
            if "captions" in gallery:                       # two-step: every caption, manifest order
                captions, caption_ids = model.index_vectors(gallery["captions"], "caption"), None
            else:                                           # one-step: each source caption once
                captions, caption_ids = _caption_vectors(model, gallery)
        #: exact inner-product indexes over the gallery (None: the model's score is no inner product)
        self.image_index = InnerProductIndex(images, use_faiss=use_faiss) if images is not None else None
        self.caption_index = (InnerProductIndex(captions, caption_ids, use_faiss) if captions is not None
                              else None)

    # -- construction ------------------------------------------------------------------------------------
    @classmethod
    def from_run(cls, run: str | os.PathLike, features: str | None = None, manifest: str | None = None,
                 split: str = "test", checkpoint: str = "best", device: str = "auto", cache: bool = True,
                 trust_checkpoint: bool = False, quiet: bool = True, use_faiss: bool | None = None) -> "Retriever":
        """The run's model (``checkpoint``: best, last or a file) over ``split`` of its feature set and
        manifest (or the ones given); the gallery's embeddings come from the run's cache when it matches.
        ``use_faiss``: None uses faiss when installed, False never, True requires it."""
        dev = resolve_device(device)
        run = Path(run)
        opened = open_run_split(run, split, features, manifest, checkpoint, dev, trust_checkpoint)
        model, vocab, feature_set, data = opened.model, opened.vocab, opened.features, opened.data
        key = hashlib.sha256(json.dumps({
            "checkpoint": sha256_file(ckpt.resolve_checkpoint(run, checkpoint)), "split": split,
            "data": data_identity(feature_set, opened.manifest_path)}, sort_keys=True).encode()).hexdigest()[:20]
        path = run / CACHE_DIR / f"{split}-{key}.pt"
        gallery = _read_cache(path, dev) if cache else None
        if gallery is None:
            gallery = _encode_gallery(model, data, ImageFeatures(feature_set, data.image_ids), dev, quiet)
            if cache:
                _write_cache(path, gallery)
        return cls(model, vocab, data, gallery, dev, use_faiss)

    @property
    def two_step(self) -> bool:
        return bool(self.model.shortlist) and self.model.has_global_stage

    # -- queries -----------------------------------------------------------------------------------------
    def encode_texts(self, texts: Sequence[str]) -> tuple[Embeddings, list[list[str]]]:
        """Caption embeddings ``[Q, …]`` of ``texts`` and, per text, its words outside the vocabulary."""
        unknown = [[w for w in tokenize(t) if w not in self.vocab] for t in texts]
        tokens, lengths = pad_tokens([self.vocab.encode(t) for t in texts])
        with torch.no_grad():
            return self.model.encode_captions(tokens.to(self.device), lengths.to(self.device)), unknown

    @torch.no_grad()
    def text_to_images(self, texts: Sequence[str], k: int = 10) -> list[SearchResult]:
        """The ``k`` best images of the split for each text (scores as eval's)."""
        if not texts:
            return []
        queries, unknown = self.encode_texts(list(texts))
        images = self.gallery["images"]
        n = self.data.num_images
        results = []
        for q, text in enumerate(texts):
            caption = slice_embeddings(queries, slice(q, q + 1))
            vector = self.model.index_vectors(caption, "caption") if self.image_index is not None else None
            if self.two_step:
                rows, scores = self._two_step(images, caption, n, image_side=False, index=self.image_index,
                                              query=vector)
            else:
                if vector is not None:
                    rows = self.image_index.candidates(vector, k)
                else:
                    rows = _candidates(score_blocks(lambda im, cap: self.model.score(im, cap), images,
                                                    [(np.array([0]), caption)], n, 1)[:, 0], k)
                scores = self._score64(slice_embeddings(images, torch.from_numpy(rows).to(self.device)), caption)[:, 0]
            order = _best(scores, rows, k)
            results.append(SearchResult(text, [Hit(r + 1, float(scores[i]), self.data.image_ids[rows[i]])
                                               for r, i in enumerate(order)], unknown[q]))
        return results

    @torch.no_grad()
    def image_to_texts(self, image_ids: Sequence[str], k: int = 10) -> list[SearchResult]:
        """The ``k`` best captions of the split for each image id (scores as eval's)."""
        row_of = {image_id: i for i, image_id in enumerate(self.data.image_ids)}
        results = []
        for image_id in image_ids:
            if image_id not in row_of:
                raise UserError(f"image {image_id!r} is not in the gallery (split of {self.data.num_images} images)")
            row = row_of[image_id]
            image = slice_embeddings(self.gallery["images"], slice(row, row + 1))
            vector = self.model.index_vectors(image, "image") if self.caption_index is not None else None
            if self.two_step:
                cols, scores = self._two_step(image, self.gallery["captions"], self.data.num_captions,
                                              image_side=True, index=self.caption_index, query=vector)
            else:
                if vector is not None:      # the index holds each source caption once: expand to its copies
                    source = self.gallery["caption_source"]
                    cols = np.flatnonzero(np.isin(source, self.caption_index.candidates(vector, k)))
                else:
                    cols = _candidates(self._caption_pass(image), k)
                scores = self._score64(image, self._captions(cols))[0]
            order = _best(scores, cols, k)
            results.append(SearchResult(image_id, [
                Hit(r + 1, float(scores[i]), self.data.image_ids[self.data.caption_image[cols[i]]],
                    self.data.captions[cols[i]], int(cols[i])) for r, i in enumerate(order)]))
        return results

    # -- scoring -----------------------------------------------------------------------------------------
    def _caption_pass(self, image: Embeddings) -> np.ndarray:
        """float32 scores ``[M]`` of one image against every caption (identical captions share a column)."""
        blocks, source = self.gallery["caption_blocks"], self.gallery["caption_source"]
        sims = score_blocks(lambda im, cap: self.model.score(im, cap), image, blocks, 1, len(source))[0]
        return sims[source]

    def _captions(self, cols: np.ndarray) -> Embeddings:
        """The embeddings of captions ``cols`` (through their sources), padded to their longest."""
        source = self.gallery["caption_source"][cols]
        parts = []
        for c in source:
            block, row = self.gallery["where"][int(c)]
            parts.append(slice_embeddings(self.gallery["caption_blocks"][block][1], slice(row, row + 1)))
        return _concat(parts)

    def _model64(self):
        if self._wide is None:
            self._wide = copy.deepcopy(self.model).to(torch.float64).eval()
        return self._wide

    def _score64(self, images: Embeddings, captions: Embeddings) -> np.ndarray:
        """float64 ``score`` ``[n_img, n_cap]`` with a float64 copy of the model (as eval's float64 pass)."""
        wide = cast_embeddings(images, torch.float64), cast_embeddings(captions, torch.float64)
        return self._model64().score(*wide, dtype=torch.float64).double().cpu().numpy()

    def _two_step(self, images: Embeddings, captions: Embeddings, n: int, image_side: bool,
                  index: "InnerProductIndex | None" = None, query: torch.Tensor | None = None):
        """Eval's two-step rule for one query: shortlist by ``global_score`` (float64; with an ``index``, among
        the float32 index's candidates, which hold every item the float64 shortlist can), re-rank with
        ``pair_score`` (float64, eval's default). Returns (candidate rows, their scores)."""
        images64, captions64 = cast_embeddings(images, torch.float64), cast_embeddings(captions, torch.float64)
        shortlist = min(self.model.shortlist, n)
        pool = torch.arange(n, device=self.device)
        if index is not None and query is not None:
            pool = torch.from_numpy(index.candidates(query, shortlist)).to(self.device)
        if image_side:
            g = self.model.global_score(images64, slice_embeddings(captions64, pool), dtype=torch.float64)[0]
        else:
            g = self.model.global_score(slice_embeddings(images64, pool), captions64, dtype=torch.float64)[:, 0]
        cands = pool[_top_stable(g, shortlist)]
        zeros = torch.zeros_like(cands)
        img_idx, cap_idx = (zeros, cands) if image_side else (cands, zeros)
        scores = self.model.pair_score(images64, captions64, img_idx, cap_idx, dtype=torch.float64)
        return cands.cpu().numpy(), scores.double().cpu().numpy()


def _top_stable(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` highest ``scores``, ties to the lower position (as ``topk`` over the whole row)."""
    order = np.lexsort((np.arange(scores.numel()), -scores.double().cpu().numpy()))[:k]
    return torch.from_numpy(order).to(scores.device)


class InnerProductIndex:
    """Exact maximum-inner-product search over gallery vectors ``[n, d]``: faiss's ``IndexFlatIP`` where faiss
    is installed (the ``search`` extra), else blockwise float32 matrix products with ``torch.topk``.

    :meth:`candidates` returns the ids (``ids[row]``; default the row) of every row whose float32 inner product
    is within :data:`RESCORE_MARGIN` of the k-th best: a superset of the exact top k, which the caller rescores
    in float64.
    """

    def __init__(self, vectors: torch.Tensor, ids: np.ndarray | None = None, use_faiss: bool | None = None,
                 block: int = 1 << 16):
        self.vectors = np.ascontiguousarray(vectors.detach().float().cpu().numpy())
        self.ids = np.arange(self.vectors.shape[0]) if ids is None else np.asarray(ids)
        self.block = block
        faiss = None
        if use_faiss is not False:
            try:
                faiss = require("faiss", "search", "use_faiss=True")
            except MissingExtraError:
                if use_faiss:
                    raise
        self.backend = "faiss" if faiss is not None else "matmul"
        if faiss is not None:
            self.index = faiss.IndexFlatIP(self.vectors.shape[1])
            self.index.add(self.vectors)

    def __len__(self) -> int:
        return self.vectors.shape[0]

    def search(self, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores ``[k]``, rows ``[k]``) of the ``k`` largest inner products with ``query`` ``[d]``."""
        query = np.ascontiguousarray(query, dtype=np.float32).reshape(1, -1)
        if self.backend == "faiss":
            scores, rows = self.index.search(query, k)
            return scores[0], rows[0]
        q = torch.from_numpy(query[0])
        best_scores, best_rows = torch.empty(0), torch.empty(0, dtype=torch.long)
        for start in range(0, len(self), self.block):
            part = torch.from_numpy(self.vectors[start:start + self.block]) @ q
            scores = torch.cat([best_scores, part])
            rows = torch.cat([best_rows, torch.arange(start, start + part.numel())])
            top = scores.topk(min(k, scores.numel()))
            best_scores, best_rows = top.values, rows[top.indices]
        return best_scores.numpy(), best_rows.numpy()

    def candidates(self, query: torch.Tensor, k: int) -> np.ndarray:
        """Rows within :data:`RESCORE_MARGIN` of the k-th best inner product with ``query`` ``[1, d]`` or ``[d]``."""
        query = query.detach().float().cpu().numpy().reshape(-1)
        k = min(k, len(self))
        wanted = min(len(self), k + 16)
        while True:
            scores, rows = self.search(query, wanted)
            kth = scores[k - 1]
            if wanted == len(self) or scores[-1] < kth - RESCORE_MARGIN:
                return np.sort(self.ids[rows[scores >= kth - RESCORE_MARGIN]])
            wanted = min(len(self), 4 * wanted)


def _caption_vectors(model, gallery: dict) -> tuple[torch.Tensor | None, np.ndarray | None]:
    """``index_vectors`` of the gallery's source captions ``[S, d]`` and their caption ids ``[S]`` (None, None:
    the model has no such vectors)."""
    ids, parts = [], []
    for idx, emb in gallery["caption_blocks"]:
        vectors = model.index_vectors(emb, "caption")
        if vectors is None:
            return None, None
        ids.append(np.asarray(idx))
        parts.append(vectors)
    if not parts:
        return None, None
    return torch.cat(parts), np.concatenate(ids)


def _candidates(first: np.ndarray, k: int) -> np.ndarray:
    """Rows whose float32 score is within :data:`RESCORE_MARGIN` of the k-th best (at least the top k)."""
    k = min(k, first.size)
    kth = np.partition(first, first.size - k)[first.size - k]
    return np.flatnonzero(first >= kth - RESCORE_MARGIN)


def _best(scores: np.ndarray, rows: np.ndarray, k: int) -> np.ndarray:
    """Indices into ``scores`` of the ``k`` best, highest first; ties in gallery order."""
    return np.lexsort((rows, -scores))[:k]


# ------------------------------------------------------------------------------------------------ gallery

def _encode_gallery(model, data: SplitData, features: ImageFeatures, device: torch.device, quiet: bool) -> dict:
    """What a search needs of the split, as tensors: images ``{…}`` [N, …]; caption blocks (each source caption
    once, length-sorted) with the source map; for two-step models every caption in manifest order."""
    with torch.no_grad():
        split = SplitEmbeddings.encode(model, data, features, device, quiet=quiet)
        gallery = {"images": split.images, "caption_blocks": split.caption_blocks,
                   "caption_source": split.sources}
        if model.shortlist and model.has_global_stage:
            gallery["images"], gallery["captions"] = encode_all(model, data, features, device,
                                                                dtype=torch.float32, quiet=quiet)
    return _index(gallery)


def _index(gallery: dict) -> dict:
    """Add ``where``: source caption → (block, row)."""
    where = {}
    for b, (idx, _) in enumerate(gallery["caption_blocks"]):
        for r, c in enumerate(np.asarray(idx).tolist()):
            where[c] = (b, r)
    gallery["where"] = where
    return gallery


def _write_cache(path: Path, gallery: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"images": {k: v.cpu() for k, v in gallery["images"].items()},
             "captions": {k: v.cpu() for k, v in gallery.get("captions", {}).items()},
             "caption_blocks": [(torch.as_tensor(np.asarray(idx)), {k: v.cpu() for k, v in emb.items()})
                                for idx, emb in gallery["caption_blocks"]],
             "caption_source": torch.as_tensor(np.asarray(gallery["caption_source"]))}
    tmp = path.with_name(path.name + ".partial")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _read_cache(path: Path, device: torch.device) -> dict | None:
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location=device, weights_only=True)
        gallery = {"images": state["images"],
                   "caption_blocks": [(idx.cpu().numpy(), emb) for idx, emb in state["caption_blocks"]],
                   "caption_source": state["caption_source"].cpu().numpy()}
        if state["captions"]:
            gallery["captions"] = state["captions"]
    except Exception:            # a damaged or foreign cache file is made again, never trusted
        return None
    return _index(gallery)
