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

* one-step models (VSE++, SCAN, SEAM, SMFEA): a float32 pass over the whole gallery, block by block with the
  model's own ``score`` (for pair-independent models that is the blockwise matrix product of their vectors;
  cross-attention models attend to every gallery item), then every candidate within :data:`RESCORE_MARGIN` of the
  k-th float32 score is rescored in float64 — the scores of eval's float64 matrix, and the top k in float64
  order;
* two-step models (a ``shortlist`` and a global stage: SMAN, JGCAR): eval's two-step rule — the global score
  shortlists ``shortlist`` candidates, ``pair_score`` re-ranks them, both in float64 as eval's default.

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
from retr.store.features import FeatureSet
from retr.store.vocab import Vocabulary, tokenize
from retr.trainers import checkpoint as ckpt
from retr.trainers.data import (ImageFeatures, SplitData, check_feature_contract, data_identity, load_split,
                                pad_tokens)
from retr.trainers.similarity import SplitEmbeddings, _concat, score_blocks
from retr.trainers.two_step import encode_all

#: float32 candidates within this much of the k-th float32 score are rescored in float64 (float32 scoring errors
#: of the models are below 1e-5 on cosine-scale scores; see ``bench/eval.py``'s refined mode)
RESCORE_MARGIN = 1e-3
CACHE_DIR = "search-cache"

Embeddings = dict[str, torch.Tensor]


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


def _slice(embeddings: Embeddings, index) -> Embeddings:
    return {k: v[index] for k, v in embeddings.items()}


def _cast(embeddings: Embeddings, dtype: torch.dtype) -> Embeddings:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in embeddings.items()}


class Retriever:
    """A trained model over one split's gallery; see the module docstring."""

    def __init__(self, model, vocab: Vocabulary, data: SplitData, gallery: dict, device: torch.device):
        self.model, self.vocab, self.data, self.device = model, vocab, data, device
        self.gallery = gallery
        self._wide = None

    # -- construction ------------------------------------------------------------------------------------
    @classmethod
    def from_run(cls, run: str | os.PathLike, features: str | None = None, manifest: str | None = None,
                 split: str = "test", checkpoint: str = "best", device: str = "auto", cache: bool = True,
                 trust_checkpoint: bool = False, quiet: bool = True) -> "Retriever":
        """The run's model (``checkpoint``: best, last or a file) over ``split`` of its feature set and
        manifest (or the ones given); the gallery's embeddings come from the run's cache when it matches."""
        dev = resolve_device(device)
        run = Path(run)
        model, vocab, config = ckpt.load_run_model(run, checkpoint, dev, trust=trust_checkpoint)
        features = features or config.get("features")
        manifest = manifest or config.get("manifest")
        if not features or not manifest:
            raise UserError(f"{run} does not record its features/manifest (imported run?); pass --features and "
                            "--manifest")
        feature_set = FeatureSet(features)
        check_feature_contract(feature_set, config["model_args"].get("img_dim"))
        data, _ = load_split(manifest, [split], vocab, feature_set, missing="error")
        key = hashlib.sha256(json.dumps({
            "checkpoint": sha256_file(_checkpoint_path(run, checkpoint)), "split": split,
            "data": data_identity(feature_set, manifest)}, sort_keys=True).encode()).hexdigest()[:20]
        path = run / CACHE_DIR / f"{split}-{key}.pt"
        gallery = _read_cache(path, dev) if cache else None
        if gallery is None:
            gallery = _encode_gallery(model, data, ImageFeatures(feature_set, data.image_ids), dev, quiet)
            if cache:
                _write_cache(path, gallery)
        return cls(model, vocab, data, gallery, dev)

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
            caption = _slice(queries, slice(q, q + 1))
            if self.two_step:
                rows, scores = self._two_step(images, caption, n, image_side=False)
            else:
                first = score_blocks(lambda im, cap: self.model.score(im, cap), images,
                                     [(np.array([0]), caption)], n, 1)[:, 0]
                rows = _candidates(first, k)
                scores = self._score64(_slice(images, torch.from_numpy(rows).to(self.device)), caption)[:, 0]
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
            image = _slice(self.gallery["images"], slice(row, row + 1))
            if self.two_step:
                cols, scores = self._two_step(image, self.gallery["captions"], self.data.num_captions,
                                              image_side=True)
            else:
                first = self._caption_pass(image)
                cols = _candidates(first, k)
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
            parts.append(_slice(self.gallery["caption_blocks"][block][1], slice(row, row + 1)))
        return _concat(parts)

    def _model64(self):
        if self._wide is None:
            self._wide = copy.deepcopy(self.model).to(torch.float64).eval()
        return self._wide

    def _score64(self, images: Embeddings, captions: Embeddings) -> np.ndarray:
        """float64 ``score`` ``[n_img, n_cap]`` with a float64 copy of the model (as eval's float64 pass)."""
        wide = _cast(images, torch.float64), _cast(captions, torch.float64)
        return self._model64().score(*wide, dtype=torch.float64).double().cpu().numpy()

    def _two_step(self, images: Embeddings, captions: Embeddings, n: int, image_side: bool):
        """Eval's two-step rule for one query: shortlist by ``global_score``, re-rank with ``pair_score``
        (float64, eval's default). Returns (candidate rows, their scores)."""
        images64, captions64 = _cast(images, torch.float64), _cast(captions, torch.float64)
        g = self.model.global_score(images64, captions64, dtype=torch.float64)
        g = g[0] if image_side else g[:, 0]
        cands = g.topk(min(self.model.shortlist, n)).indices
        zeros = torch.zeros_like(cands)
        img_idx, cap_idx = (zeros, cands) if image_side else (cands, zeros)
        scores = self.model.pair_score(images64, captions64, img_idx, cap_idx, dtype=torch.float64)
        return cands.cpu().numpy(), scores.double().cpu().numpy()


def _candidates(first: np.ndarray, k: int) -> np.ndarray:
    """Rows whose float32 score is within :data:`RESCORE_MARGIN` of the k-th best (at least the top k)."""
    k = min(k, first.size)
    kth = np.partition(first, first.size - k)[first.size - k]
    return np.flatnonzero(first >= kth - RESCORE_MARGIN)


def _best(scores: np.ndarray, rows: np.ndarray, k: int) -> np.ndarray:
    """Indices into ``scores`` of the ``k`` best, highest first; ties in gallery order."""
    return np.lexsort((rows, -scores))[:k]


def _checkpoint_path(run: Path, which: str) -> Path:
    if which == "best" and (run / ckpt.BEST).is_file():
        return run / ckpt.BEST
    if which in ("best", "last"):
        found = ckpt.list_checkpoints(run)
        if not found:
            raise UserError(f"{run} has no checkpoint")
        return found[-1][1]
    return run / which


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
