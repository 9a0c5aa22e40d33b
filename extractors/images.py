"""The one image path every torchvision-backbone extractor shares: decode → RGB → resize/crop → normalise.

Runs in DataLoader worker processes, so everything here is plain CPU work on one file and the objects are
small and picklable (no network inside).

Decoding uses Pillow (``Image.open`` + ``load()``, which reads the whole file so truncation shows up here and
not later). Any failure to read or decode becomes :class:`~retr.extractors.base.ImageError` with a one-line
reason — the extraction stage records it in the feature set's ``errors`` and goes on.

Colour modes (:func:`to_rgb`), chosen so that every file a dataset may contain gives a sensible RGB image:

* ``RGB`` as is; ``L``/``1``/``P``/``YCbCr``/``LAB``/``HSV``/``CMYK`` through Pillow's own conversion (Pillow
  un-inverts Adobe CMYK JPEGs when it reads them);
* transparency (``RGBA``, ``LA``, ``PA``, ``P`` with a ``transparency`` entry) is composited over a background
  colour (white by default) rather than dropped, because the colour stored under fully transparent pixels is
  arbitrary (often black) and is never what the image shows;
* 16-bit and 32-bit integer grayscale (``I;16*``, ``I``) is scaled from 0..65535 to 0..255 (Pillow's own
  ``convert`` clips every value above 255 to white); ``I`` images whose values all fit 0..255 are kept as is;
* 32-bit float grayscale (``F``) is read as 0..1 when its maximum is ≤ 1, else as 0..255, and clipped.

EXIF orientation is **not** applied by default: the published feature sets (and torchvision's ImageFolder
pipelines of that time) read pixels as stored. ``exif_orientation=True`` rotates/flips by the EXIF tag
(``ImageOps.exif_transpose``); the choice is recorded in the feature set's attributes.

Each preprocessing object also has :meth:`from_decoded`, the same resize and normalisation as tensor ops
(``torchvision.transforms.v2.functional``) on an image that was decoded elsewhere — ``decode_jpeg`` on the
extraction device (:mod:`retr.extractors.device_decode`). Both paths resize 8-bit pixels (bilinear,
antialiased) and round back to 8 bits before scaling to 0..1, as Pillow does; agreement is measured in
``tests/test_device_decode.py``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torchvision.transforms.functional as TF
import torchvision.transforms.v2.functional as TV2
from PIL import Image, ImageOps, UnidentifiedImageError
from torchvision.transforms import InterpolationMode

from retr.extractors.base import ImageError

#: ImageNet channel statistics (RGB, 0..1 scale) that torchvision's classification weights are trained with.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: An image whose long side exceeds this many times its short side is refused: resizing its short side to
#: 256 would make a multi-gigabyte tensor (e.g. a 1×5000 strip), and no crop of it shows the scene.
MAX_ASPECT_RATIO = 100.0


def decode_image(path: str | os.PathLike, exif_orientation: bool = False,
                 background: tuple[int, int, int] = (255, 255, 255)) -> Image.Image:
    """Read one image file fully and return it as an 8-bit RGB ``PIL.Image``.

    Raises :class:`ImageError` (one-line reason) for a missing, empty, unreadable, truncated or non-image file
    and for a decompression bomb (Pillow's pixel limit).
    """
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise ImageError("file not found") from None
    except OSError as exc:
        raise ImageError(f"cannot stat file ({exc.strerror or exc})") from None
    if os.path.isdir(path):
        raise ImageError("is a directory, not an image file")
    if size == 0:
        raise ImageError("empty file (0 bytes)")
    try:
        with Image.open(path) as image:
            image.load()
            if exif_orientation:
                image = ImageOps.exif_transpose(image)
            rgb = to_rgb(image, background)
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError("not an image (Pillow cannot identify the file format)") from None
    except Image.DecompressionBombError as exc:
        raise ImageError(f"too many pixels ({exc})") from None
    except PermissionError:
        raise ImageError("permission denied") from None
    except Exception as exc:  # corrupt files raise many types from Pillow's plugins (OSError, SyntaxError, …)
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ImageError(f"cannot decode image: {message}") from None
    width, height = rgb.size
    if width < 1 or height < 1:
        raise ImageError(f"image has no pixels ({width}×{height})")
    return rgb


def to_rgb(image: Image.Image, background: tuple[int, int, int] = (255, 255, 255)) -> Image.Image:
    """Convert any Pillow mode to 8-bit ``RGB`` (rules in the module docstring)."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode.startswith("I;16") or mode == "I":
        values = np.asarray(image, dtype=np.float64)
        if mode.startswith("I;16") or values.max(initial=0) > 255:
            values = values * (255.0 / 65535.0)
        gray = np.clip(np.rint(values), 0, 255).astype(np.uint8)
        return Image.fromarray(gray, mode="L").convert("RGB")
    if mode == "F":
        values = np.asarray(image, dtype=np.float64)
        scale = 255.0 if values.size and np.nanmax(values) <= 1.0 else 1.0
        gray = np.clip(np.rint(np.nan_to_num(values * scale)), 0, 255).astype(np.uint8)
        return Image.fromarray(gray, mode="L").convert("RGB")
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or (mode == "P" and "transparency" in image.info)
    if has_alpha:
        rgba = image.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (*background, 255))
        return Image.alpha_composite(canvas, rgba).convert("RGB")
    return image.convert("RGB")


def to_normalized_tensor(image: Image.Image, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """``[3, H, W]`` float32: pixel values scaled to 0..1, then ``(x - mean) / std`` per channel."""
    return TF.normalize(TF.to_tensor(image), list(mean), list(std))


def normalize_uint8(image: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Tensor twin of :func:`to_normalized_tensor`: ``[..., 3, H, W]`` uint8 → float32 ``(x/255 - mean) / std``."""
    return TV2.normalize(TV2.to_dtype(image, torch.float32, scale=True), list(mean), list(std))


def check_aspect(width: int, height: int) -> None:
    """Raise :class:`ImageError` for an image beyond ``MAX_ASPECT_RATIO`` (or without pixels)."""
    if width < 1 or height < 1:
        raise ImageError(f"image has no pixels ({width}×{height})")
    ratio = max(width, height) / min(width, height)
    if ratio > MAX_ASPECT_RATIO:
        raise ImageError(f"aspect ratio {ratio:.0f}:1 ({width}×{height}) beyond {MAX_ASPECT_RATIO:.0f}:1")


@dataclass(frozen=True)
class SquareResize:
    """Preprocessing of the grid and map extractors: the whole image resized to ``size × size`` (aspect not kept).

    SMAN and JGCAR both "resize images to 448 × 448" before the network; bilinear with antialiasing (Pillow's
    resampling filter) is used. ``__call__(path)`` returns ``[3, size, size]`` float32.
    """

    size: int
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    exif_orientation: bool = False

    def __call__(self, path: str) -> torch.Tensor:
        image = decode_image(path, self.exif_orientation)
        check_aspect(*image.size)
        image = TF.resize(image, [self.size, self.size], interpolation=InterpolationMode.BILINEAR, antialias=True)
        return to_normalized_tensor(image, self.mean, self.std)

    def from_decoded(self, image: torch.Tensor) -> torch.Tensor:
        """The same resize and normalisation as tensor ops: ``[3, H, W]`` uint8 RGB on any device →
        ``[3, size, size]`` float32 on that device."""
        image = TV2.resize(image, [self.size, self.size], interpolation=InterpolationMode.BILINEAR, antialias=True)
        return normalize_uint8(image, self.mean, self.std)


@dataclass(frozen=True)
class TenCrop:
    """Preprocessing of the 10-crop extractors: short side resized to ``resize``, then ten ``crop`` squares.

    The crops are torchvision's ``ten_crop`` order: top-left, top-right, bottom-left, bottom-right, centre, then
    the same five of the horizontally flipped image. ``__call__(path)`` returns ``[10, 3, crop, crop]`` float32.
    """

    crop: int = 224
    resize: int = 256
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    exif_orientation: bool = False

    def __call__(self, path: str) -> torch.Tensor:
        image = decode_image(path, self.exif_orientation)
        check_aspect(*image.size)
        image = TF.resize(image, [self.resize], interpolation=InterpolationMode.BILINEAR, antialias=True)
        tensor = to_normalized_tensor(image, self.mean, self.std)
        return torch.stack(TF.ten_crop(tensor, [self.crop, self.crop]))

    def from_decoded(self, image: torch.Tensor) -> torch.Tensor:
        """The same resize, normalisation and crops as tensor ops: ``[3, H, W]`` uint8 RGB on any device →
        ``[10, 3, crop, crop]`` float32 on that device."""
        image = TV2.resize(image, [self.resize], interpolation=InterpolationMode.BILINEAR, antialias=True)
        tensor = normalize_uint8(image, self.mean, self.std)
        return torch.stack(TV2.ten_crop(tensor, [self.crop, self.crop]))


def tencrop_resize_for(crop: int) -> int:
    """The short side to resize to before taking ``crop``-pixel crops: 256 for 224, the same ratio otherwise."""
    return int(round(crop * 256 / 224))
