"""COCO caption ids for a manifest: each caption matched to its annotation in COCO's caption files
(``captions_train2014.json``, ``captions_val2014.json``, from ``annotations_trainval2014.zip``).

Karpathy's split file keeps COCO's captions but not their annotation ids, which the extended evaluations (ECCV
Caption, CxC) key their captions by. A caption is matched to an annotation of the same image (by file name, else by
a ``coco_<id>`` image id) whose text is the same once whitespace runs are made single spaces and the ends stripped;
identical texts of one image pair up in file order (the order Karpathy's file keeps them in). A caption no
annotation matches keeps no id (``null``) and is named in the summary line — never guessed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterable, Sequence

from retr.common.errors import MissingResourceError, UserError
from retr.manifests.schema import ManifestRecord

#: COCO's caption files, as ``annotations_trainval2014.zip`` holds them (under ``annotations/``)
CAPTION_FILES = ("captions_train2014.json", "captions_val2014.json")
CAPTIONS_HOW = ("run `retr-pipeline fetch-data coco`, or download annotations_trainval2014.zip from "
                "https://cocodataset.org/#download (http://images.cocodataset.org/annotations/"
                "annotations_trainval2014.zip) and give it (or the folder it unpacks to)")
#: unmatched captions quoted in the summary line
SHOWN = 3

_COCO_ID = re.compile(r"coco_(\d+)")
_KEEP = frozenset({"images", "annotations", "id", "file_name", "image_id", "caption"})


def normalise(text: str) -> str:
    """A caption's text as matched: whitespace runs made single spaces, the ends stripped."""
    return " ".join(text.split())


@dataclass
class CocoCaptions:
    """What the match needs from COCO's caption files."""

    by_file: dict[str, int] = field(default_factory=dict)            #: file_name → image id
    by_image: dict[int, list[tuple[str, int]]] = field(default_factory=dict)  #: image → [(text, annotation id)]
    files: list[str] = field(default_factory=list)


def caption_sources(paths: Sequence[str | os.PathLike]) -> list[tuple[str, object]]:
    """``[(name, opener)]`` of COCO's two caption files found in ``paths``: the files themselves, folders holding
    them (or an ``annotations/`` folder that does), or ``annotations_trainval2014.zip``. One line when one is
    missing."""
    found: dict[str, tuple[str, object]] = {}
    for path in map(Path, paths):
        if path.is_file() and zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                members = {PurePosixPath(n).name: n for n in archive.namelist()}
            for name in CAPTION_FILES:
                if name in members:
                    found.setdefault(name, (f"{path}:{members[name]}",
                                            lambda p=path, m=members[name]: zipfile.ZipFile(p).open(m)))
        elif path.is_file():
            found.setdefault(path.name, (str(path), lambda p=path: open(p, "rb")))
        elif path.is_dir():
            for folder in (path, path / "annotations"):
                for name in CAPTION_FILES:
                    if (folder / name).is_file():
                        found.setdefault(name, (str(folder / name), lambda p=folder / name: open(p, "rb")))
        else:
            raise MissingResourceError(f"COCO caption annotations {path.name}", str(path.parent), CAPTIONS_HOW)
    missing = [name for name in CAPTION_FILES if name not in found]
    if missing:
        raise MissingResourceError(f"COCO caption annotations {' and '.join(missing)}",
                                   ", ".join(str(p) for p in paths), CAPTIONS_HOW)
    return [found[name] for name in CAPTION_FILES]


def read_coco_captions(paths: Sequence[str | os.PathLike]) -> CocoCaptions:
    """The images and captions of COCO's caption files found in ``paths`` (:func:`caption_sources`)."""
    out = CocoCaptions()
    for name, opener in caption_sources(paths):
        try:
            with opener() as handle:
                data = json.load(handle, object_pairs_hook=lambda pairs: {k: v for k, v in pairs if k in _KEEP})
        except json.JSONDecodeError as exc:
            raise UserError(f"{name}: not valid JSON ({exc.msg} at line {exc.lineno}); a partial download? fetch "
                            "it again") from None
        except (UnicodeDecodeError, zipfile.BadZipFile, OSError) as exc:
            raise UserError(f"{name}: cannot be read ({exc})") from None
        _merge(out, data, name)
        out.files.append(PurePosixPath(name).name)
        del data
    return out


def _merge(out: CocoCaptions, data: object, name: str) -> None:
    if not isinstance(data, dict) or not isinstance(data.get("images"), list) \
            or not isinstance(data.get("annotations"), list):
        raise UserError(f"{name}: not a COCO captions file (no 'images' and 'annotations' lists)")
    try:
        for image in data["images"]:
            image_id, file_name = int(image["id"]), str(image["file_name"])
            if out.by_file.setdefault(file_name, image_id) != image_id:
                raise UserError(f"{name}: file {file_name} is image {image_id} here but {out.by_file[file_name]} "
                                f"in {', '.join(out.files)}")
            out.by_image.setdefault(image_id, [])
        for n, annotation in enumerate(data["annotations"]):
            image_id = int(annotation["image_id"])
            if image_id not in out.by_image:
                raise UserError(f"{name}: annotations[{n}] is for image {image_id}, which 'images' does not list")
            out.by_image[image_id].append((normalise(str(annotation["caption"])), int(annotation["id"])))
    except KeyError as exc:
        hint = " — an instances file? give captions_*.json" if str(exc) == "'caption'" else ""
        raise UserError(f"{name}: not a COCO captions file (missing field {exc}){hint}") from None
    except (TypeError, ValueError) as exc:
        raise UserError(f"{name}: not a COCO captions file ({exc})") from None


@dataclass
class CaptionIdJoin:
    """The manifest's records with their caption ids, and what could not be matched."""

    records: list[ManifestRecord]
    matched: int = 0
    captions: int = 0
    unmatched: list[tuple[str, str]] = field(default_factory=list)   #: (caption key, text) without an id
    unknown_images: list[ManifestRecord] = field(default_factory=list)  #: images the caption files do not list

    def summary(self) -> str:
        """One line: how many captions got an id, and which did not (counted, the first few named)."""
        line = f"COCO caption ids for {self.matched:,} of {self.captions:,} captions"
        if self.unknown_images:
            first = self.unknown_images[0]
            line += (f"; {len(self.unknown_images):,} images are not in the caption files (first: {first.id} "
                     f"{first.path})")
        unmatched = [u for u in self.unmatched if u[0].rsplit("#", 1)[0] not in
                     {r.id for r in self.unknown_images}]
        if unmatched:
            shown = ", ".join(f"{key} {text!r}" for key, text in unmatched[:SHOWN])
            line += (f"; {len(unmatched):,} captions match no annotation of their image, left without an id: "
                     f"{shown}" + (" …" if len(unmatched) > SHOWN else ""))
        return line


def join_caption_ids(records: Iterable[ManifestRecord], captions: CocoCaptions) -> CaptionIdJoin:
    """Each record with ``caption_ids`` from ``captions`` (the module's docstring: how captions are matched); a
    manifest none of whose images the files list is refused (not a COCO manifest)."""
    records = list(records)
    join = CaptionIdJoin([])
    for record in records:
        image_id = _image_of(record, captions)
        join.captions += len(record.captions)
        if image_id is None:
            join.unknown_images.append(record)
            join.unmatched += [(record.caption_key(k), c) for k, c in enumerate(record.captions)]
            join.records.append(dataclasses.replace(record, caption_ids=(None,) * len(record.captions)))
            continue
        free = list(captions.by_image[image_id])
        ids: list[int | None] = []
        for k, caption in enumerate(record.captions):
            text = normalise(caption)
            at = next((n for n, (candidate, _) in enumerate(free) if candidate == text), None)
            if at is None:
                ids.append(None)
                join.unmatched.append((record.caption_key(k), caption))
            else:
                ids.append(free.pop(at)[1])
                join.matched += 1
        join.records.append(dataclasses.replace(record, caption_ids=tuple(ids)))
    if records and len(join.unknown_images) == len(records):
        raise UserError(f"none of the manifest's {len(records):,} images is in {' or '.join(captions.files)} (first: "
                        f"{records[0].id} {records[0].path}); is it a COCO 2014 manifest?")
    return join


def _image_of(record: ManifestRecord, captions: CocoCaptions) -> int | None:
    """The COCO image of a record: by its path's file name, else by a ``coco_<id>`` id."""
    by_name = captions.by_file.get(PurePosixPath(record.path).name)
    match = _COCO_ID.fullmatch(record.id)
    by_id = int(match.group(1)) if match and int(match.group(1)) in captions.by_image else None
    if by_name is not None and match and int(match.group(1)) != by_name:
        raise UserError(f"manifest image {record.id} ({record.path}) is COCO image {by_name} by its file name but "
                        f"{match.group(1)} by its id; the manifest and the caption files disagree")
    return by_name if by_name is not None else by_id
