"""``vgg16-maps``: VGG-16's last pooling layer (pool5) as 14×14 = 196 vectors of 512 (JGCAR).

JGCAR re-scales every image to 448×448 and keeps pool5, 512×14×14. ``image_size=224`` gives 7×7 = 49 vectors (the
only other size the feature-set contract allows for ``maps``). Rows are in raster order (row, column from the top
left). Random weights use torchvision's own VGG initialisation: activations stay near 1."""
from __future__ import annotations

from typing import Any

import torch

from retr.common.errors import ParameterError
from retr.extractors.backbone import BackboneExtractor
from retr.extractors.base import register_extractor
from retr.extractors.images import SquareResize
from retr.extractors.spec import ExtractorSpec, RandomInit
from retr.extractors.weights import TorchvisionWeights

IMAGE_SIZES = (448, 224)
POOL5 = "features.30"  #: the fifth max-pool of torchvision's VGG-16 ``features`` (its last module)


class VggMapsExtractor(BackboneExtractor):
    """VGG-16 pool5 ``[B, 512, S/32, S/32]`` → features ``[B, (S/32)², 512]``."""

    name = "vgg16-maps"
    kind = "maps"

    def __init__(self, *, weights: str = "imagenet", device: str = "cpu", half: bool = False,
                 image_size: int = 448, exif_orientation: bool = False,
                 decode: str = "auto", autocast: str = "none", channels_last: bool = False, tf32: bool = False):
        if image_size not in IMAGE_SIZES:
            raise ParameterError(f"image_size for {self.name} must be one of {IMAGE_SIZES} (14×14 or 7×7 maps), "
                                 f"not {image_size}", "image_size")
        self.image_size, self.exif_orientation = image_size, exif_orientation
        super().__init__(arch="vgg16", node=POOL5, weights=weights, device=device, half=half,
                         preprocess=lambda mean, std: SquareResize(image_size, mean, std, exif_orientation),
                         unused_prefixes=("classifier.",),
                         decode=decode, autocast=autocast, channels_last=channels_last, tf32=tf32)

    @property
    def feature_shape(self) -> tuple[int, int]:
        side = self.image_size // 32
        return (side * side, 512)

    def to_features(self, output: torch.Tensor, batch_size: int) -> torch.Tensor:
        return output.flatten(2).transpose(1, 2)  # [B, 512, S, S] → [B, S·S, 512]

    def extra_attrs(self) -> dict[str, Any]:
        return {"image_size": self.image_size,
                "preprocessing": f"resize to {self.image_size}x{self.image_size} (bilinear, antialiased), "
                                 f"ImageNet normalisation",
                "exif_orientation": self.exif_orientation}


def build_vgg16_maps(weights: str = "imagenet", device: str = "cpu", half: bool = False, image_size: int = 448,
                     exif_orientation: bool = False,
                     decode: str = "auto", autocast: str = "none", channels_last: bool = False,
                     tf32: bool = False) -> VggMapsExtractor:
    """VGG-16 pool5 maps: 196×512 at a 448 input (default), 49×512 at 224."""
    return VggMapsExtractor(weights=weights, device=device, half=half, image_size=image_size,
                            exif_orientation=exif_orientation,
                            decode=decode, autocast=autocast, channels_last=channels_last, tf32=tf32)


register_extractor(ExtractorSpec(
    name="vgg16-maps", builder=build_vgg16_maps, kind="maps",
    output=lambda options: ((options["image_size"] // 32) ** 2, 512),
    weights=TorchvisionWeights(source="vgg16", arch="vgg16"), random=RandomInit("torchvision")))
