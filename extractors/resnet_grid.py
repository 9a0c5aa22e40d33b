"""``resnet152-grid``: ResNet-152 res5c (``layer4``) as a grid of 2048-d vectors (SMAN), ``[B, G·G, 2048]``.

448 px gives 14×14, average-pooled 2×2 to 7×7 by default (``grid_size=14`` keeps it); raster order, cell ``k`` is
``(k // G, k % G)``. Why, and ``zero_init_residual`` for ``random``: docs/DESIGN.md, docs/extraction.md."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from retr.common.errors import ParameterError
from retr.extractors.backbone import BackboneExtractor
from retr.extractors.base import register_extractor
from retr.extractors.images import SquareResize
from retr.extractors.spec import ExtractorSpec
from retr.extractors.weights import RANDOM_RESNET, TorchvisionWeights

STRIDE = 32  #: ResNet's output stride: a S×S input gives a (S/32)×(S/32) res5c map
GRID_SIZES = (7, 14)


class ResNetGridExtractor(BackboneExtractor):
    """ResNet-152 ``layer4`` output ``[B, 2048, S/32, S/32]`` → pooled to ``G×G`` → features ``[B, G², 2048]``."""

    name = "resnet152-grid"
    kind = "grid"

    def __init__(self, *, weights: str = "imagenet", device: str = "cpu", half: bool = False,
                 image_size: int = 448, grid_size: int = 7, exif_orientation: bool = False,
                 decode: str = "auto", autocast: str = "none", channels_last: bool = False, tf32: bool = False):
        if image_size % STRIDE or image_size < STRIDE:
            raise ParameterError(f"image_size must be a multiple of {STRIDE} for {self.name}, not {image_size}",
                                 "image_size")
        if grid_size not in GRID_SIZES:
            raise ParameterError(f"grid_size must be one of {GRID_SIZES}, not {grid_size}", "grid_size")
        side = image_size // STRIDE
        if side % grid_size:
            raise ParameterError(f"a {image_size}×{image_size} input gives a {side}×{side} res5c map, which does "
                                 f"not pool to {grid_size}×{grid_size} (grid_size {grid_size}); use image_size "
                                 f"{grid_size * STRIDE} or a multiple", "image_size", "grid_size")
        self.image_size, self.grid_size, self.pool = image_size, grid_size, side // grid_size
        self.exif_orientation = exif_orientation
        super().__init__(arch="resnet152", node="layer4", weights=weights, device=device, half=half,
                         preprocess=lambda mean, std: SquareResize(image_size, mean, std, exif_orientation),
                         unused_prefixes=("fc.",), random_options=dict(RANDOM_RESNET.options),
                         decode=decode, autocast=autocast, channels_last=channels_last, tf32=tf32)

    @property
    def feature_shape(self) -> tuple[int, int]:
        return (self.grid_size * self.grid_size, 2048)

    def to_features(self, output: torch.Tensor, batch_size: int) -> torch.Tensor:
        if self.pool > 1:
            output = F.avg_pool2d(output, kernel_size=self.pool, stride=self.pool)
        return output.flatten(2).transpose(1, 2)  # [B, 2048, G, G] → [B, G·G, 2048], raster order

    def extra_attrs(self) -> dict[str, Any]:
        return {"image_size": self.image_size, "grid_size": self.grid_size, "grid_pool": self.pool,
                "preprocessing": f"resize to {self.image_size}x{self.image_size} (bilinear, antialiased), "
                                 f"ImageNet normalisation",
                "exif_orientation": self.exif_orientation}


def build_resnet152_grid(weights: str = "imagenet", device: str = "cpu", half: bool = False, image_size: int = 448,
                         grid_size: int = 7, exif_orientation: bool = False,
                         decode: str = "auto", autocast: str = "none", channels_last: bool = False, tf32: bool = False,
                         ) -> ResNetGridExtractor:
    """ResNet-152 res5c grid: 448 input pooled to 7×7 (default), raw 14×14 (``grid_size=14``) or a 224 input."""
    return ResNetGridExtractor(weights=weights, device=device, half=half, image_size=image_size,
                               grid_size=grid_size, exif_orientation=exif_orientation,
                               decode=decode, autocast=autocast, channels_last=channels_last, tf32=tf32)


register_extractor(ExtractorSpec(
    name="resnet152-grid", builder=build_resnet152_grid, kind="grid",
    output=lambda options: (options["grid_size"] ** 2, 2048),
    weights=TorchvisionWeights(source="resnet152", arch="resnet152"), random=RANDOM_RESNET))
