"""Caffe preprocessing of the bottom-up-attention model (``prep_im_for_blob`` / ``_get_image_blob``) with OpenCV.

BGR uint8 → float32 minus the pixel means → short side 600, long side ≤ 1000, bilinear; ``exif=False`` reads pixels
as stored, like the original (docs/butd.md, "Settings")."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from retr.common.optional import require
from retr.extractors.base import ImageError

#: BGR means subtracted from 0–255 pixels (Caffe ``cfg.PIXEL_MEANS``)
PIXEL_MEANS_BGR = (102.9801, 115.9465, 122.7717)
SHORT_SIDE = 600
MAX_SIDE = 1000


@dataclass
class CaffeImage:
    """One preprocessed image: ``pixels`` ``[3, H', W']`` float32 BGR, mean-subtracted, resized by ``scale``."""

    pixels: torch.Tensor
    scale: float
    original_hw: tuple[int, int]


def opencv():
    """OpenCV (the ``pipeline`` extra), imported on first use."""
    return require("cv2", "pipeline", "the butd-regions extractor")


def caffe_scale(height: int, width: int, short_side: int = SHORT_SIDE, max_side: int = MAX_SIDE) -> float:
    """``short_side / min(h, w)``, unless ``round(scale · max(h, w)) > max_side``: then ``max_side / max(h, w)``."""
    scale = float(short_side) / float(min(height, width))
    if np.round(scale * max(height, width)) > max_side:
        scale = float(max_side) / float(max(height, width))
    return scale


def read_bgr(path: str | Path, exif: bool = False) -> np.ndarray:
    """Decode an image file into ``[H, W, 3]`` uint8 BGR; :class:`ImageError` with a reason if it cannot be used.

    Grayscale, palette, CMYK and alpha images are converted to 3-channel BGR by OpenCV. A JPEG that lacks its
    end-of-image marker is refused as truncated (libjpeg would silently grey out the missing part)."""
    try:
        data = np.fromfile(str(path), dtype=np.uint8)
    except FileNotFoundError:
        raise ImageError("file not found") from None
    except OSError as exc:
        raise ImageError(f"cannot read file ({exc.strerror or exc})") from None
    if data.size == 0:
        raise ImageError("empty file")
    cv2 = opencv()
    raw = data.tobytes()
    if raw[:2] == b"\xff\xd8" and raw.rstrip(b"\x00")[-2:] != b"\xff\xd9":
        raise ImageError("truncated JPEG (no end-of-image marker)")
    flags = cv2.IMREAD_COLOR if exif else cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION
    image = cv2.imdecode(data, flags)
    if image is None:
        raise ImageError("cannot decode image (not an image file, or a format OpenCV cannot read)")
    if image.ndim != 3 or image.shape[2] != 3 or min(image.shape[:2]) < 1:
        raise ImageError(f"unexpected decoded shape {image.shape}")
    return image


def preprocess_bgr(image: np.ndarray, short_side: int = SHORT_SIDE, max_side: int = MAX_SIDE) -> CaffeImage:
    """``[H, W, 3]`` uint8 BGR → :class:`CaffeImage` (mean subtraction, then bilinear resize)."""
    cv2 = opencv()
    height, width = image.shape[:2]
    scale = caffe_scale(height, width, short_side, max_side)
    pixels = image.astype(np.float32) - np.asarray(PIXEL_MEANS_BGR, dtype=np.float32)
    pixels = cv2.resize(pixels, None, None, fx=scale, fy=scale, interpolation=cv2.INTER_LINEAR)
    if pixels.ndim == 2:  # OpenCV drops the channel axis of 1×1 results only for 1 channel; kept for safety
        pixels = pixels[:, :, None]
    tensor = torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))
    return CaffeImage(tensor, scale, (height, width))


def load_caffe_image(path: str | Path, short_side: int = SHORT_SIDE, max_side: int = MAX_SIDE,
                     exif: bool = False) -> CaffeImage:
    """Read and preprocess one image file (runs in DataLoader workers)."""
    return preprocess_bgr(read_bgr(path, exif=exif), short_side, max_side)
