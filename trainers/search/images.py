"""New images embedded exactly as a run's feature set embedded its own (``docs/search.md``).

The extractor is rebuilt from the feature set's recorded attributes — its name, weights identity, and every
builder option that shapes the features (image size, grid, crops, BUTD scaling and proposals, EXIF rule,
precision) — and its output is rounded through the stored dtype, so a stored image given again as a file gets
its stored row back.
"""
from __future__ import annotations

import io
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence, Union

import numpy as np
import torch

from retr.common.errors import MissingResourceError, UserError
from retr.common.hashing import sha256_file
from retr.extractors.base import build_extractor, declared_options
from retr.extractors.batches import extracted_batches
from retr.extractors.recorded import extraction_options
from retr.store.features import FeatureSet

if TYPE_CHECKING:
    from PIL import Image

#: a raw image: a file path, the file's bytes, or a PIL image
ImageInput = Union[str, os.PathLike, bytes, "Image.Image"]
#: file suffixes a folder of images is read for
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")


@dataclass
class FolderListing:
    """What a folder of images holds: ``images`` ``[(id, path)]`` (an image suffix, :data:`IMAGE_SUFFIXES`) and
    ``others``, the paths relative to the folder of the files that are not images by their suffix (skipped)."""

    images: list[tuple[str, Path]]
    others: list[str]


def list_folder(folder: str | os.PathLike) -> FolderListing:
    """Every file under ``folder`` (recursively, sorted), images apart from other files; an image's id is its path
    relative to ``folder`` (``sub/cat.jpg``). A folder that is absent or a file: one-line :class:`UserError`."""
    folder = Path(folder)
    if not folder.is_dir():
        what = "a file" if folder.is_file() else "absent"
        raise UserError(f"{folder} is not a folder of images ({what})")
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    images = [(p.relative_to(folder).as_posix(), p) for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
    others = [p.relative_to(folder).as_posix() for p in files if p.suffix.lower() not in IMAGE_SUFFIXES]
    return FolderListing(images, others)


def no_images_error(folder: str | os.PathLike, listing: FolderListing) -> UserError:
    """The one line for a folder that holds no image file: what it holds instead."""
    if not listing.others:
        return UserError(f"{folder} holds no files, so no images to use")
    shown = ", ".join(listing.others[:3]) + (", …" if len(listing.others) > 3 else "")
    return UserError(f"{folder} holds no image files: {len(listing.others)} other file"
                     f"{'s' * (len(listing.others) != 1)} ({shown}); images end in {', '.join(IMAGE_SUFFIXES)}")


def image_files(folder: str | os.PathLike) -> list[tuple[str, Path]]:
    """``[(id, path)]`` of every image file under ``folder`` (:func:`list_folder`'s images)."""
    return list_folder(folder).images


def resolve_weights(feature_set: FeatureSet, given: str | None = None) -> str:
    """The ``weights`` option that loads the weights ``feature_set`` was made with.

    ``random`` and torchvision/timm weight names are the extractor's own (its loader finds them in the cache, or
    says in one line how to fetch them); a file recorded by its SHA-256 is ``given`` (checked against it), or
    the bottom-up-attention default checkpoint where that is the file.
    """
    recorded = str(feature_set.attrs["weights"])
    if "sha256:" not in recorded:
        if given:
            raise UserError(f"{feature_set.path} was made with the weights {recorded!r}, not a file; leave out "
                            f"extractor_weights")
        return recorded
    digest = recorded.rsplit("sha256:", 1)[1].strip()
    file_name = str(feature_set.attrs.get("weights_file") or recorded.split(" sha256:")[0])
    path = given
    if path is None and feature_set.attrs.get("extractor") == "butd-regions":
        from retr.extractors.butd.extractor import DEFAULT_CHECKPOINT, resolve_default_checkpoint  # cost: torchvision
        if file_name == DEFAULT_CHECKPOINT:
            path = resolve_default_checkpoint()        # offline and absent: one line naming fetch-weights butd
    if path is None:
        raise MissingResourceError(f"the weights file {file_name} (sha256 {digest[:12]}…) {feature_set.path} was "
                                   f"made with", "no place (a file given by hand)",
                                   "pass it with --extractor-weights PATH (Python: extractor_weights=PATH)")
    if not Path(path).is_file():
        raise UserError(f"extractor weights {path} is not a file")
    if sha256_file(path) != digest:
        raise UserError(f"{path} is not the weights file {feature_set.path} was made with (its sha256 differs "
                        f"from {digest[:12]}…)")
    return str(path)


class FeatureMaker:
    """The extractor that made ``feature_set``, rebuilt on ``device``: images → features as stored.

    ``weights``: the weights file when the set records one by hash (see :func:`resolve_weights`).
    """

    def __init__(self, feature_set: FeatureSet, device: torch.device | str = "cpu", weights: str | None = None,
                 trust_checkpoint: bool = False, batch_size: int = 8, workers: int = 0):
        name, options = extraction_options(feature_set)
        device = torch.device(device)
        options.update(device=str(device), weights=resolve_weights(feature_set, weights))
        if device.type != "cuda":       # float16 networks and device decoding need CUDA: float32, Pillow here
            options["half"] = False
            if "decode" in options:
                options["decode"] = "cpu"
        if "trust_checkpoint" in declared_options(name):
            options["trust_checkpoint"] = trust_checkpoint
        self.extractor = build_extractor(name, **options)
        self.dtype = np.dtype(feature_set.dtype)
        self.masked = "num_boxes" in feature_set.datasets
        if tuple(self.extractor.feature_shape) != tuple(feature_set.feature_shape):
            raise UserError(f"{feature_set.path}: rebuilt {name} gives {self.extractor.feature_shape} features, "
                            f"the set holds {feature_set.feature_shape}")
        self.batch_size, self.workers = batch_size, workers

    def from_paths(self, paths: Sequence[str | os.PathLike]):
        """Yield ``(positions, features [B, K, D] float32, mask [B, K] bool, failures [(position, reason)])`` per
        batch of the files ``paths``; features went through the stored dtype."""
        for done in extracted_batches(self.extractor, [str(p) for p in paths], batch_size=self.batch_size,
                                      workers=self.workers):
            if done.out is None:
                yield [], None, None, done.failures
                continue
            features = torch.from_numpy(done.out["features"].astype(self.dtype).astype(np.float32))
            if not torch.isfinite(features).all():
                raise UserError(f"the features of an image exceed {self.dtype}'s range, which the feature set "
                                f"could not have stored")
            k = features.shape[1]
            counts = done.out["num_boxes"] if self.masked else np.full(len(done.positions), k)
            mask = torch.arange(k).view(1, -1) < torch.from_numpy(np.asarray(counts, np.int64)).view(-1, 1)
            yield done.positions, features, mask, done.failures

    def __call__(self, images: Sequence[ImageInput]) -> tuple[torch.Tensor, torch.Tensor]:
        """Features ``[N, K, D]`` float32 and mask ``[N, K]`` of ``images`` (paths, bytes, PIL images); an
        image that cannot be used is one :class:`UserError` naming it and why."""
        with tempfile.TemporaryDirectory(prefix="retr-images-") as tmp:
            paths = [_as_file(image, Path(tmp) / f"{i}") for i, image in enumerate(images)]
            parts = list(self.from_paths(paths))
        failures = [f for _, _, _, fs in parts for f in fs]
        if failures:
            position, reason = failures[0]
            raise UserError(f"image {describe(images[position])} cannot be used: {reason}")
        return (torch.cat([f for _, f, _, _ in parts if f is not None]),
                torch.cat([m for _, _, m, _ in parts if m is not None]))


def describe(image: ImageInput) -> str:
    """How a query image is named in results and messages: its path, else ``<bytes>`` / ``<PIL image>``."""
    if isinstance(image, (str, os.PathLike)):
        return str(image)
    return "<bytes>" if isinstance(image, (bytes, bytearray)) else "<PIL image>"


def _as_file(image: ImageInput, stem: Path) -> str:
    """A path the extractor's own decoder reads: a path as is; bytes written out; a PIL image saved losslessly
    (PNG, or TIFF for modes PNG lacks, e.g. CMYK)."""
    if isinstance(image, (str, os.PathLike)):
        return str(image)
    if isinstance(image, (bytes, bytearray)):
        stem.write_bytes(bytes(image))
        return str(stem)
    if hasattr(image, "save") and hasattr(image, "mode"):
        buffer = io.BytesIO()
        try:
            image.save(buffer, format="PNG")
        except OSError:
            buffer = io.BytesIO()
            image.save(buffer, format="TIFF")
        stem.write_bytes(buffer.getvalue())
        return str(stem)
    raise UserError(f"an image is a file path, bytes or a PIL image, not {type(image).__name__}")
