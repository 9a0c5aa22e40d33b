"""Image-label files: a few labels per image (COCO's instance categories, Flickr30K Entities' types).

JGCAR's ``--labels`` reads one to decide which training images are intra-modal positives of each other
(``docs/models-jgcar.md``). Two forms::

    labels.json    {"<image id>": ["label", …], …}            one JSON object
    labels.jsonl   {"id": "<image id>", "labels": ["label", …]}  one object per line (the suffix decides)

Labels may be strings or integers; they are read as strings. An empty list is a valid entry.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from retr.common.errors import UserError


def read_label_file(path: str | os.PathLike) -> dict[str, list[str]]:
    """Image labels from JSON ``{"<image id>": ["label", …], …}`` or, for a ``.jsonl`` file, JSON Lines
    ``{"id": …, "labels": […]}`` (e.g. COCO's instance categories or Flickr30K's entity types per image)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"label file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".jsonl":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise UserError(f"{path} is not JSON ({exc}); JSON Lines files must end in .jsonl") from None
        if not isinstance(data, dict):
            raise UserError(f"{path}: expected one JSON object mapping image ids to label lists")
        entries = list(data.items())
    else:
        entries = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                entries.append((obj["id"], obj["labels"]))
            except (ValueError, KeyError, TypeError):
                raise UserError(f"{path}:{n}: expected {{\"id\": …, \"labels\": […]}} per line, or one JSON "
                                "object mapping image ids to label lists") from None
    labels = {}
    for image_id, values in entries:
        if not isinstance(values, list) or not all(isinstance(v, (str, int)) for v in values):
            raise UserError(f"{path}: labels of {image_id!r} must be a list of strings or integers")
        labels[str(image_id)] = [str(v) for v in values]
    return labels
