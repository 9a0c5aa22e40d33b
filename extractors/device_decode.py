"""Batched JPEG decoding on the extraction device (``--decode device``), with Pillow as the fallback.

Workers read bytes (:class:`EncodedReader`), :func:`decode_batch` decodes on the device; which files take which
path: docs/extraction.md ("On the GPU")."""
from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

from retr.common.errors import ParameterError
from retr.extractors.base import ImageError
from retr.extractors.images import check_aspect

#: ``--decode`` choices: ``auto`` is ``device`` when the extraction device is CUDA, else ``cpu``.
DECODE_CHOICES = ("auto", "cpu", "device")
JPEG_START = b"\xff\xd8\xff"
JPEG_END = b"\xff\xd9"
#: Pillow modes of JPEGs the device path decodes (the others keep Pillow's colour rules)
DEVICE_MODES = ("RGB", "L")
EXIF_ORIENTATION = 0x0112


def resolve_decode(decode: str, device: torch.device) -> str:
    """``cpu`` or ``device``: the decode path ``decode`` (one of :data:`DECODE_CHOICES`) gives on ``device``."""
    if decode not in DECODE_CHOICES:
        raise ParameterError(f"decode must be one of {', '.join(DECODE_CHOICES)}, not {decode!r}", "decode")
    if decode == "auto":
        return "device" if device.type == "cuda" else "cpu"
    return decode


@dataclass
class EncodedJpeg:
    """A JPEG file's bytes, ``data`` ``[n]`` uint8 (CPU), to be decoded in the main process; ``path`` for the
    Pillow retry when the decoder rejects it."""

    data: torch.Tensor
    path: str


Sample = Union[EncodedJpeg, torch.Tensor]


def device_decodable(data: bytes, exif_orientation: bool) -> bool:
    """Whether a file's bytes go to the device decoder (rules: docs/extraction.md, "On the GPU")."""
    if not data.startswith(JPEG_START) or not data.rstrip(b"\x00\r\n ").endswith(JPEG_END):
        return False
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format != "JPEG" or image.mode not in DEVICE_MODES:
                return False
            check_aspect(*image.size)
            if exif_orientation and image.getexif().get(EXIF_ORIENTATION, 1) != 1:
                return False
    except Exception:  # any refusal (ImageError included): the Pillow path says why, in its own words
        return False
    return True


@dataclass(frozen=True)
class EncodedReader:
    """Worker-side preprocessor of ``--decode device``: path → :class:`EncodedJpeg` or ``pillow(path)``."""

    pillow: Callable[[str], torch.Tensor]
    exif_orientation: bool = False

    def __call__(self, path: str) -> Sample:
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError:
            data = None   # missing, a folder, no permission: the Pillow path gives the one-line reason
        if data and device_decodable(data, self.exif_orientation):
            return EncodedJpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), os.fspath(path))
        return self.pillow(path)


@dataclass
class EncodedBatch:
    """A collated ``--decode device`` batch: :class:`EncodedJpeg` and preprocessed tensors, in batch order."""

    items: list[Sample]

    def __len__(self) -> int:
        return len(self.items)

    def pin_memory(self) -> "EncodedBatch":
        """Page-lock the preprocessed tensors (``decode_jpeg`` copies the encoded bytes itself)."""
        self.items = [item.pin_memory() if isinstance(item, torch.Tensor) else item for item in self.items]
        return self


def collate_encoded(samples: list[Sample]) -> EncodedBatch:
    """Worker-side collation of :class:`EncodedReader` results (they differ in size, so no stacking)."""
    return EncodedBatch(list(samples))


def decode_jpegs(datas: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """``decode_jpeg`` of ``[n]`` uint8 buffers in one call → ``[3, H, W]`` uint8 RGB each (None if rejected)."""
    if not datas:
        return []
    try:
        return list(decode_jpeg(list(datas), mode=ImageReadMode.RGB, device=device))
    except RuntimeError:
        out: list[torch.Tensor | None] = []
        for data in datas:
            try:
                out.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
            except RuntimeError:
                out.append(None)
        return out


def decode_batch(batch: EncodedBatch, device: torch.device, from_decoded: Callable[[torch.Tensor], torch.Tensor],
                 pillow: Callable[[str], torch.Tensor],
                 decoder: Callable[[Sequence[torch.Tensor], torch.Tensor], list] = decode_jpegs,
                 ) -> tuple[torch.Tensor | None, list[tuple[int, str]]]:
    """Decode and preprocess a batch on ``device`` → ``(inputs [B', ...] or None, failures)``.

    ``from_decoded``: ``[3, H, W]`` uint8 → one network input; ``pillow``: for images the decoder rejects;
    ``failures``: ``(item index, one-line reason)``."""
    encoded = [(i, item) for i, item in enumerate(batch.items) if isinstance(item, EncodedJpeg)]
    decoded = decoder([item.data for _, item in encoded], device)
    inputs: dict[int, torch.Tensor] = {}
    failures: list[tuple[int, str]] = []
    for (i, item), image in zip(encoded, decoded):
        if image is not None:
            inputs[i] = from_decoded(image)
            continue
        try:
            inputs[i] = pillow(item.path).to(device, non_blocking=True)
        except ImageError as exc:
            failures.append((i, str(exc) or "unusable image"))
    for i, item in enumerate(batch.items):
        if isinstance(item, torch.Tensor):
            inputs[i] = item.to(device, non_blocking=True)
    kept = sorted(inputs)
    return (torch.stack([inputs[i] for i in kept]) if kept else None), failures
