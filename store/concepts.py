"""``concepts.h5``, the concepts contract of DESIGN.md (concept word vectors: :mod:`retr.store.word_vectors`).

``retr-pipeline build-concepts`` (:mod:`retr.pipeline.concepts`) builds the data and writes it with
:func:`write_concepts`; the SMFEA trainer reads it with :class:`ConceptSet`. Layout::

    /concepts        [C]     utf-8   concept words (lemmas), nouns first, then adjectives, then verbs
    /pos             [C]     utf-8   NOUN / ADJ / VERB, or ANY for the frequency fallback
    /counts          [C]     int64   number of training captions that contain the concept
    /cooccurrence    [C, C]  int64   number of training captions that contain both (diagonal = counts)
    /adjacency       [C, C]  float32 the normalised graph ``D^(-1/2) Aᵀ D^(-1/2)`` the GCN multiplies by
    /caption_keys    [M]     utf-8   "<image id>#<k>", every caption of the manifest (all splits)
    /caption_labels  [M, C]  uint8   1 where the caption's own words contain the concept
    /image_ids       [N]     utf-8   every image of the manifest
    /image_labels    [N, C]  uint8   union of the labels of the image's captions
    attrs: kind="concepts", format_version, manifest_sha256, pos_source, train_splits, requested and actual
           numbers per part of speech, graph parameters, forms (JSON: word form → concept word), created,
           retr_version, complete

Written to ``<path>.partial`` and renamed when complete.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Mapping, Sequence

import h5py
import numpy as np

from retr.common.atomic import atomic_hdf5
from retr.common.errors import MissingResourceError, UserError
from retr.common.version import __version__

FORMAT_VERSION = 1


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _decode(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


@dataclass
class ConceptData:
    """Everything ``concepts.h5`` holds (see the module docstring for shapes)."""

    concepts: list[str]
    pos: list[str]
    counts: np.ndarray
    cooccurrence: np.ndarray
    adjacency: np.ndarray
    caption_keys: list[str]
    caption_labels: np.ndarray
    image_ids: list[str]
    image_labels: np.ndarray
    attrs: dict
    forms: dict[str, str]      # word form (as the tokenizer writes it) → concept word


def write_concepts(path: str | os.PathLike, data: ConceptData, attrs: Mapping[str, object] | None = None) -> Path:
    """Write ``concepts.h5`` to ``<path>.partial`` and rename it when complete."""
    path = Path(path)
    text = h5py.string_dtype("utf-8")
    c = len(data.concepts)
    with atomic_hdf5(path) as f:
        for key, value in {**data.attrs, **(attrs or {})}.items():
            f.attrs[key] = value
        f.attrs.update({"kind": "concepts", "format_version": FORMAT_VERSION, "created": _now(),
                        "retr_version": __version__, "num_concepts": c,
                        "forms": json.dumps(data.forms, ensure_ascii=False, sort_keys=True)})
        f.create_dataset("concepts", data=np.array(data.concepts, dtype=object), dtype=text)
        f.create_dataset("pos", data=np.array(data.pos, dtype=object), dtype=text)
        f.create_dataset("counts", data=data.counts.astype(np.int64))
        f.create_dataset("cooccurrence", data=data.cooccurrence.astype(np.int64))
        f.create_dataset("adjacency", data=data.adjacency.astype(np.float32))
        f.create_dataset("caption_keys", data=np.array(data.caption_keys, dtype=object), dtype=text)
        f.create_dataset("caption_labels", data=data.caption_labels, dtype=np.uint8,
                         chunks=(min(4096, max(len(data.caption_keys), 1)), c), compression="gzip")
        f.create_dataset("image_ids", data=np.array(data.image_ids, dtype=object), dtype=text)
        f.create_dataset("image_labels", data=data.image_labels, dtype=np.uint8,
                         chunks=(min(4096, max(len(data.image_ids), 1)), c), compression="gzip")
    return path


class ConceptSet:
    """A ``concepts.h5`` read into memory, with lookups by caption key and image id."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise MissingResourceError(f"concept file {self.path}", str(self.path.parent),
                                       "build it with: retr-pipeline build-concepts --manifest M --out "
                                       f"{self.path}")
        try:
            f = h5py.File(self.path, "r")
        except OSError as exc:
            raise UserError(f"{self.path} is not a readable HDF5 file ({exc})") from None
        with f:
            if f.attrs.get("kind") != "concepts":
                raise UserError(f"{self.path} is not a concepts file (kind {f.attrs.get('kind')!r})")
            if not f.attrs.get("complete", False):
                raise UserError(f"{self.path} is incomplete; re-run build-concepts")
            self.attrs = {k: (_decode(v) if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
            self.concepts = [_decode(v) for v in f["concepts"][:]]
            self.pos = [_decode(v) for v in f["pos"][:]]
            self.counts = f["counts"][:]
            self.cooccurrence = f["cooccurrence"][:]
            self.adjacency = f["adjacency"][:]
            self.caption_keys = [_decode(v) for v in f["caption_keys"][:]]
            self.caption_labels = f["caption_labels"][:]
            self.image_ids = [_decode(v) for v in f["image_ids"][:]]
            self.image_labels = f["image_labels"][:]
        #: word form → concept index (the trainer's token → concept map is built from it)
        self.forms = {form: self.concepts.index(c) for form, c in json.loads(self.attrs.get("forms", "{}")).items()
                      if c in self.concepts}
        self._caption_rows = {k: i for i, k in enumerate(self.caption_keys)}
        self._image_rows = {k: i for i, k in enumerate(self.image_ids)}

    def __len__(self) -> int:
        return len(self.concepts)

    def _rows(self, keys: Sequence[str], table: dict[str, int], what: str) -> np.ndarray:
        rows = np.fromiter((table.get(k, -1) for k in keys), dtype=np.int64, count=len(keys))
        if (rows < 0).any():
            first = keys[int(np.flatnonzero(rows < 0)[0])]
            raise UserError(f"{self.path} has no concept labels for {int((rows < 0).sum())} {what}(s) "
                            f"(first: {first}); rebuild it from this manifest")
        return rows

    def labels_for_captions(self, keys: Sequence[str]) -> np.ndarray:
        """``[len(keys), C]`` uint8 labels of captions (their own words)."""
        return self.caption_labels[self._rows(keys, self._caption_rows, "caption")]

    def labels_for_images(self, ids: Sequence[str]) -> np.ndarray:
        """``[len(ids), C]`` uint8 labels of images (union over their captions)."""
        return self.image_labels[self._rows(ids, self._image_rows, "image")]

