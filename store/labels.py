"""Image-label files (``labels.json`` object or ``labels.jsonl`` lines; attributes under :data:`ATTRS_KEY`).

Forms and what JGCAR's ``--labels`` does with them: docs/models-jgcar.md ("Where the labels come from")."""
from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

from retr.common.atomic import atomic_text
from retr.common.errors import ParameterError, UserError
from retr.common.textfiles import read_utf8
from retr.common.version import __version__

#: The key of a label file's attributes (not an image id: ids never contain ``#``).
ATTRS_KEY = "#attrs"
FORMAT_VERSION = 1


def _entries(path: Path) -> tuple[list[tuple[Any, Any]], dict]:
    """``(image id, labels)`` pairs as written, and the attributes (``{}`` when the file has none)."""
    text = read_utf8(path, "a label file (JSON or JSON Lines)")
    attrs: dict = {}
    if path.suffix != ".jsonl":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise UserError(f"{path} is not JSON ({exc}); JSON Lines files must end in .jsonl") from None
        if not isinstance(data, dict):
            raise UserError(f"{path}: expected one JSON object mapping image ids to label lists")
        found = data.pop(ATTRS_KEY, {})
        attrs = found if isinstance(found, dict) else {}
        return list(data.items()), attrs
    entries = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if isinstance(obj, dict) and ATTRS_KEY in obj and "id" not in obj:
                attrs = obj[ATTRS_KEY] if isinstance(obj[ATTRS_KEY], dict) else {}
                continue
            entries.append((obj["id"], obj["labels"]))
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{path}:{n}: expected {{\"id\": …, \"labels\": […]}} per line, or one JSON "
                            "object mapping image ids to label lists") from None
    return entries, attrs


def read_label_file(path: str | os.PathLike) -> dict[str, list[str]]:
    """Image labels from JSON ``{"<image id>": ["label", …], …}`` or, for a ``.jsonl`` file, JSON Lines
    ``{"id": …, "labels": […]}`` (e.g. COCO's instance categories or Flickr30K Entities' head nouns per image).

    The attributes entry (:data:`ATTRS_KEY`), if any, is not an image and is left out."""
    path = Path(path)
    entries, _ = _entries(path)
    labels = {}
    for image_id, values in entries:
        if not isinstance(values, list) or not all(isinstance(v, (str, int)) for v in values):
            raise UserError(f"{path}: labels of {image_id!r} must be a list of strings or integers")
        labels[str(image_id)] = [str(v) for v in values]
    return labels


def read_label_attrs(path: str | os.PathLike) -> dict[str, Any]:
    """The attributes a label file carries (``{}`` for a file written by hand without them)."""
    return _entries(Path(path))[1]


def write_label_file(path: str | os.PathLike, labels: Mapping[str, Sequence[str]],
                     attrs: Mapping[str, Any] | None = None) -> Path:
    """Write ``labels`` (image id → strings) atomically in the form :func:`read_label_file` reads; returns ``path``.

    ``.jsonl`` gives JSON Lines, any other suffix one object; ``attrs`` are stored with the format fields."""
    path = Path(path)
    rows = []
    for image_id, values in labels.items():
        if not isinstance(image_id, str) or not image_id or "#" in image_id:
            raise ParameterError(f"labels has the image id {image_id!r}; ids are non-empty strings without '#'",
                                 "labels")
        if isinstance(values, str) or not all(isinstance(v, str) for v in values):
            raise ParameterError(f"labels of {image_id!r} in labels must be a list of strings, not {values!r}",
                                 "labels")
        rows.append((image_id, list(values)))
    header = {"format_version": FORMAT_VERSION, **dict(attrs or {}), "num_images": len(rows),
              "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "retr_version": __version__}
    try:
        header_text = json.dumps(header, ensure_ascii=False)
    except TypeError as exc:
        raise ParameterError(f"attrs must be JSON-serialisable ({exc})", "attrs") from None
    with atomic_text(path) as handle:
        if path.suffix == ".jsonl":
            handle.write(json.dumps({ATTRS_KEY: header}, ensure_ascii=False) + "\n")
            for image_id, values in rows:
                handle.write(json.dumps({"id": image_id, "labels": values}, ensure_ascii=False) + "\n")
        else:
            handle.write("{" + json.dumps(ATTRS_KEY) + ": " + header_text)
            for image_id, values in rows:
                handle.write(",\n" + json.dumps(image_id, ensure_ascii=False) + ": "
                             + json.dumps(values, ensure_ascii=False))
            handle.write("\n}\n")
    return path
