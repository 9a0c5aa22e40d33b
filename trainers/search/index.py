"""A gallery index on disk: a run's image embeddings of a folder or manifest of images, built once and grown.

Layout of ``INDEX/`` (``docs/search.md``)::

    meta.json          format, the run and its checkpoint's sha256, model, the feature set's extraction settings
    shard-00000.pt …   {"ids": [n], "paths": [n] (absolute), "images": encode_images' {name: [n, …]},
                        "errors": [[id, reason], …]}
    .lock              held by the one process adding to the index

:meth:`GalleryIndex.add` encodes only the images whose id is in no shard (as a row or as an error), ``shard_size``
at a time; each shard is written to ``*.partial`` and renamed when complete (``meta.json`` with the first), so an
interruption loses at most the shard in progress and a re-run resumes there. An image that cannot be used is
recorded with its reason in its shard's ``errors`` and is not tried again. :class:`AddSummary` counts each kind
apart: added, already in the index, unusable now, recorded as unusable before, files that are not images. An
index left with no usable image is refused in one line (and removed again when that call began it); a folder
that is no index, another run's index or a damaged one is refused before anything is written.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from retr.common.atomic import atomic_file, atomic_text
from retr.common.errors import ParameterError, UserError
from retr.common.locks import exclusive_lock
from retr.common.progress import progress
from retr.store.features import FeatureSet
from retr.trainers.evaluation.similarity import _concat

FORMAT_VERSION = 1
SHARD_SIZE = 256
#: feature-set attributes that must agree between an index and the run searching it
IDENTITY_ATTRS = ("kind", "extractor", "backbone", "weights", "image_size", "dtype", "grid_size", "short_side",
                  "max_side", "detector_settings", "exif_orientation")


def index_identity(run: Path, checkpoint_sha256: str, model_name: str, feature_set: FeatureSet) -> dict:
    """What ``meta.json`` records and a later add or search must match (the run folder is informative only)."""
    attrs = {k: feature_set.attrs[k] for k in IDENTITY_ATTRS if k in feature_set.attrs}
    return {"format_version": FORMAT_VERSION, "run": str(Path(run).resolve()), "checkpoint_sha256": checkpoint_sha256,
            "model": model_name, "extraction": json.loads(json.dumps(attrs, default=str)),
            "feature_shape": list(map(int, feature_set.feature_shape))}


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


@dataclass
class AddSummary:
    """What one :meth:`GalleryIndex.add` did with the images it was given, each counted once."""

    encoded: int = 0                      #: images embedded and added by this call
    already: int = 0                      #: images already in the index as a row (not read again)
    errors: list[tuple[str, str]] = field(default_factory=list)   #: (id, reason) of images this call could not use
    #: (id, reason) of images an earlier call recorded as unusable (not retried)
    known_unusable: list[tuple[str, str]] = field(default_factory=list)
    #: files of the folder skipped for not being images by their suffix (relative paths)
    not_images: list[str] = field(default_factory=list)
    #: usable images the index holds after this call
    total: int = 0

    @property
    def skipped(self) -> bool:
        """Whether anything given was left out (unusable now or before, or not an image)."""
        return bool(self.errors or self.known_unusable or self.not_images)

    def skipped_text(self) -> str:
        """The skipped kinds with their counts (``1 unusable image (recorded, not retried), …``), or ""."""
        parts = []
        if self.errors:
            parts.append(_count(len(self.errors), "unusable image") + " (recorded, not retried)")
        if self.known_unusable:
            parts.append(_count(len(self.known_unusable), "image") + " recorded as unusable before (not retried)")
        if self.not_images:
            parts.append(_count(len(self.not_images), "file") + " not an image by its suffix")
        return ", ".join(parts)

    def unusable_text(self) -> str:
        """Why nothing given is usable: the count of each kind and the first reasons (``2 unusable images, 1 file
        not an image by its suffix (first: a.jpg: cannot decode image; …)``)."""
        unusable = self.errors + self.known_unusable
        parts = [_count(len(unusable), "unusable image")] if unusable else []
        if self.not_images:
            parts.append(_count(len(self.not_images), "file") + " not an image by its suffix")
        shown = [f"{i}: {r}" for i, r in unusable[:2]] or [f"{p} is not an image" for p in self.not_images[:2]]
        more = "; …" if len(unusable) > 2 or (not unusable and len(self.not_images) > 2) else ""
        return (", ".join(parts) or "nothing was given") + (f" (first: {'; '.join(shown)}{more})" if shown else "")

    def line(self, folder: Path) -> str:
        """One line: the counts of each kind."""
        skipped = self.skipped_text()
        return (f"{folder}: {_count(self.encoded, 'image')} added, {self.already} already in the index, "
                f"{self.total} usable in all" + (f"; skipped: {skipped}" if skipped else ""))

    def details(self) -> list[str]:
        """One line per skipped item: ``unusable: ID: REASON``, ``unusable before: ID: REASON``, ``not an image: PATH``."""
        return ([f"unusable: {i}: {r}" for i, r in self.errors]
                + [f"unusable before: {i}: {r}" for i, r in self.known_unusable]
                + [f"not an image: {p}" for p in self.not_images])


class GalleryIndex:
    """The index folder ``folder`` (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        meta = self.folder / "meta.json"
        try:
            self.meta = json.loads(meta.read_text(encoding="utf-8")) if meta.is_file() else None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"{meta} is damaged ({type(exc).__name__}); it is no gallery index retr wrote") from None
        if self.meta is not None and not isinstance(self.meta, dict):
            raise UserError(f"{meta} is no gallery index retr wrote (not a JSON object)")

    def check(self, identity: dict) -> None:
        """Refuse in one line an index built with another checkpoint, model or extraction."""
        if self.meta is None:
            what = ("absent" if not self.folder.exists() else "a file" if not self.folder.is_dir() else "no meta.json")
            raise UserError(f"{self.folder} is not a gallery index ({what}); build one with retr-train index")
        for key in ("checkpoint_sha256", "model", "extraction", "feature_shape"):
            if self.meta.get(key) != identity[key]:
                what = {"checkpoint_sha256": "checkpoint", "model": "model", "extraction": "feature extraction",
                        "feature_shape": "feature shape"}[key]
                raise UserError(f"{self.folder} was built with another {what} (run {self.meta.get('run')}, "
                                f"checkpoint sha256 {str(self.meta.get('checkpoint_sha256'))[:12]}…); search it with "
                                f"that run, or give another --out to index with this one")

    def check_can_add(self, identity: dict) -> None:
        """Refuse in one line, before any work, adding to ``folder`` when it is a file, a folder of other files (no
        ``meta.json``), an index of another checkpoint, model or extraction (:meth:`check`) or one with a damaged
        shard."""
        if self.folder.exists() and not self.folder.is_dir():
            raise UserError(f"{self.folder} is a file, not a gallery index folder; give a new or empty folder")
        if self.meta is None:
            others = [p.name for p in self.folder.iterdir() if p.name != ".lock"] if self.folder.is_dir() else []
            if any(n.startswith("shard-") for n in others):
                raise UserError(f"{self.folder} holds shards but no meta.json; give another --out")
            if others:
                raise UserError(f"{self.folder} is not a gallery index (no meta.json) and holds other files (e.g. "
                                f"{sorted(others)[0]}); give a new or empty folder")
            return
        self.check(identity)
        self.known()

    def shard_paths(self) -> list[Path]:
        return sorted(self.folder.glob("shard-*.pt"))

    def _shards(self, device: torch.device | str = "cpu", mmap: bool = False):
        for path in self.shard_paths():
            try:
                shard = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
                if not isinstance(shard, dict) or not {"ids", "images", "errors"} <= set(shard):
                    raise ValueError("not a shard")
            except Exception as exc:  # noqa: BLE001 - truncated or foreign file
                raise UserError(f"{path} is damaged ({type(exc).__name__}); delete it and run retr-train index "
                                f"again to re-encode its images") from None
            yield shard

    def known(self) -> tuple[set[str], dict[str, str]]:
        """``(ids of the images held as rows, {id: reason} of those recorded as unusable)``."""
        rows, errors = set(), {}
        for shard in self._shards(mmap=True):
            rows.update(shard["ids"])
            errors.update((e[0], e[1]) for e in shard["errors"])
        return rows, errors

    def image_paths(self) -> dict[str, Path]:
        """Each indexed image's file, as it was read when it was added."""
        return {i: Path(p) for s in self._shards(mmap=True) for i, p in zip(s["ids"], s["paths"])}

    def load(self, device: torch.device | str = "cpu") -> tuple[list[str], dict, list[tuple[str, str]]]:
        """``(ids [N], embeddings {name: [N, …]}, errors [(id, reason)])`` of the whole index."""
        ids, parts, errors = [], [], []
        for shard in self._shards(device):
            if shard["ids"]:
                ids += shard["ids"]
                parts.append(shard["images"])
            errors += [tuple(e) for e in shard["errors"]]
        if not ids:
            raise UserError(f"{self.folder} holds no usable image yet; add some with retr-train index")
        return ids, _concat(parts), errors

    def add(self, items: Sequence[tuple[str, str | os.PathLike]], identity: dict, encode, *,
            shard_size: int = SHARD_SIZE, quiet: bool = True, not_images: Sequence[str] = (),
            source: str | os.PathLike | None = None) -> AddSummary:
        """Encode the ``items`` ``[(id, path)]`` not in the index yet and write them as new shards.

        ``encode(paths)`` yields ``(positions, embeddings {name: [B, …]}, failures [(position, reason)])`` per
        batch (:meth:`Retriever.encode_files`). ``meta.json`` is written with the first shard; a folder that
        already has one must match ``identity`` (:meth:`check`). ``not_images``: files of the folder skipped for
        not being images, counted in the summary; ``source``: what the items came from, as errors name it
        (default: the index folder).

        When the index ends with no usable image, one :class:`UserError` says why (the count of each kind and
        the first reasons); an index this call began is then removed again, so nothing is recorded as unusable
        and a later call tries every image anew.
        """
        if shard_size < 1:
            raise ParameterError(f"shard_size must be at least 1, not {shard_size}", "shard_size")
        ids = [i for i, _ in items]
        if len(set(ids)) != len(ids):
            raise UserError(f"image ids repeat in what was given to index (e.g. "
                            f"{next(i for i in ids if ids.count(i) > 1)!r})")
        self.check_can_add(identity)
        made_folder = not self.folder.exists()
        written: list[Path] = []
        try:
            with exclusive_lock(self.folder / ".lock", f"the index {self.folder}"):
                began = self.meta is None
                summary = self._add_locked(items, identity, encode, shard_size, quiet, not_images, written)
                if summary.total == 0:
                    if began:                               # leave no index of nothing behind
                        for path in [*written, self.folder / "meta.json"]:
                            path.unlink(missing_ok=True)
                        self.meta = None
                    raise UserError(f"{source or self.folder}: no usable image to index: {summary.unusable_text()}")
        except BaseException:
            if made_folder and self.folder.is_dir() and {p.name for p in self.folder.iterdir()} <= {".lock"}:
                (self.folder / ".lock").unlink(missing_ok=True)
                self.folder.rmdir()                         # a folder this call made, holding nothing
            raise
        return summary

    def _add_locked(self, items, identity, encode, shard_size, quiet, not_images, written) -> AddSummary:
        """:meth:`add` with the lock held; the paths of the shards it writes are appended to ``written``."""
        self.check_can_add(identity)                        # again, now that no other process can write
        rows, recorded = self.known()
        todo = [(i, p) for i, p in items if i not in rows and i not in recorded]
        summary = AddSummary(already=sum(i in rows for i, _ in items),
                             known_unusable=[(i, recorded[i]) for i, _ in items if i in recorded and i not in rows],
                             not_images=list(not_images))
        number = 1 + max((int(p.stem.split("-")[1]) for p in self.shard_paths()), default=-1)
        with progress(total=len(todo), desc="index images", unit="img", quiet=quiet) as bar:
            for start in range(0, len(todo), shard_size):
                chunk = todo[start:start + shard_size]
                got, paths, parts, errors = [], [], [], []
                for positions, embeddings, failures in encode([p for _, p in chunk]):
                    got += [chunk[p][0] for p in positions]
                    paths += [str(Path(chunk[p][1]).resolve()) for p in positions]
                    if positions:
                        parts.append({k: (v.float() if v.is_floating_point() else v).cpu()
                                      for k, v in embeddings.items()})
                    errors += [[chunk[p][0], reason] for p, reason in failures]
                    bar.update(len(positions) + len(failures))
                if self.meta is None:                       # a new index: its identity with its first shard
                    with atomic_text(self.folder / "meta.json") as f:
                        json.dump(identity, f, indent=1)
                    self.meta = identity
                path = self.folder / f"shard-{number:05d}.pt"
                with atomic_file(path) as partial:
                    torch.save({"ids": got, "paths": paths, "images": _concat(parts) if parts else {},
                                "errors": errors}, partial)
                written.append(path)
                number += 1
                summary.encoded += len(got)
                summary.errors += [tuple(e) for e in errors]
        summary.total = len(rows) + summary.encoded
        return summary

