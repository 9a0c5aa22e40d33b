"""A gallery index on disk: a run's image embeddings of a folder or manifest of images, built once and grown.

Layout of ``INDEX/`` (``docs/search.md``)::

    meta.json          format, the run and its checkpoint's sha256, model, the feature set's extraction settings
    shard-00000.pt …   {"ids": [n], "paths": [n] (absolute), "images": encode_images' {name: [n, …]},
                        "errors": [[id, reason], …]}
    .lock              held by the one process adding to the index

:meth:`GalleryIndex.add` encodes only the images whose id is in no shard (as a row or as an error), ``shard_size``
at a time; each shard is written to ``*.partial`` and renamed when complete, so an interruption loses at most the
shard in progress and a re-run resumes there. An image that cannot be used is recorded with its reason in its
shard's ``errors`` and is not tried again.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from retr.common.atomic import atomic_file, atomic_text
from retr.common.errors import UserError
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


@dataclass
class AddSummary:
    encoded: int = 0                      #: images embedded by this call
    already: int = 0                      #: images found in the index (rows or recorded errors)
    errors: list[tuple[str, str]] = field(default_factory=list)   #: (id, reason) of images this call could not use

    def line(self, folder: Path) -> str:
        bad = f", {len(self.errors)} unusable (recorded, not retried)" if self.errors else ""
        return f"{folder}: {self.encoded} images encoded, {self.already} already in the index{bad}"


class GalleryIndex:
    """The index folder ``folder`` (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        meta = self.folder / "meta.json"
        self.meta = json.loads(meta.read_text()) if meta.is_file() else None

    def check(self, identity: dict) -> None:
        """Refuse in one line an index built with another checkpoint, model or extraction."""
        if self.meta is None:
            raise UserError(f"{self.folder} is not a gallery index (no meta.json); build one with retr-train index")
        for key in ("checkpoint_sha256", "model", "extraction", "feature_shape"):
            if self.meta.get(key) != identity[key]:
                what = {"checkpoint_sha256": "checkpoint", "model": "model", "extraction": "feature extraction",
                        "feature_shape": "feature shape"}[key]
                raise UserError(f"{self.folder} was built with another {what} (run {self.meta.get('run')}, "
                                f"checkpoint sha256 {str(self.meta.get('checkpoint_sha256'))[:12]}…); search it with "
                                f"that run, or give another --out to index with this one")

    def shard_paths(self) -> list[Path]:
        return sorted(self.folder.glob("shard-*.pt"))

    def _shards(self, device: torch.device | str = "cpu", mmap: bool = False):
        for path in self.shard_paths():
            try:
                yield torch.load(path, map_location=device, weights_only=True, mmap=mmap)
            except Exception as exc:  # noqa: BLE001 - truncated or foreign file
                raise UserError(f"{path} is damaged ({type(exc).__name__}); delete it and run retr-train index "
                                f"again to re-encode its images") from None

    def known_ids(self) -> set[str]:
        """Ids of every image in a shard, as a row or as an error."""
        return {i for s in self._shards(mmap=True) for i in [*s["ids"], *(e[0] for e in s["errors"])]}

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
            shard_size: int = SHARD_SIZE, quiet: bool = True) -> AddSummary:
        """Encode the ``items`` ``[(id, path)]`` not in the index yet and write them as new shards.

        ``encode(paths)`` yields ``(positions, embeddings {name: [B, …]}, failures [(position, reason)])`` per
        batch (:meth:`Retriever.encode_files`). The first call writes ``meta.json``; later ones must match
        ``identity`` (:meth:`check`).
        """
        if shard_size < 1:
            raise UserError(f"--shard-size must be at least 1, not {shard_size}")
        with exclusive_lock(self.folder / ".lock", f"the index {self.folder}"):
            if self.meta is None:
                if self.shard_paths():
                    raise UserError(f"{self.folder} holds shards but no meta.json; give another --out")
                with atomic_text(self.folder / "meta.json") as f:
                    json.dump(identity, f, indent=1)
                self.meta = identity
            self.check(identity)
            seen = self.known_ids()
            ids = [i for i, _ in items]
            if len(set(ids)) != len(ids):
                raise UserError(f"image ids repeat in what was given to index (e.g. "
                                f"{next(i for i in ids if ids.count(i) > 1)!r})")
            todo = [(i, p) for i, p in items if i not in seen]
            summary = AddSummary(already=len(items) - len(todo))
            number = 1 + max((int(p.stem.split("-")[1]) for p in self.shard_paths()), default=-1)
            with progress(total=len(todo), desc="index images", unit="img", quiet=quiet) as bar:
                for start in range(0, len(todo), shard_size):
                    chunk = todo[start:start + shard_size]
                    rows, paths, parts, errors = [], [], [], []
                    for positions, embeddings, failures in encode([p for _, p in chunk]):
                        rows += [chunk[p][0] for p in positions]
                        paths += [str(Path(chunk[p][1]).resolve()) for p in positions]
                        if positions:
                            parts.append({k: (v.float() if v.is_floating_point() else v).cpu()
                                          for k, v in embeddings.items()})
                        errors += [[chunk[p][0], reason] for p, reason in failures]
                        bar.update(len(positions) + len(failures))
                    path = self.folder / f"shard-{number:05d}.pt"
                    with atomic_file(path) as partial:
                        torch.save({"ids": rows, "paths": paths, "images": _concat(parts) if parts else {}, "errors": errors}, partial)
                    number += 1
                    summary.encoded += len(rows)
                    summary.errors += [tuple(e) for e in errors]
        return summary
