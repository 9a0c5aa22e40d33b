"""Fetching a dataset on a connected machine: images, Karpathy's splits, COCO's caption files, then the manifest
(``fetch-data``).

Steps, disk check, archives and Flickr30K's archive on request: docs/extraction.md ("Downloads: from nothing to
features"); every URL, size and checksum is in :data:`retr.common.downloads.SOURCES`."""
from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
import tarfile

from retr.common.downloads import (SOURCES, Source, ensure_free_space, fetch_source, is_offline, is_unpacked,
                                   mark_unpacked, partial_path, unpack_tar, unpack_zip, writer_lock)
from retr.common.errors import MissingResourceError, ParameterError, UserError
from retr.manifests.coco_captions import CAPTION_FILES, join_caption_ids, read_coco_captions
from retr.manifests.karpathy import read_karpathy
from retr.manifests.presets import get_preset
from retr.manifests.schema import SPLITS, write_manifest

logger = logging.getLogger(__name__)

#: datasets fetch-data knows: the split file's name inside Karpathy's zip, the image archives in order
DATASETS = {
    "coco": {"split_file": "dataset_coco.json", "archives": ("coco-val2014", "coco-train2014")},
    "f30k": {"split_file": "dataset_flickr30k.json", "archives": ()},
}
#: free space kept on top of the estimate
MARGIN_BYTES = 500_000_000


@dataclass(frozen=True)
class DataLayout:
    """Where one dataset's pieces go."""

    name: str
    images: Path
    karpathy: Path
    manifest: Path
    downloads: Path
    root: Path | None = None
    annotations: Path | None = None      #: COCO's caption files (the manifest's caption ids); None: f30k

    def command(self) -> str:
        """The fetch-data command that fills this layout (for messages)."""
        return f"retr-pipeline fetch-data {self.name}" + (f" --root {self.root}" if self.root else "")


def data_layout(name: str, root: str | os.PathLike | None = None) -> DataLayout:
    """``ROOT/{images, dataset_*.json, manifest.jsonl, downloads}`` with a root, else the preset's locations
    (``$RETR_DATA/<name>/…`` and the ``RETR_<NAME>_*`` overrides)."""
    if name not in DATASETS:
        raise ParameterError(f"fetch-data knows coco and f30k, not {name!r} (the synthetic dataset is made by "
                             f"retr-pipeline synth)", "dataset")
    if root is not None:
        root = Path(root)
        if root.exists() and not root.is_dir():
            raise ParameterError(f"root {root} is a file, not a folder", "root")
        return DataLayout(name, root / "images", root / DATASETS[name]["split_file"], root / "manifest.jsonl",
                          root / "downloads", root, root / "annotations" if name == "coco" else None)
    preset = get_preset(name)
    return DataLayout(name, preset.images, preset.karpathy, preset.manifest, preset.downloads,
                      annotations=preset.annotations)


@dataclass
class FetchSummary:
    layout: DataLayout
    images: int = 0
    splits: dict[str, int] = field(default_factory=dict)
    captions: int = 0
    caption_ids: int | None = None    # captions given their COCO caption id (None: not a COCO manifest)
    unpacked: int = 0                 # files this run unpacked
    steps: list[str] = field(default_factory=list)

    def line(self) -> str:
        counts = ", ".join(f"{split} {n}" for split, n in self.splits.items())
        ids = "" if self.caption_ids is None else f" ({self.caption_ids} with their COCO caption ids)"
        return (f"wrote {self.layout.manifest}: {self.images} images ({counts}), {self.captions} captions{ids}; "
                f"images under {self.layout.images}")


def _remaining_download(source: Source, folder: Path) -> int:
    """Bytes still to download for ``source`` into ``folder`` (0 when the archive is complete)."""
    dest = folder / source.filename
    if dest.is_file():
        return 0
    partial = partial_path(dest)
    have = partial.stat().st_size if partial.is_file() else 0
    return max(source.download_bytes - have, 0)


def plan_disk(layout: DataLayout, keep_archives: bool) -> int:
    """Bytes the rest of the fetch needs at its peak (docs/extraction.md, "Disk"), plus :data:`MARGIN_BYTES`."""
    pending = [SOURCES[key] for key in DATASETS[layout.name]["archives"]
               if not is_unpacked(layout.images, SOURCES[key], layout.images / SOURCES[key].filename.split(".")[0])]
    downloads = [_remaining_download(s, layout.downloads) for s in pending]
    unpack = sum(s.unpacked_bytes for s in pending)
    splits = 0
    if not layout.karpathy.is_file():
        source = SOURCES["karpathy-splits"]
        splits = _remaining_download(source, layout.downloads) + source.unpacked_bytes
    if layout.annotations is not None and not caption_files_present(layout):
        source = SOURCES["coco-annotations"]
        splits += _remaining_download(source, layout.downloads) + source.unpacked_bytes
    archives = sum(downloads) if keep_archives else max(downloads, default=0)
    needed = unpack + archives + splits
    return needed + MARGIN_BYTES if needed else 0


def fetch_split_file(layout: DataLayout, mirror: str | None = None, quiet: bool = False) -> Path:
    """Karpathy's split file for the dataset (downloaded, then its member unpacked with a CRC check)."""
    if layout.karpathy.is_file():
        return layout.karpathy
    source = SOURCES["karpathy-splits"]
    archive = fetch_source(source, layout.downloads, mirror=mirror, quiet=quiet,
                           what=f"Karpathy's split file {layout.karpathy.name} (in {source.filename})",
                           how=f"run {layout.command()} on a connected machine (RETR_OFFLINE is set, so retr does "
                               f"not download here), or put {layout.karpathy.name} at {layout.karpathy}")
    member = DATASETS[layout.name]["split_file"]
    unpack_zip(archive, layout.karpathy.parent, quiet=True,
               target=lambda p: PurePosixPath(layout.karpathy.name) if p.name == member else None)
    if not layout.karpathy.is_file():
        raise UserError(f"{archive} holds no {member} (is it Karpathy's caption_datasets.zip?)")
    return layout.karpathy


def caption_files_present(layout: DataLayout) -> bool:
    """Whether COCO's two caption files are in ``layout.annotations``."""
    return layout.annotations is not None and all((layout.annotations / n).is_file() for n in CAPTION_FILES)


def fetch_caption_files(layout: DataLayout, mirror: str | None = None, keep_archives: bool = False,
                        quiet: bool = False) -> Path:
    """COCO's caption files (``captions_train2014.json``, ``captions_val2014.json``) in ``layout.annotations``:
    ``annotations_trainval2014.zip`` downloaded, those two members unpacked (CRC-checked), the archive deleted
    unless ``keep_archives``."""
    if caption_files_present(layout):
        return layout.annotations
    source = SOURCES["coco-annotations"]
    archive = fetch_source(source, layout.downloads, mirror=mirror, quiet=quiet,
                           what=f"COCO's caption files (in {source.filename})",
                           how=f"run {layout.command()} on a connected machine (RETR_OFFLINE is set, so retr does "
                               f"not download here), or put {' and '.join(CAPTION_FILES)} in {layout.annotations}")
    unpack_zip(archive, layout.annotations, quiet=True,
               target=lambda p: PurePosixPath(p.name) if p.name in CAPTION_FILES else None)
    if not caption_files_present(layout):
        raise UserError(f"{archive} holds no {' and '.join(CAPTION_FILES)} (is it COCO's "
                        "annotations_trainval2014.zip?)")
    if not keep_archives:
        archive.unlink(missing_ok=True)
    return layout.annotations


def _coco_archive(layout: DataLayout, key: str, mirror: str | None, keep_archives: bool, quiet: bool) -> int:
    source = SOURCES[key]
    folder = layout.images / source.filename.split(".")[0]          # images/train2014
    if is_unpacked(layout.images, source, folder):
        return 0
    archive = fetch_source(source, layout.downloads, mirror=mirror, quiet=quiet,
                           how=f"run {layout.command()} on a connected machine (RETR_OFFLINE is set, so retr does "
                               f"not download here), or unpack {source.filename} from {source.url} into "
                               f"{layout.images}")
    summary = unpack_zip(archive, layout.images, quiet=quiet)
    mark_unpacked(layout.images, source, summary)
    if not quiet:
        logger.info(f"{source.filename}: {summary.written} files unpacked ({summary.present} already there) into "
                    f"{layout.images}")
    if not keep_archives:
        archive.unlink(missing_ok=True)
    return summary.written


def _flat_jpeg(path: PurePosixPath) -> PurePosixPath | None:
    """Flickr30K's archives hold ``flickr30k-images/NNN.jpg`` (or deeper); Karpathy's paths are bare names."""
    if path.suffix.lower() != ".jpg" or path.name.startswith("._"):
        return None
    return PurePosixPath(path.name)


def _f30k_images(layout: DataLayout, images_archive: Path | None, quiet: bool) -> int:
    source = SOURCES["f30k-images"]
    if images_archive is None:
        if is_unpacked(layout.images, source):
            return 0
        return -1                      # decided once the split file says which images are needed
    images_archive = Path(images_archive)
    if archive_kind(images_archive) == "zip":
        summary = unpack_zip(images_archive, layout.images, target=_flat_jpeg, remove_bad_archive=False,
                             quiet=quiet)
    else:
        summary = unpack_tar(images_archive, layout.images, target=_flat_jpeg, quiet=quiet)
    if summary.written + summary.present == 0:
        raise UserError(f"{images_archive} holds no .jpg images (is it the Flickr30K images archive?)")
    mark_unpacked(layout.images, source, summary)
    if not quiet:
        logger.info(f"{images_archive.name}: {summary.written} images unpacked ({summary.present} already there) "
                    f"into {layout.images}")
    return summary.written


def archive_kind(path: str | os.PathLike) -> str:
    """``zip`` or ``tar`` (plain or compressed) by the file's first bytes; a one-line error for anything else."""
    path = Path(path)
    if not path.is_file():
        raise ParameterError(f"images_archive {path} is not a file (give the Flickr30K images archive you were "
                             f"sent: a .zip or .tar.gz)", "images_archive")
    with open(path, "rb") as handle:
        head = handle.read(4)
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "zip"
    try:
        if head[:2] == b"\x1f\x8b" or tarfile.is_tarfile(path):
            return "tar"
    except (OSError, tarfile.TarError):
        pass
    raise UserError(f"{path} is neither a zip nor a tar archive (give the Flickr30K images archive you were sent)")


def fetch_dataset(name: str, root: str | os.PathLike | None = None, *, images_archive: str | os.PathLike | None = None,
                  mirror: str | None = None, keep_archives: bool = False, quiet: bool = False) -> FetchSummary:
    """Fetch ``name`` (``coco`` or ``f30k``) into its layout and write its manifest (steps: docs/extraction.md);
    each archive unpacked is one line on the ``retr`` logger unless ``quiet``."""
    layout = data_layout(name, root)
    if images_archive is not None and name != "f30k":
        raise ParameterError("images_archive is for f30k, whose images are gated; coco's are downloaded",
                             "images_archive")
    if images_archive is not None:
        archive_kind(images_archive)        # a wrong file is refused before anything is downloaded
    # one fetch per dataset at a time (e.g. every rank of a torchrun job): the others wait, then find it done
    with writer_lock(layout.downloads / "fetch"):
        return _fetch(layout, images_archive, mirror, keep_archives, quiet)


def _fetch(layout: DataLayout, images_archive: str | os.PathLike | None, mirror: str | None, keep_archives: bool,
           quiet: bool) -> FetchSummary:
    name = layout.name
    summary = FetchSummary(layout)
    if not is_offline():
        needed = plan_disk(layout, keep_archives)
        if needed:
            ensure_free_space(layout.images.parent, needed, f"fetching {name}")
    fetch_split_file(layout, mirror, quiet)
    if layout.annotations is not None:
        fetch_caption_files(layout, mirror, keep_archives, quiet)
    if name == "coco":
        for key in DATASETS["coco"]["archives"]:
            summary.unpacked += _coco_archive(layout, key, mirror, keep_archives, quiet)
    else:
        summary.unpacked = max(_f30k_images(layout, images_archive, quiet), 0)
    records = read_karpathy(layout.karpathy)
    missing = [r for r in records if not (layout.images / r.path).is_file()]
    if missing:
        if name == "f30k" and images_archive is None:
            source = SOURCES["f30k-images"]
            raise MissingResourceError(
                f"Flickr30K images ({len(missing)} of the {len(records)} in {layout.karpathy.name}, e.g. "
                f"{missing[0].path})", str(layout.images),
                f"they are handed out on request only: ask for them at {source.url}, then run "
                f"{layout.command()} --images-zip FILE with the archive you were sent")
        raise UserError(f"{len(missing)} of the {len(records)} images in {layout.karpathy.name} are missing under "
                        f"{layout.images} (e.g. {missing[0].path}); remove the .unpacked stamps there and run "
                        f"{layout.command()} again")
    if layout.annotations is not None:
        join = join_caption_ids(records, read_coco_captions([layout.annotations]))
        records = join.records
        summary.caption_ids = join.matched
        if join.matched < join.captions:
            logger.warning(f"warning: {join.summary()}")
    write_manifest(layout.manifest, records)
    counts = Counter(r.split for r in records)
    summary.images = len(records)
    summary.splits = {split: counts[split] for split in SPLITS if counts[split]}
    summary.captions = sum(len(r.captions) for r in records)
    return summary

