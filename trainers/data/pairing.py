"""Features against a manifest: whether a manifest's ids name the images a feature set was made from.

A feature set records the SHA-256 of the manifest it was extracted from and its ids, not each image's path or
content; :func:`check_manifest_pairing` finds that manifest (:func:`find_source_manifest`) and compares the
images both name (docs/trainer.md, "Checks before any work")."""
from __future__ import annotations

import os
from pathlib import Path
import filecmp

from retr.common.errors import UserError
from retr.common.progress import progress
from retr.manifests.schema import manifest_sha256, read_manifest
from retr.store.features import FeatureSet

#: folders searched for the manifest a feature set was made from, as levels above the feature file: its own
#: folder, the extraction's ``--out`` and the dataset folder above it (``data/f30k/features/E.h5`` was made from
#: ``data/f30k/manifest.jsonl`` in the layout the README and ``make extract`` use)
SOURCE_MANIFEST_LEVELS = 3
#: at most this many candidate manifests are hashed when looking for the one a feature set was made from
SOURCE_MANIFEST_CANDIDATES = 64
#: image files of shared ids compared byte for byte (evenly spaced over the ids) when two manifests give an id the
#: same relative path in different folders; sizes are compared for every id
COMPARED_IMAGE_FILES = 256


def _is_sha256(value) -> bool:
    """A recorded manifest digest that names a manifest: 64 hex digits, not all zeros (the placeholder of sets
    written without a manifest, such as synthetic test sets; importers record a sentence instead)."""
    return (isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
            and value != "0" * 64)


def find_source_manifest(features_path: str | os.PathLike, manifest: str | os.PathLike,
                         recorded_sha256: str) -> str | None:
    """The manifest file whose SHA-256 is ``recorded_sha256`` (the one a feature set was made from), looked for
    among the ``*.jsonl`` files of the feature file's folder and the :data:`SOURCE_MANIFEST_LEVELS` − 1 folders
    above it, and of ``manifest``'s folder; None when none is."""
    folders, here = [], Path(features_path).resolve().parent
    for _ in range(SOURCE_MANIFEST_LEVELS):
        folders.append(here)
        here = here.parent
    folders.append(Path(manifest).resolve().parent)
    given = Path(manifest).resolve()
    seen: set = set()
    for folder in dict.fromkeys(folders):
        try:
            candidates = sorted(p for p in folder.glob("*.jsonl") if p.is_file())
        except OSError:
            continue
        for path in candidates:
            if path.resolve() == given or path in seen:
                continue
            seen.add(path)
            if len(seen) > SOURCE_MANIFEST_CANDIDATES:
                return None
            try:
                if manifest_sha256(path) == recorded_sha256:
                    return str(path)
            except OSError:
                continue
    return None


def _different_image(first: str, second: str) -> bool:
    """Whether two image files that both exist hold other bytes (the same file, or equal bytes: False)."""
    if os.path.samefile(first, second):
        return False
    return not filecmp.cmp(first, second, shallow=False)


def check_manifest_pairing(features: FeatureSet, manifest: str | os.PathLike) -> list[str]:
    """Refuse (one line) a ``manifest`` whose ids name other images than the ones ``features`` was made from;
    return the notes to print when it differs otherwise.

    A feature set records the SHA-256 of the manifest it was extracted from (``manifest_sha256``) and its ids,
    not each image's path or content. So: the same SHA-256 (or none recorded: an import, :func:`_is_sha256`) is
    the same data. Else
    the manifest it was made from is looked for by its SHA-256 (:func:`find_source_manifest`); found, every
    shared id must have the same image there and in ``manifest`` — the same relative path, and, where both
    manifests' images are on disk (paths relative to each manifest's folder), the same size and, for up to
    :data:`COMPARED_IMAGE_FILES` ids, the same bytes. Same images with other captions or splits: one note, and
    the captions of ``manifest`` are used. Not found: one note that the images cannot be compared."""
    recorded = features.attrs.get("manifest_sha256")
    if not _is_sha256(recorded):
        return []
    given = manifest_sha256(manifest)
    if given == recorded:
        return []
    records = [r for r in read_manifest(manifest) if r.id in features]
    if not records:
        return []                     # no shared id: the split loaders refuse (no image has features)
    source = find_source_manifest(features.path, manifest, recorded)
    if source is None:
        return [f"{features.path} was made from another manifest than {manifest} (sha256 {recorded[:12]}…, not "
                f"found beside the features or the manifest), so whether its {len(records)} shared ids name the "
                "same images cannot be checked; put the manifest it was made from beside it, or re-extract"]
    original = {r.id: r for r in read_manifest(source)}
    moved = [(r, original[r.id]) for r in records if r.id in original and r.path != original[r.id].path]
    if moved:
        new, old = moved[0]
        raise UserError(f"{manifest} names other images than {features.path} was made from ({source}): "
                        f"{len(moved)} shared id(s) have another path (first: {new.id} is {new.path} here, "
                        f"{old.path} there); give the manifest the features were made from, or re-extract")
    here, there = Path(manifest).resolve().parent, Path(source).resolve().parent
    pairs = [(r.id, str(here / r.path), str(there / original[r.id].path)) for r in records if r.id in original]
    # two file-system look-ups an id (COCO's 123,287 take a while on a network file system): shown as it goes
    pairs = [p for p in progress(pairs, desc="pairing check: image sizes", unit="image")
             if os.path.isfile(p[1]) and os.path.isfile(p[2])]
    differ = [p for p in pairs if os.path.getsize(p[1]) != os.path.getsize(p[2])]
    if not differ and pairs:
        step = max(1, len(pairs) // COMPARED_IMAGE_FILES)
        differ = [p for p in pairs[::step][:COMPARED_IMAGE_FILES] if _different_image(p[1], p[2])]
    if differ:
        raise UserError(f"{manifest} names other images than {features.path} was made from ({source}): "
                        f"{len(differ)} shared id(s) are other image files (first: {differ[0][0]}, {differ[0][1]} "
                        f"≠ {differ[0][2]}); give the manifest the features were made from, or re-extract")
    changed = sum(r.captions != original[r.id].captions for r in records if r.id in original)
    resplit = sum(r.split != original[r.id].split for r in records if r.id in original)
    return [f"{manifest} is not the manifest {features.path} was made from ({source}), but its {len(records)} "
            f"shared ids name the same images; {changed} have other captions and {resplit} another split: "
            f"using {manifest}'s"]
