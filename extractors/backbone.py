"""What the backbone extractors share: weights, one layer's output, device and precision.

Each extractor names an architecture (torchvision's, or timm's for ``tencrop-irv2``) and the graph node whose
output it keeps; the network is ``torchvision.models.feature_extraction.create_feature_extractor(model, {node:
"out"})``, i.e. the model's own forward pass cut at that node (nothing after it is computed), or the whole model
when it already ends there (``cut=False``). A subclass then only reshapes that output into ``[B, K, D]``
(:meth:`BackboneExtractor.to_features`) and describes itself (:meth:`extra_attrs`).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torchvision.models.feature_extraction import create_feature_extractor

from retr.common.devices import resolve_device as resolve_common_device
from retr.common.errors import ParameterError
from retr.extractors.base import Extractor
from retr.extractors.weights import LoadedWeights, build_backbone

#: ``builder(arch, weights, unused_prefixes, **random_options) -> (model, LoadedWeights)``
ModelBuilder = Callable[..., tuple[nn.Module, LoadedWeights]]

CPU_PIXELS_PER_PASS = 448 * 448   # input pixels per network call on CPU (see BackboneExtractor.run_network)


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

    Args:
        arch: architecture name for ``builder`` (torchvision's ``resnet152``, ``vgg16``, ``vgg19``; timm's
            ``inception_resnet_v2``).
        node: graph node whose output is kept (``layer4``, ``features.30``, ``classifier.4``, ``flatten``).
        weights: ``imagenet`` | enum member name | ``random`` | state-dict path (:mod:`retr.extractors.weights`).
        preprocess: builds the worker-side preprocessing from the weights' normalisation ``(mean, std)``.
        unused_prefixes: parameters the cut network never uses (a state-dict file may omit them).
        random_options: torchvision builder options used only for ``weights="random"``.
        device: ``cpu`` | ``cuda`` | ``cuda:N``; half: float16 network and inputs (CUDA only).
        builder: where the model and its weights come from: torchvision's (:func:`build_backbone`, default) or
            timm's (:func:`retr.extractors.timm_weights.build_timm_backbone`).
        cut: ``True``: cut the model at ``node`` with ``create_feature_extractor``. ``False``: the builder's
            model already ends at ``node`` (timm's headless network ends at its global pool) and runs whole;
            ``node`` only names the layer. (Tracing Inception-ResNet-v2 for a cut takes ~10 s of CPU.)
    """

    backbone: str

    def __init__(self, *, arch: str, node: str, weights: str,
                 preprocess: Callable[[tuple, tuple], Callable[[str], torch.Tensor]],
                 unused_prefixes: tuple[str, ...] = (), random_options: dict | None = None,
                 device: str | torch.device = "cpu", half: bool = False, builder: ModelBuilder = build_backbone,
                 cut: bool = True):
        self.backbone = arch
        self.node = node
        self.half = bool(half)
        self.device = resolve_device(device, self.half)
        model, self.weights = builder(arch, weights, unused_prefixes,
                                      **((random_options or {}) if weights == "random" else {}))
        self.network: nn.Module = (create_feature_extractor(model, {node: "out"}) if cut else WholeModel(model)).eval()
        self.network.requires_grad_(False)
        self._preprocess = preprocess(self.weights.mean, self.weights.std)
        self.to(self.device)

    # -- worker side ------------------------------------------------------------------------------------------
    def preprocessor(self) -> Callable[[str], torch.Tensor]:
        return self._preprocess

    def load(self, path: str) -> torch.Tensor:
        return self._preprocess(path)

    # -- main process -----------------------------------------------------------------------------------------
    def to(self, device: torch.device | str) -> "BackboneExtractor":
        self.device = resolve_device(device, self.half)
        self.network.to(self.device, dtype=torch.float16 if self.half else torch.float32)
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick the fastest kernels
        return self

    def run_network(self, images: torch.Tensor) -> torch.Tensor:
        """The kept node's output for ``images`` ``[B, 3, H, W]`` (moved to the device, float16 with ``half``).

        On CPU the batch goes through the network ``CPU_PIXELS_PER_PASS`` input pixels at a time (one 448-px
        image, four 224-px crops): a whole batch's activations (100 MB a layer for eight 448-px images in
        ResNet-152) spill out of the CPU caches, and a batch of 8 ran at half the images/s of one image at a
        time (``bench/extract.py``). Every image is computed alone either way, so the features are the same.
        """
        dtype = torch.float16 if self.half else torch.float32
        with torch.inference_mode():
            images = images.to(self.device, dtype=dtype, non_blocking=True)
            step = images.shape[0]
            if self.device.type == "cpu":
                step = max(1, CPU_PIXELS_PER_PASS // max(1, images.shape[-2] * images.shape[-1]))
            if step >= images.shape[0]:
                return self.network(images)["out"]
            return torch.cat([self.network(images[s:s + step])["out"] for s in range(0, images.shape[0], step)])

    def to_features(self, output: torch.Tensor, batch_size: int) -> torch.Tensor:
        """Reshape the node output into ``[B, K, D]`` (subclasses)."""
        raise NotImplementedError

    def extract(self, batch: torch.Tensor) -> dict[str, np.ndarray]:
        batch_size = batch.shape[0]
        with torch.inference_mode():
            features = self.to_features(self.run_network(self.flatten_batch(batch)), batch_size)
        return {"features": features.float().cpu().numpy()}

    def flatten_batch(self, batch: torch.Tensor) -> torch.Tensor:
        """Network input ``[B', 3, H, W]`` from a collated batch (identity; 10-crop folds its crops in)."""
        return batch

    def extra_attrs(self) -> dict[str, Any]:
        return {}

    def attrs(self) -> dict[str, Any]:
        weights: LoadedWeights = self.weights
        attrs = {"kind": self.kind, "extractor": self.name, "backbone": self.backbone, "weights": weights.name,
                 "layer": self.node, "normalize_mean": list(weights.mean), "normalize_std": list(weights.std),
                 "half_precision": self.half, **weights.attrs}
        attrs.update(self.extra_attrs())
        return attrs
