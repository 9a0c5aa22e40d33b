"""The one image path every torchvision-backbone extractor shares: decode → RGB → resize/crop → normalise.

Runs in DataLoader workers (plain CPU work, picklable objects); a failure is an :class:`ImageError` with a one-line
reason. Colour-mode rules, EXIF and the device-decoded path: docs/extraction.md ("Decisions the code relies on")."""
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
    """Read one image file fully as an 8-bit RGB ``PIL.Image``; :class:`ImageError` for any unreadable file."""
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
    """Convert any Pillow mode to 8-bit ``RGB`` (rules: docs/extraction.md, "Colour modes")."""
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
    """The grid/map extractors' preprocessing: resized to ``size × size``; ``__call__(path)`` → ``[3, size, size]``."""

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
    """The 10-crop extractors' preprocessing (torchvision's ``ten_crop`` order); ``__call__(path)`` →
    ``[10, 3, crop, crop]`` float32."""

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
