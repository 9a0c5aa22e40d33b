"""Search a split's gallery with a trained run: text → images and image → texts (``retr-train search``).

::

    r = Retriever.from_run("runs/scan", split="test")            # the run's features and manifest by default
    r.text_to_images(["a dog jumps into a lake"], k=10)           # [SearchResult(query, hits, unknown_words)]
    r.image_to_texts(["coco_391895"], k=10)

**The gallery** (the split's images and captions) is encoded once and cached in the run directory,
``RUN/search-cache/<split>-<key>.pt`` (an export's, and a run folder's that takes no files, in
``$RETR_CACHE/search/``: :func:`search_caches`), where the key hashes the checkpoint file, the feature set's identity
(ids digest, shape, dtype, extraction attributes) and the manifest: a new checkpoint or other data encode anew. The
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
training) and reported in ``unknown_words``, never dropped silently. An empty query (no words) is refused.

**Refused or noted** (``docs/search.md``): an approximate ``vector_index`` (``ivf``, ``hnsw``) where the gallery has
no inner-product index to approximate (a model whose score is no inner product, without ``shortlist``), and an
``ivf`` index over too few images to train, are refused in one line before the gallery is encoded; a
``shortlist`` the model does not use, and one shorter than the ``k`` results asked for (then ``k`` are
shortlisted), are ``note:`` lines on the ``retr`` logger, once each.
"""
from __future__ import annotations

import atexit
import copy
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from retr.common.atomic import atomic_file
from retr.common.cache import cache_folder
from retr.common.devices import resolve_device
from retr.common.errors import UserError
from retr.common.paths import write_problem
from retr.common.hashing import sha256_file
from retr.store.vocab import tokenize
from retr.store.vocabularies import CaptionVocabulary
from retr.trainers.runs import checkpoint as ckpt
from retr.trainers.data.splits import ImageFeatures, SplitData, pad_tokens
from retr.trainers.runs.hub import in_hub_cache, local_run
from retr.trainers.runs.resume import data_identity
from retr.trainers.runs.split import open_run_split
from retr.trainers.evaluation.similarity import SplitEmbeddings, _concat, score_blocks
from retr.trainers.evaluation.two_step import encode_all
from retr.trainers.models.base import Embeddings, MatchingModel, cast_embeddings, slice_embeddings
from retr.store.features import FeatureSet
from retr.trainers.search.images import FeatureMaker, ImageInput, describe, list_folder, no_images_error
from retr.trainers.search.index import SHARD_SIZE, AddSummary, GalleryIndex, index_identity
from retr.trainers.search.two_stage import shortlist_vectors
from retr.trainers.search.vector_index import RESCORE_MARGIN, InnerProductIndex, ivf_size_error
from retr.trainers.models import get_spec

CACHE_DIR = "search-cache"
logger = logging.getLogger(__name__)


def query_error(text: str) -> UserError | None:
    """The one-line error for a text query with no words (empty, or only spaces), else None."""
    if not tokenize(text):
        return UserError(f"the query {text!r} has no words: give a sentence describing the images")
    return None


def scores_by_inner_product(model_class: type) -> bool:
    """Whether ``model_class``'s gallery vectors are searched by inner product (it defines ``index_vectors``:
    VSE++, SMFEA, VSE∞, JGCAR's global stage), read from the class without building a model."""
    return getattr(model_class, "index_vectors", None) is not MatchingModel.index_vectors


def vector_index_error(model_name: str, inner_product: bool, shortlist: int | None,
                       vector_index: str) -> UserError | None:
    """The one-line error for an approximate ``vector_index`` that would go unused: the model's score is no inner
    product and no ``shortlist`` makes one (two-stage search's stage one), so every item is scored; else None."""
    if vector_index == "exact" or inner_product or shortlist:
        return None
    return UserError(f"vector_index {vector_index} approximates an inner-product search, and {model_name}'s score "
                     f"is no inner product, so every item is scored and no index is used; add shortlist N to search in "
                     f"two stages with {vector_index} as stage one, or leave vector_index exact",
                     parameters=("vector_index", "shortlist"))


def run_index_identity(run: str | os.PathLike, checkpoint: str = "best", features: str | None = None,
                       checkpoint_sha256: str | None = None) -> dict | None:
    """What a gallery index built with ``run``'s ``checkpoint`` records (:func:`index_identity`), read from the run's
    files without loading the model (None: the run records no feature set; opening it says so)."""
    config = ckpt.read_config(run)
    features = features or config.get("features")
    if not features:
        return None
    sha = checkpoint_sha256 or sha256_file(ckpt.resolve_checkpoint(run, checkpoint))
    return index_identity(Path(run), sha, config["model"], FeatureSet(features))



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


def search_caches(run: Path, checkpoint_sha256: str) -> Path:
    """Where a search keeps its caches: ``RUN/search-cache/`` of a run whose folder takes files; for an export
    (shared as made: nothing is written into one, local or in the Hugging Face cache) or a run folder that takes no
    files, ``$RETR_CACHE/search/<checkpoint sha256>/`` (:mod:`retr.common.cache`); where that takes none either, a
    folder of this process, removed when it ends."""
    if not ckpt.is_export(run) and not in_hub_cache(run) and write_problem(run) is None:
        return run / CACHE_DIR
    folder = cache_folder("search") / checkpoint_sha256[:32]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if write_problem(folder) is None:
            return folder
    except OSError:
        pass
    folder = Path(tempfile.mkdtemp(prefix="retr-search-cache-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


class Retriever:
    """A trained model over one split's gallery; see the module docstring."""

    def __init__(self, model, vocab: CaptionVocabulary, data: SplitData, gallery: dict, device: torch.device,
                 use_faiss: bool | None = None, vector_index: str = "exact", shortlist: int | None = None):
        self.model, self.vocab, self.data, self.device = model, vocab, data, device
        self.gallery, self.use_faiss, self.vector_index = gallery, use_faiss, vector_index
        if shortlist is not None and shortlist < 1:
            raise UserError(f"the shortlist must hold at least 1 item, not {shortlist}")
        #: two-stage search (``docs/search.md``): a model whose score is no inner product scores only the
        #: ``shortlist`` best items by its pair-independent shortlist vectors (None: the whole gallery)
        self.shortlist = shortlist
        with torch.no_grad():
            self._inner_product = model.index_vectors(slice_embeddings(gallery["images"], slice(0, 1)),
                                                      "image") is not None
        name = getattr(model, "name", None) or type(model).__name__
        error = vector_index_error(name, self._inner_product, shortlist, vector_index)
        if error is not None:
            raise error
        self._noted: set[str] = set()
        if shortlist and self.two_step:
            self._note(f"{name} ranks in two steps with the run's own shortlist ({model.shortlist} per query), so the "
                       f"shortlist of {shortlist} does not change its results")
        elif shortlist and self._inner_product:
            self._note(f"{name}'s score is an inner product, whose exact top k the vector index finds: the shortlist "
                       f"of {shortlist} is not used")
        self._vectors = ((lambda e, side: shortlist_vectors(model, e, side)) if shortlist else model.index_vectors)
        self._wide = self._maker = None
        #: set by :meth:`from_run`: the run, its checkpoint's sha256, the feature set (raw images and indexes)
        self.run = self.checkpoint_sha256 = self.feature_set = None
        self.extractor_options: dict = {}
        with torch.no_grad():
            if "captions" in gallery:                       # two-step: every caption, manifest order
                captions, caption_ids = self._vectors(gallery["captions"], "caption"), None
            else:                                           # one-step: each source caption once
                captions, caption_ids = _caption_vectors(self._vectors, gallery)
        self.caption_index = (InnerProductIndex(captions, caption_ids, use_faiss) if captions is not None
                              else None)
        self._set_images(list(data.image_ids), gallery["images"])

    def _note(self, text: str) -> None:
        """Log ``note: text`` on the ``retr`` logger, once per retriever."""
        if text not in self._noted:
            self._noted.add(text)
            logger.warning(f"note: {text}")

    def _set_images(self, image_ids: list[str], images: Embeddings) -> None:
        """The gallery ``text_to_images`` searches: the split's images, or an index's."""
        if self.shortlist or self._inner_product:                   # an inner-product index will be built
            if self.vector_index == "ivf":
                _check_ivf(len(image_ids))
        self.image_ids, self.images = image_ids, images
        with torch.no_grad():
            vectors = self._vectors(images, "image")
        #: inner-product index over the gallery images (None: the model's score is no inner product)
        self.image_index = (InnerProductIndex(vectors, use_faiss=self.use_faiss, kind=self.vector_index)
                            if vectors is not None else None)

    # -- construction ------------------------------------------------------------------------------------
    @classmethod
    def from_run(cls, run: str | os.PathLike, features: str | None = None, manifest: str | None = None,
                 split: str = "test", checkpoint: str = "best", device: str = "auto", cache: bool = True,
                 trust_checkpoint: bool = False, quiet: bool = True, use_faiss: bool | None = None,
                 index: str | os.PathLike | None = None, images: str | os.PathLike | None = None,
                 extractor_weights: str | None = None, batch_size: int = 8, workers: int = 0,
                 vector_index: str = "exact", shortlist: int | None = None) -> "Retriever":
        """The run's model (``checkpoint``: best, last or a file) over ``split`` of its feature set and
        manifest (or the ones given); the gallery's embeddings come from the run's cache when it matches.
        ``use_faiss``: None uses faiss when installed, False never, True requires it. ``index``: images are
        searched in that gallery index instead of the split; ``images``: in that folder (indexed, and grown, in
        ``RUN/search-cache/``). ``extractor_weights``: the extractor's weights file, where the feature set
        records one by hash (raw images); ``batch_size``/``workers``: of that extraction. ``vector_index``:
        ``exact``, or faiss's approximate ``ivf``/``hnsw`` over the gallery images of inner-product models.
        ``shortlist``: two-stage search for models whose score is no inner product (SCAN, SEAM; SMAN's global
        stage, exactly): only that many items per query are scored (``docs/search.md``).

        Every check that can fail without encoding anything runs first: the model against ``vector_index`` and
        ``shortlist``, the folder ``images`` (it must hold image files), the index ``index`` (it must be one, of
        this checkpoint, with images enough for an ``ivf`` index)."""
        dev = resolve_device(device)
        run = local_run(run)
        if shortlist is not None and shortlist < 1:
            raise UserError(f"the shortlist must hold at least 1 item, not {shortlist}")
        config = ckpt.read_config(run)
        error = vector_index_error(config["model"], scores_by_inner_product(get_spec(config["model"]).model_class),
                                   shortlist, vector_index)
        if error is not None:
            raise error
        listing = None
        if images is not None:
            listing = list_folder(images)
            if not listing.images:
                raise no_images_error(images, listing)
        checkpoint_sha256 = sha256_file(ckpt.resolve_checkpoint(run, checkpoint))
        if index is not None:
            gallery_index = GalleryIndex(index)
            identity = run_index_identity(run, checkpoint, features, checkpoint_sha256)
            if identity is not None:
                gallery_index.check(identity)
            if vector_index == "ivf":
                _check_ivf(len(gallery_index.known()[0]))
        elif images is not None and vector_index == "ivf":
            _check_ivf(len(listing.images))              # at most this many: checked again once indexed
        opened = open_run_split(run, split, features, manifest, checkpoint, dev, trust_checkpoint)
        model, vocab, feature_set, data = opened.model, opened.vocab, opened.features, opened.data
        if index is None and images is None and vector_index == "ivf":
            _check_ivf(data.num_images)
        key = hashlib.sha256(json.dumps({
            "checkpoint": checkpoint_sha256, "split": split,
            "data": data_identity(feature_set, opened.manifest_path)}, sort_keys=True).encode()).hexdigest()[:20]
        caches = search_caches(run, checkpoint_sha256)
        path = caches / f"{split}-{key}.pt"
        gallery = _read_cache(path, dev) if cache else None
        if gallery is None:
            gallery = _encode_gallery(model, data, ImageFeatures(feature_set, data.image_ids), dev, quiet)
            if cache:
                _write_cache(path, gallery)
        retriever = cls(model, vocab, data, gallery, dev, use_faiss,
                        "exact" if images is not None or index is not None else vector_index, shortlist)
        retriever.vector_index = vector_index           # the split's gallery is not searched: its index is exact
        retriever.run, retriever.feature_set = run, feature_set
        retriever.checkpoint_sha256 = checkpoint_sha256
        retriever.extractor_options = {"weights": extractor_weights, "trust_checkpoint": trust_checkpoint,
                                       "batch_size": batch_size, "workers": workers}
        if images is not None:
            digest = hashlib.sha256(str(Path(images).resolve()).encode()).hexdigest()[:16]
            index = caches / f"folder-{digest}"
            summary = retriever.add_to_index(index, listing.images, quiet=quiet, not_images=listing.others,
                                             source=images)
            if summary.skipped:
                retriever._note(f"{images}: {summary.skipped_text()}; retr-train index lists them")
        if index is not None:
            retriever.use_index(index)
        return retriever

    # -- raw images and gallery indexes ------------------------------------------------------------------
    @property
    def feature_maker(self) -> FeatureMaker:
        """The run's feature extractor, rebuilt from its feature set's attributes (made on first use)."""
        if self._maker is None:
            if self.feature_set is None:
                raise UserError("this Retriever was not made by from_run: it knows no feature set to embed images")
            self._maker = FeatureMaker(self.feature_set, self.device, **self.extractor_options)
        return self._maker

    @torch.no_grad()
    def encode_images(self, images: Sequence[ImageInput]) -> Embeddings:
        """Image embeddings ``[N, …]`` of raw images (paths, bytes, PIL images), as the split's are made."""
        features, mask = self.feature_maker(images)
        return self.model.encode_images(features.to(self.device), mask.to(self.device))

    @torch.no_grad()
    def encode_files(self, paths: Sequence[str | os.PathLike]):
        """Per batch of image files: ``(positions, embeddings [B, …], failures [(position, reason)])``."""
        for positions, features, mask, failures in self.feature_maker.from_paths(paths):
            embeddings = (self.model.encode_images(features.to(self.device), mask.to(self.device))
                          if positions else None)
            yield positions, embeddings, failures

    def index_identity(self) -> dict:
        if self.feature_set is None:
            raise UserError("this Retriever was not made by from_run: it cannot build or check an index")
        name = getattr(self.model, "name", None) or type(self.model).__name__
        return index_identity(self.run, self.checkpoint_sha256, name, self.feature_set)

    def add_to_index(self, folder: str | os.PathLike, items: Sequence[tuple[str, str | os.PathLike]],
                     shard_size: int = SHARD_SIZE, quiet: bool = True, not_images: Sequence[str] = (),
                     source: str | os.PathLike | None = None) -> AddSummary:
        """Encode the images ``[(id, path)]`` not yet in the gallery index ``folder`` (made if absent);
        ``not_images``: files of the folder skipped for not being images, counted in the summary; ``source``: what
        the images came from, as errors name it (:meth:`GalleryIndex.add`: an index left with no usable image is
        refused)."""
        return GalleryIndex(folder).add(items, self.index_identity(), self.encode_files, shard_size=shard_size,
                                        quiet=quiet, not_images=not_images, source=source)

    def use_index(self, folder: str | os.PathLike) -> list[tuple[str, str]]:
        """Search images in the gallery index ``folder`` from now on (refused if another run built it); returns
        its recorded unusable images ``[(id, reason)]``."""
        index = GalleryIndex(folder)
        index.check(self.index_identity())
        ids, images, errors = index.load(self.device)
        self._set_images(ids, images)
        return errors

    @property
    def two_step(self) -> bool:
        return bool(self.model.shortlist) and self.model.has_global_stage

    # -- queries -----------------------------------------------------------------------------------------
    def encode_texts(self, texts: Sequence[str]) -> tuple[Embeddings, list[list[str]]]:
        """Caption embeddings ``[Q, …]`` of ``texts`` and, per text, its words outside the vocabulary."""
        unknown = [self.vocab.unknown_words(t) for t in texts]
        tokens, lengths = pad_tokens([self.vocab.encode(t) for t in texts])
        with torch.no_grad():
            return self.model.encode_captions(tokens.to(self.device), lengths), unknown

    @torch.no_grad()
    def text_to_images(self, texts: Sequence[str], k: int = 10) -> list[SearchResult]:
        """The ``k`` best images of the gallery (the split's, or the index's) for each text (scores as eval's)."""
        if not texts:
            return []
        for text in texts:
            error = query_error(text)
            if error is not None:
                raise error
        queries, unknown = self.encode_texts(list(texts))
        images, n = self.images, len(self.image_ids)
        results = []
        for q, text in enumerate(texts):
            caption = slice_embeddings(queries, slice(q, q + 1))
            vector = self._vectors(caption, "caption") if self.image_index is not None else None
            if self.two_step:
                rows, scores = self._two_step(images, caption, n, image_side=False, index=self.image_index,
                                              query=vector)
            else:
                if vector is not None:
                    rows = self._first_stage(self.image_index, vector, k)
                else:
                    rows = _candidates(score_blocks(lambda im, cap: self.model.score(im, cap), images,
                                                    [(np.array([0]), caption)], n, 1)[:, 0], k)
                scores = self._score64(slice_embeddings(images, torch.from_numpy(rows).to(self.device)), caption)[:, 0]
            order = _best(scores, rows, k)
            results.append(SearchResult(text, [Hit(r + 1, float(scores[i]), self.image_ids[rows[i]])
                                               for r, i in enumerate(order)], unknown[q]))
        return results

    def _image_queries(self, images: Sequence) -> tuple[list[str], Embeddings | None]:
        """Names and embeddings ``[Q, …]`` of image queries: an id of the split (its stored row) or of the
        index gallery, an image file, a folder (each image in it), bytes or a PIL image (embedded anew)."""
        split_row = {image_id: i for i, image_id in enumerate(self.data.image_ids)}
        index_row = ({image_id: i for i, image_id in enumerate(self.image_ids)}
                     if self.images is not self.gallery["images"] else {})
        names, parts, raw = [], [], []
        for image in images:
            if isinstance(image, (str, os.PathLike)) and not str(image).strip():
                raise UserError("an image query is empty: give an image id, an image file or a folder of images")
            if isinstance(image, str) and (image in split_row or image in index_row):
                source, row = ((self.gallery["images"], split_row[image]) if image in split_row
                               else (self.images, index_row[image]))
                names.append(image)
                parts.append(("stored", slice_embeddings(source, slice(row, row + 1))))
            elif isinstance(image, (str, os.PathLike)) and not Path(image).exists():
                n = self.data.num_images
                raise UserError(f"image {str(image)!r} is not in the gallery (split of {n} image{'s' * (n != 1)}) "
                                f"and is no image file or folder")
            else:
                folder = isinstance(image, (str, os.PathLike)) and Path(image).is_dir()
                if folder:
                    listing = list_folder(image)
                    if not listing.images:
                        raise no_images_error(image, listing)
                files = [p for _, p in listing.images] if folder else [image]
                names += [describe(f) for f in files]
                parts += [("raw", len(raw) + i) for i in range(len(files))]
                raw += files
        if not names:
            return [], None
        fresh = self.encode_images(raw) if raw else None
        rows = [emb if kind == "stored" else slice_embeddings(fresh, slice(emb, emb + 1)) for kind, emb in parts]
        return names, _concat(rows)

    @torch.no_grad()
    def image_to_texts(self, images: Sequence, k: int = 10) -> list[SearchResult]:
        """The ``k`` best captions of the split for each image (see :meth:`_image_queries`; scores as eval's)."""
        names, queries = self._image_queries(images)
        results = []
        for q, name in enumerate(names):
            image = slice_embeddings(queries, slice(q, q + 1))
            vector = self._vectors(image, "image") if self.caption_index is not None else None
            if self.two_step:
                cols, scores = self._two_step(image, self.gallery["captions"], self.data.num_captions,
                                              image_side=True, index=self.caption_index, query=vector)
            else:
                if vector is not None:      # the index holds each source caption once: expand to its copies
                    source = self.gallery["caption_source"]
                    cols = np.flatnonzero(np.isin(source, self._first_stage(self.caption_index, vector, k)))
                else:
                    cols = _candidates(self._caption_pass(image), k)
                scores = self._score64(image, self._captions(cols))[0]
            order = _best(scores, cols, k)
            results.append(SearchResult(name, [
                Hit(r + 1, float(scores[i]), self.data.image_ids[self.data.caption_image[cols[i]]],
                    self.data.captions[cols[i]], int(cols[i])) for r, i in enumerate(order)]))
        return results

    # -- scoring -----------------------------------------------------------------------------------------
    def _first_stage(self, index: InnerProductIndex, vector: torch.Tensor, k: int) -> np.ndarray:
        """Sorted gallery ids to score in float64 for one query: every item near the k-th best inner product
        (the exact top k of an inner-product model), or, in a two-stage search of a model whose score is no
        inner product, its ``shortlist`` best shortlist vectors."""
        if self.shortlist is None or self._inner_product:
            return index.candidates(vector, k)
        if self.shortlist < k:
            self._note(f"the shortlist of {self.shortlist} is shorter than the {k} results asked for: the {k} best by "
                       f"stage one are scored per query")
        found = index.search(vector.detach().float().cpu().numpy(), max(k, self.shortlist))[1][0]
        return np.sort(found[found >= 0])

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
        ``pair_score`` (float64, eval's default; both cast what they score, so the gallery is not copied to
        float64 for a query). Returns (candidate rows, their scores)."""
        shortlist = min(self.model.shortlist, n)
        pool = torch.arange(n, device=self.device)
        if index is not None and query is not None:
            pool = torch.from_numpy(index.candidates(query, shortlist)).to(self.device)
        if image_side:
            g = self.model.global_score(images, slice_embeddings(captions, pool), dtype=torch.float64)[0]
        else:
            g = self.model.global_score(slice_embeddings(images, pool), captions, dtype=torch.float64)[:, 0]
        cands = pool[_top_stable(g, shortlist)]
        zeros = torch.zeros_like(cands)
        img_idx, cap_idx = (zeros, cands) if image_side else (cands, zeros)
        scores = self.model.pair_score(images, captions, img_idx, cap_idx, dtype=torch.float64)
        return cands.cpu().numpy(), scores.double().cpu().numpy()


def _check_ivf(n: int) -> None:
    """Refuse in one line an ``ivf`` vector index over a gallery of ``n`` images (too few to train)."""
    error = ivf_size_error(n, items="gallery images", instead="vector_index exact (as fast at this size)",
                           parameters=("vector_index",))
    if error is not None:
        raise error


def _top_stable(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` highest ``scores``, ties to the lower position (as ``topk`` over the whole row)."""
    order = np.lexsort((np.arange(scores.numel()), -scores.double().cpu().numpy()))[:k]
    return torch.from_numpy(order).to(scores.device)


def _caption_vectors(vectors_of, gallery: dict) -> tuple[torch.Tensor | None, np.ndarray | None]:
    """``vectors_of`` (``index_vectors`` or the shortlist vectors) the gallery's source captions ``[S, d]`` and
    their caption ids ``[S]`` (None, None: the model has no such vectors)."""
    ids, parts = [], []
    for idx, emb in gallery["caption_blocks"]:
        vectors = vectors_of(emb, "caption")
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
    with atomic_file(path) as partial:
        torch.save(state, partial)


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
