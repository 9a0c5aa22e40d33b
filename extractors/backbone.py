"""What the backbone extractors share: weights, one layer's output, device and precision.

A subclass reshapes the kept node's output into ``[B, K, D]`` (:meth:`BackboneExtractor.to_features`). The cut, the
recorded options and the CPU pass size: docs/extraction.md ("Decisions the code relies on")."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torchvision.models.feature_extraction import create_feature_extractor

from retr.common.devices import float32_arithmetic, resolve_device as resolve_common_device
from retr.common.errors import ParameterError
from retr.extractors.base import Extractor
from retr.extractors.device_decode import EncodedBatch, EncodedReader, collate_encoded, decode_batch, resolve_decode
from retr.extractors.weights import LoadedWeights, build_backbone

#: ``builder(arch, weights, unused_prefixes, **random_options) -> (model, LoadedWeights)``
ModelBuilder = Callable[..., tuple[nn.Module, LoadedWeights]]

CPU_PIXELS_PER_PASS = 448 * 448   # input pixels per network call on CPU (see BackboneExtractor.run_network)
#: ``autocast`` choices → the autocast dtype (``None``: no autocast)
AUTOCAST_DTYPES = {"none": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device, half: bool) -> torch.device:
    """:func:`retr.common.devices.resolve_device`, plus the extractors' own check: ``half`` only on CUDA."""
    device = resolve_common_device(device)
    if half and device.type != "cuda":
        raise ParameterError("half needs device cuda (half-precision convolutions are slow or missing on CPU)",
                             "half", "device")
    return device


class WholeModel(nn.Module):
    """A model that already ends at the kept layer, answering like a cut one: ``{"out": model(x)}``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": self.model(x)}


class BackboneExtractor(Extractor):
    """An extractor made of one network cut at one node, fed by a preprocessing object.

    ``arch``/``node`` (e.g. ``resnet152``/``layer4``); ``weights``: ``imagenet`` | enum name | ``random`` | path;
    ``preprocess((mean, std))`` builds the worker-side preprocessing; ``unused_prefixes``: parameters the cut never
    uses; ``random_options``: builder options for ``random`` only; ``builder``: torchvision's or timm's; ``cut``:
    False when the builder's model already ends at ``node``."""

    backbone: str

    def __init__(self, *, arch: str, node: str, weights: str,
                 preprocess: Callable[[tuple, tuple], Callable[[str], torch.Tensor]],
                 unused_prefixes: tuple[str, ...] = (), random_options: dict | None = None,
                 device: str | torch.device = "cpu", half: bool = False, builder: ModelBuilder = build_backbone,
                 cut: bool = True, decode: str = "auto", autocast: str = "none", channels_last: bool = False,
                 tf32: bool = False):
        self.backbone = arch
        self.node = node
        self.half = bool(half)
        if autocast not in AUTOCAST_DTYPES:
            raise ParameterError(f"autocast must be one of {', '.join(AUTOCAST_DTYPES)}, not {autocast!r}",
                                 "autocast")
        if self.half and autocast != "none":
            raise ParameterError("half (a float16 network) and autocast exclude each other; give one", "half",
                                 "autocast")
        self.autocast, self.channels_last = autocast, bool(channels_last)
        #: PyTorch's default float32 settings on CUDA, which let cuDNN's convolutions use TF32 (faster, ~1e-3
        #: relative); default: exact float32, so CUDA gives the CPU's features to float32 rounding
        self.tf32 = bool(tf32)
        self.device = resolve_device(device, self.half)
        self.decode = resolve_decode(decode, self.device)
        model, self.weights = builder(arch, weights, unused_prefixes,
                                      **((random_options or {}) if weights == "random" else {}))
        self.network: nn.Module = (create_feature_extractor(model, {node: "out"}) if cut else WholeModel(model)).eval()
        self.network.requires_grad_(False)
        self._preprocess = preprocess(self.weights.mean, self.weights.std)
        self.to(self.device)

    # -- worker side ------------------------------------------------------------------------------------------
    def preprocessor(self) -> Callable[[str], Any]:
        """The Pillow preprocessing (``decode`` ``cpu``), or the byte reader of the device path."""
        if self.decode == "device":
            return EncodedReader(self._preprocess, self._preprocess.exif_orientation)
        return self._preprocess

    def collator(self) -> Callable[[list[Any]], Any]:
        return collate_encoded if self.decode == "device" else super().collator()

    def load(self, path: str) -> torch.Tensor:
        return self._preprocess(path)

    # -- main process -----------------------------------------------------------------------------------------
    def to(self, device: torch.device | str) -> "BackboneExtractor":
        self.device = resolve_device(device, self.half)
        self.network.to(self.device, dtype=torch.float16 if self.half else torch.float32)
        if self.channels_last:
            self.network.to(memory_format=torch.channels_last)
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick the fastest kernels
        return self

    def to_device(self, batch: torch.Tensor | EncodedBatch) -> tuple[torch.Tensor | None, list[tuple[int, str]]]:
        """A collated batch on the device: a tensor is copied (``non_blocking``, so a pinned batch overlaps);
        an :class:`EncodedBatch` is decoded there (:func:`decode_batch`), which may drop rows it cannot use."""
        if isinstance(batch, EncodedBatch):
            return decode_batch(batch, self.device, self._preprocess.from_decoded, self._preprocess)
        return batch.to(self.device, non_blocking=True), []

    def forward_only(self, images: torch.Tensor) -> torch.Tensor:
        """Features ``[B, K, D]`` float32 (on the device) of preprocessed ``images`` (the shape ``load`` gives,
        stacked: ``[B, 3, H, W]``, or ``[B, 10, 3, C, C]`` for 10-crop), with this extractor's precision and
        memory format; no decoding and no copy back to the host (what ``bench/gpu.py`` times as the bound)."""
        with torch.inference_mode():
            return self.to_features(self.run_network(self.flatten_batch(images)), images.shape[0]).float()

    def run_network(self, images: torch.Tensor) -> torch.Tensor:
        """The kept node's output for ``images`` ``[B, 3, H, W]`` on the device (CPU: ``CPU_PIXELS_PER_PASS`` input
        pixels a pass; the features are the same), in exact float32 on CUDA unless ``tf32``."""
        dtype = torch.float16 if self.half else torch.float32
        autocast_dtype = AUTOCAST_DTYPES[self.autocast]
        with float32_arithmetic(self.tf32), torch.inference_mode(), \
                torch.autocast(self.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            images = images.to(self.device, dtype=dtype, non_blocking=True)
            if self.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            step = images.shape[0]
            if self.device.type == "cpu":
                step = max(1, CPU_PIXELS_PER_PASS // max(1, images.shape[-2] * images.shape[-1]))
            if step >= images.shape[0]:
                return self.network(images)["out"]
            return torch.cat([self.network(images[s:s + step])["out"] for s in range(0, images.shape[0], step)])

    def to_features(self, output: torch.Tensor, batch_size: int) -> torch.Tensor:
        """Reshape the node output into ``[B, K, D]`` (subclasses)."""
        raise NotImplementedError

    def extract(self, batch: torch.Tensor | EncodedBatch) -> dict[str, np.ndarray]:
        """``{"features": [B, K, D] float32}`` of a collated batch (a tensor, on the host or the device). An
        :class:`EncodedBatch` must go through :meth:`to_device` first (which reports the rows it drops)."""
        if isinstance(batch, EncodedBatch):
            raise TypeError("an EncodedBatch is decoded by to_device (which may drop rows) before extract")
        return {"features": self.forward_only(batch).cpu().numpy()}

    def flatten_batch(self, batch: torch.Tensor) -> torch.Tensor:
        """Network input ``[B', 3, H, W]`` from a collated batch (identity; 10-crop folds its crops in)."""
        return batch

    def extra_attrs(self) -> dict[str, Any]:
        return {}

    def attrs(self) -> dict[str, Any]:
        weights: LoadedWeights = self.weights
        attrs = {"kind": self.kind, "extractor": self.name, "backbone": self.backbone, "weights": weights.name,
                 "layer": self.node, "normalize_mean": list(weights.mean), "normalize_std": list(weights.std),
                 "half_precision": self.half, "decode": self.decode, "autocast": self.autocast,
                 "channels_last": self.channels_last, "tf32": self.tf32 and self.device.type == "cuda",
                 **weights.attrs}
        attrs.update(self.extra_attrs())
        return attrs
