"""The manifest: JSON Lines, one image per line (``id``, ``path``, ``split``, ``captions``), the contract every
stage starts from (docs/DESIGN.md, "Contracts"; paths: docs/extraction.md). Caption ``k`` of image ``id`` is
``"<id>#<k>"``; other keys are kept in ``ManifestRecord.extra``."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Iterable, Iterator, Sequence

from retr.common.atomic import atomic_text
from retr.common.errors import ParameterError, UserError
from retr.common.hashing import sha256_file
from retr.common.textfiles import binary_kind

SPLITS = ("train", "restval", "val", "test")
REQUIRED_FIELDS = ("id", "path", "split", "captions")


class ManifestError(UserError):
    """A manifest line breaks the schema; the message names the file and line."""


@dataclass(frozen=True)
class ManifestRecord:
    """One image of a dataset and its captions."""

    id: str
    path: str
    split: str
    captions: tuple[str, ...]
    extra: dict = field(default_factory=dict, compare=False)

    def caption_key(self, index: int) -> str:
        """The key of caption ``index`` of this image: ``"<id>#<index>"``."""
        return f"{self.id}#{index}"

    def to_json(self) -> str:
        body = {"id": self.id, "path": self.path, "split": self.split, "captions": list(self.captions)}
        body.update(self.extra)
        return json.dumps(body, ensure_ascii=False)


def parse_record(obj: object, where: str) -> ManifestRecord:
    """Check one decoded JSON line against the schema; ``where`` (``"file line N"``) prefixes errors."""
    if not isinstance(obj, dict):
        raise ManifestError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [name for name in REQUIRED_FIELDS if name not in obj]
    if missing:
        raise ManifestError(f"{where}: missing field{'s' if len(missing) > 1 else ''} "
                            + ", ".join(repr(m) for m in missing))
    image_id, path, split, captions = (obj[name] for name in REQUIRED_FIELDS)
    if not isinstance(image_id, str) or not image_id.strip():
        raise ManifestError(f"{where}: 'id' must be a non-empty string")
    if "#" in image_id:
        raise ManifestError(f"{where}: id {image_id!r} contains '#', which separates image id and caption index")
    if not isinstance(path, str) or not path.strip():
        raise ManifestError(f"{where}: 'path' must be a non-empty string (id {image_id!r})")
    if split not in SPLITS:
        raise ManifestError(f"{where}: unknown split {split!r} for id {image_id!r} (expected one of "
                            + ", ".join(SPLITS) + ")")
    if not isinstance(captions, list) or not captions:
        raise ManifestError(f"{where}: 'captions' must be a non-empty list (id {image_id!r})")
    for k, caption in enumerate(captions):
        if not isinstance(caption, str) or not caption.strip():
            raise ManifestError(f"{where}: caption {k} of id {image_id!r} is empty")
    extra = {key: value for key, value in obj.items() if key not in REQUIRED_FIELDS}
    return ManifestRecord(image_id, path, split, tuple(c.strip() for c in captions), extra)


def iter_manifest(path: str | os.PathLike) -> Iterator[ManifestRecord]:
    """Yield the validated records of a manifest file in file order (blank lines skipped; duplicates named)."""
    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"manifest {path} does not exist")
    seen: dict[str, int] = {}
    with open(path, "rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            where = f"{path} line {line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                binary = binary_kind(raw) if line_no == 1 else None
                if binary is not None:
                    raise ManifestError(f"{path} is {binary}, not a manifest (JSON Lines in UTF-8)") from None
                raise ManifestError(f"{where}: not UTF-8 text (byte {exc.start + 1} is 0x{raw[exc.start]:02x}); a "
                                    f"manifest is JSON Lines in UTF-8 — re-encode it (e.g. iconv -f latin1 "
                                    f"-t utf-8)") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ManifestError(f"{where}: not valid JSON ({exc.msg})") from None
            record = parse_record(obj, where)
            if record.id in seen:
                raise ManifestError(f"{where}: duplicate id {record.id!r} (first on line {seen[record.id]})")
            seen[record.id] = line_no
            yield record


def read_manifest(path: str | os.PathLike, splits: Sequence[str] | None = None) -> list[ManifestRecord]:
    """All records of a manifest (the whole file is validated), optionally only those of ``splits``."""
    if splits is not None:
        unknown = [s for s in splits if s not in SPLITS]
        if unknown:
            raise ParameterError(f"unknown split {unknown[0]!r} in splits (expected one of {', '.join(SPLITS)})",
                                 "splits")
    records = _parsed(path)
    return list(records) if splits is None else [r for r in records if r.split in splits]


#: the last manifest parsed — ``(path, file state, records)`` — so the stages of one start that each read it
#: (the checks before any work, then the run's splits) parse a COCO-size manifest once, not once each
_last_parsed: tuple[str, tuple, tuple[ManifestRecord, ...]] | None = None


def _parsed(path: str | os.PathLike) -> tuple[ManifestRecord, ...]:
    """Every record of ``path``, parsed and validated once per file state (inode, size, modification time)."""
    global _last_parsed
    try:
        info = os.stat(path)
        state = (info.st_ino, info.st_size, info.st_mtime_ns)
    except OSError:
        state = None                     # iter_manifest says what is wrong with the path
    key = os.path.abspath(path)
    if state is not None and _last_parsed is not None and _last_parsed[:2] == (key, state):
        return _last_parsed[2]
    records = tuple(iter_manifest(path))
    if state is not None:
        _last_parsed = (key, state, records)
    return records


def write_manifest(path: str | os.PathLike, records: Iterable[ManifestRecord]) -> int:
    """Write records as JSON Lines atomically, ids checked unique first; returns the count."""
    path = Path(path)
    records = list(records)
    seen: set[str] = set()
    for record in records:
        if record.id in seen:
            raise ManifestError(f"duplicate id {record.id!r} while writing {path}")
        seen.add(record.id)
    with atomic_text(path) as handle:
        for record in records:
            handle.write(record.to_json() + "\n")
    return len(records)


def manifest_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of the manifest file's bytes, recorded in every feature set made from it."""
    return sha256_file(path)


def outside_root_reason(path: str) -> str | None:
    """Why the manifest ``path`` leaves its image root (absolute, or ``..`` above it), else None; text only."""
    if PurePosixPath(path).is_absolute() or PureWindowsPath(path).is_absolute() or PureWindowsPath(path).drive:
        return "absolute path"
    depth = 0
    for part in path.replace("\\", "/").split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return "'..' climbs above the image root"
        elif part not in ("", "."):
            depth += 1
    return None


def resolve_image_root(manifest_path: str | os.PathLike, image_root: str | os.PathLike | None = None,
                       preset_root: str | os.PathLike | None = None) -> Path:
    """The folder manifest paths are relative to: ``--image-root``, else the preset's, else the manifest's folder."""
    if image_root is not None:
        return Path(image_root)
    if preset_root is not None:
        return Path(preset_root)
    return Path(manifest_path).resolve().parent
