"""Scoring a saved similarity matrix (``retr-train eval-sims``): ``FILE.npy`` ``[images, captions]`` as ``retr-train
eval --save-sims`` writes it, with ``FILE.npy.ids.json`` beside it (``image_ids`` of the rows, ``caption_keys``
``<image id>#<n>`` of the columns, ``caption_ids`` their COCO caption ids where known), or, without an ids file,
rows and columns in the order of a manifest's split — so a matrix another code base saved can be scored too.
Every protocol that fits, and ``--extended`` (:mod:`~retr.trainers.evaluation.coco_extended`); nothing is written.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from retr.common.errors import UserError
from retr.trainers.data.splits import SplitData
from retr.trainers.evaluation import coco_extended
from retr.trainers.evaluation.metrics import PROTOCOLS, check_split_size, protocol_metrics, protocols_for
from retr.manifests.schema import read_manifest


@dataclass
class SavedSims:
    """A saved matrix and the ids of its rows and columns."""

    sims: np.ndarray                 #: [N, M] floating
    image_ids: list[str]             #: [N]
    caption_keys: list[str]          #: [M] ``<image id>#<n>``
    caption_ids: list | None         #: [M] COCO caption ids (None entries: unknown), or None
    path: str
    ids_source: str                  #: where the ids come from (messages)
    manifest: str | None = None

    @property
    def caption_image(self) -> np.ndarray:
        """[M] int64: the row of each column's image."""
        row_of = {image: row for row, image in enumerate(self.image_ids)}
        return np.array([row_of[key.rsplit("#", 1)[0]] for key in self.caption_keys], dtype=np.int64)


def read_saved_sims(path: str, ids: str | None = None, manifest: str | None = None,
                    split: str = "test") -> SavedSims:
    """The matrix ``path`` and its ids: from ``ids`` (default ``path.ids.json``, when there), else from ``split`` of
    ``manifest`` in file order. With both, the caption ids come from the manifest (by caption key). One line for a
    file that is not such a matrix, ids that do not fit it, or no ids at all."""
    path = str(path)
    if not Path(path).is_file():
        raise UserError(f"{path} does not exist (a matrix from `retr-train eval --save-sims FILE`)")
    try:
        sims = np.load(path, allow_pickle=False, mmap_mode="r")
    except (OSError, ValueError, EOFError) as exc:
        raise UserError(f"{path} is not a .npy matrix ({exc})") from None
    if sims.ndim != 2 or not np.issubdtype(sims.dtype, np.floating):
        raise UserError(f"{path} holds a {sims.dtype} array of shape {sims.shape}, not an images × captions matrix "
                        "of similarities")
    ids_path = Path(ids) if ids is not None else Path(f"{path}.ids.json")
    records = read_manifest(manifest, splits=[split]) if manifest is not None else None
    if ids_path.is_file():
        image_ids, caption_keys, caption_ids = _read_ids(ids_path)
        source = str(ids_path)
    elif ids is not None:
        raise UserError(f"ids file {ids} does not exist")
    elif records is None:
        raise UserError(f"{path} has no {ids_path.name} beside it; give --ids FILE, or --manifest (rows and columns "
                        "then follow its split, in file order)")
    else:
        if not records:
            raise UserError(f"{manifest} has no images in split {split}")
        image_ids = [r.id for r in records]
        caption_keys = [r.caption_key(n) for r in records for n in range(len(r.captions))]
        caption_ids, source = None, f"split {split} of {manifest}"
    if records is not None:
        by_key = {r.caption_key(n): (None if r.caption_ids is None else r.caption_ids[n])
                  for r in records for n in range(len(r.captions))}
        absent = [key for key in caption_keys if key not in by_key]
        if absent:
            raise UserError(f"{len(absent):,} captions of {source} are not in split {split} of {manifest} (first: "
                            f"{absent[0]})")
        caption_ids = [by_key[key] for key in caption_keys]
    if sims.shape != (len(image_ids), len(caption_keys)):
        raise UserError(f"{path} is a {sims.shape[0]:,} × {sims.shape[1]:,} matrix, but {source} names "
                        f"{len(image_ids):,} images × {len(caption_keys):,} captions")
    saved = SavedSims(np.asarray(sims), image_ids, caption_keys, caption_ids, path, source, manifest)
    rows = set(image_ids)
    orphan = next((key for key in caption_keys if key.rsplit("#", 1)[0] not in rows), None)
    if orphan is not None:
        raise UserError(f"{source}: caption {orphan} belongs to no image of its rows")
    return saved


def _read_ids(path: Path) -> tuple[list[str], list[str], list | None]:
    try:
        ids = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path} is not an ids file ({exc})") from None
    if not isinstance(ids, dict) or not all(isinstance(ids.get(k), list) for k in ("image_ids", "caption_keys")):
        raise UserError(f"{path} is not an ids file (a JSON object with the lists image_ids and caption_keys)")
    caption_ids = ids.get("caption_ids")
    if caption_ids is not None and (not isinstance(caption_ids, list) or len(caption_ids) != len(ids["caption_keys"])):
        raise UserError(f"{path}: caption_ids must list one id (or null) per caption key")
    return [str(i) for i in ids["image_ids"]], [str(k) for k in ids["caption_keys"]], caption_ids


def choose_protocols(saved: SavedSims, protocols: tuple[str, ...] | list[str], allow_size_mismatch: bool) -> list[str]:
    """The protocols asked for, else every one whose size the matrix has; refused (one line) when none fits."""
    if protocols:
        for protocol in protocols:
            if protocol not in PROTOCOLS:
                raise UserError(f"unknown protocol {protocol!r} (expected one of {', '.join(PROTOCOLS)})")
            check_split_size(protocol, len(saved.image_ids), allow_size_mismatch)
        return list(dict.fromkeys(protocols))
    fitting = protocols_for(len(saved.image_ids))
    if not fitting:
        raise UserError(f"{saved.path} has {len(saved.image_ids):,} images, the size of no protocol (1,000: "
                        "Flickr30K, 5,000: COCO); pass --protocol P --allow-size-mismatch")
    return fitting


def evaluate_saved(saved: SavedSims, protocols: list[str], ties: str = "pessimistic",
                   allow_size_mismatch: bool = False, extended: bool = False) -> dict:
    """``{"sims", "ids", "results": [one per protocol], "extended": …}`` for a saved matrix. The extended inputs
    are checked (one line each) before anything is computed."""
    coco = None
    if extended:
        for protocol in protocols:
            coco_extended.check_protocol(protocol)
        annotations = coco_extended.load_annotations()
        hint = ("pass --manifest with the manifest whose caption ids name them (`"
                f"{coco_extended.ADD_IDS_COMMAND} MANIFEST --annotations DIR` adds them)")
        ids = coco_extended.matrix_ids(saved.image_ids, saved.caption_keys,
                                       saved.caption_ids or [None] * len(saved.caption_keys), saved.ids_source, hint)
        coco_extended.check_test_set(annotations, ids)
        coco = annotations, ids
    if not np.isfinite(saved.sims).all():
        raise UserError(f"{saved.path} contains NaN/inf (a diverged model?); cannot rank")
    data = SplitData(saved.image_ids, saved.caption_keys, saved.caption_image, [])
    out: dict = {"sims": saved.path, "ids": saved.ids_source, "ties": ties, "results": []}
    for protocol in protocols:
        result = protocol_metrics(saved.sims, data, protocol, allow_size_mismatch, ties)
        result.update(protocol=protocol)
        out["results"].append(result)
    if coco is not None:
        annotations, ids = coco
        out["extended"] = coco_extended.extended_metrics(saved.sims, ids, annotations, ties)
        out["extended_annotations"] = f"{coco_extended.PACKAGE} {annotations.version}"
    out["evaluated"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return out
