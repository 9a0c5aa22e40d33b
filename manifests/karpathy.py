"""Readers for Karpathy's split files (``dataset_coco.json``, ``dataset_flickr30k.json``, ``dataset_flickr8k.json``).

Ids, paths, captions and splits as read: docs/extraction.md ("Manifests and presets").
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from retr.common.errors import UserError
from retr.manifests.schema import SPLITS, ManifestRecord

_PREFIXES = {"coco": "coco", "flickr30k": "f30k", "flickr8k": "f8k"}


def read_karpathy(path: str | os.PathLike, max_captions: int | None = 5) -> list[ManifestRecord]:
    """Manifest records for every image of a Karpathy split file, in file order."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise UserError(f"Karpathy split file {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a UTF-8 text file (a Karpathy split file is JSON)") from None
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise UserError(f"{path}: not a Karpathy split file (no 'images' list)")
    dataset = str(data.get("dataset", "")).lower()
    if dataset not in _PREFIXES:
        raise UserError(f"{path}: unknown dataset {data.get('dataset')!r} (expected coco, flickr30k or flickr8k)")
    prefix = _PREFIXES[dataset]
    records = []
    for position, image in enumerate(data["images"]):
        where = f"{path}: images[{position}]"
        try:
            filename = image["filename"]
            split = image["split"]
            sentences = image["sentences"]
        except (KeyError, TypeError) as exc:
            raise UserError(f"{where}: missing field {exc}") from None
        if split not in SPLITS:
            raise UserError(f"{where}: unknown split {split!r}")
        if dataset == "coco":
            image_id = f"coco_{image['cocoid']}" if "cocoid" in image else f"coco_{Path(filename).stem}"
            rel_path = f"{image['filepath']}/{filename}" if image.get("filepath") else filename
        else:
            image_id = f"{prefix}_{Path(filename).stem}"
            rel_path = filename
        captions = [s["raw"].strip() for s in sentences if s.get("raw", "").strip()]
        if not captions:
            raise UserError(f"{where}: image {filename} has no captions")
        if max_captions is not None:
            captions = captions[:max_captions]
        records.append(ManifestRecord(image_id, rel_path, split, tuple(captions)))
    return records
