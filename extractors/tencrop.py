"""10-crop global vectors (SEAM): ``tencrop-vgg19`` (fc7 after ReLU, 10×4096), ``tencrop-resnet152`` (10×2048) and
``tencrop-irv2`` (Inception-ResNet-v2 global pool, 10×1536).

Crop ``k`` of an image is row ``k`` of its ``[10, D]`` block (all ten stored; averaging is the trainer's). Nodes,
crop sizes and the IRv2 ratio: docs/extraction.md (extractor table, "Decisions the code relies on")."""
from __future__ import annotations

from typing import Any

import torch

from retr.common.errors import ParameterError
from retr.extractors.backbone import BackboneExtractor, ModelBuilder
from retr.extractors.base import register_extractor
from retr.extractors.images import TenCrop, tencrop_resize_for
from retr.extractors.spec import ExtractorSpec, RandomInit
from retr.extractors.timm_weights import EXTRA as TIMM_EXTRA
from retr.extractors.timm_weights import TimmWeights, build_timm_backbone
from retr.extractors.weights import RANDOM_RESNET, TorchvisionWeights, build_backbone

NUM_CROPS = 10
MIN_CROP = 32
#: The smallest crop Inception-ResNet-v2 takes (from 74 pixels down, a 3×3 convolution near the end meets a 2×2 map).
MIN_CROP_IRV2 = 75


class TenCropExtractor(BackboneExtractor):
    """Ten crops ``[B, 10, 3, C, C]`` → one vector per crop → features ``[B, 10, D]``."""

    kind = "tencrop"

    def __init__(self, *, name: str, arch: str, node: str, dim: int, unused_prefixes: tuple[str, ...],
                 random_options: dict | None, weights: str, device: str, half: bool, image_size: int,
                 exif_orientation: bool, builder: ModelBuilder = build_backbone, min_crop: int = MIN_CROP,
                 normalisation: str = "ImageNet", cut: bool = True,
                 decode: str = "auto", autocast: str = "none", channels_last: bool = False, tf32: bool = False):
        if image_size < min_crop:
            raise ParameterError(f"image_size (the crop side) must be at least {min_crop} for {name}, "
                                 f"not {image_size}", "image_size")
        self.name, self.dim, self.normalisation = name, dim, normalisation
        self.image_size, self.resize = image_size, tencrop_resize_for(image_size)
        self.exif_orientation = exif_orientation
        super().__init__(arch=arch, node=node, weights=weights, device=device, half=half,
                         preprocess=lambda mean, std: TenCrop(image_size, self.resize, mean, std, exif_orientation),
                         unused_prefixes=unused_prefixes, random_options=random_options, builder=builder,
                         cut=cut, decode=decode, autocast=autocast, channels_last=channels_last, tf32=tf32)

    @property
    def feature_shape(self) -> tuple[int, int]:
        return (NUM_CROPS, self.dim)

    def flatten_batch(self, batch: torch.Tensor) -> torch.Tensor:
        return batch.flatten(0, 1)  # [B, 10, 3, C, C] → [B·10, 3, C, C]

    def to_features(self, output: torch.Tensor, batch_size: int) -> torch.Tensor:
        return output.reshape(batch_size, NUM_CROPS, self.dim)

    def extra_attrs(self) -> dict[str, Any]:
        return {"image_size": self.image_size, "resize_short_side": self.resize, "num_crops": NUM_CROPS,
                "crop_order": "top-left, top-right, bottom-left, bottom-right, centre, then the same of the "
                              "horizontally flipped image",
                "preprocessing": f"resize short side to {self.resize} (bilinear, antialiased), {self.normalisation} "
                                 f"normalisation, ten {self.image_size}x{self.image_size} crops",
                "exif_orientation": self.exif_orientation}


def build_tencrop_vgg19(weights: str = "imagenet", device: str = "cpu", half: bool = False, image_size: int = 224,
                        exif_orientation: bool = False,
                        decode: str = "auto", autocast: str = "none", channels_last: bool = False,
                        tf32: bool = False) -> TenCropExtractor:
    """VGG-19 fc7 (after ReLU) of ten crops: ``[10, 4096]`` per image."""
    return TenCropExtractor(name="tencrop-vgg19", arch="vgg19", node="classifier.4", dim=4096,
                            unused_prefixes=("classifier.6.",), random_options=None, weights=weights,
                            device=device, half=half, image_size=image_size, exif_orientation=exif_orientation,
                            decode=decode, autocast=autocast, channels_last=channels_last, tf32=tf32)


def build_tencrop_resnet152(weights: str = "imagenet", device: str = "cpu", half: bool = False,
                            image_size: int = 224, exif_orientation: bool = False,
                            decode: str = "auto", autocast: str = "none", channels_last: bool = False,
                            tf32: bool = False,
                            ) -> TenCropExtractor:
    """ResNet-152 global average pool of ten crops: ``[10, 2048]`` per image."""
    return TenCropExtractor(name="tencrop-resnet152", arch="resnet152", node="flatten", dim=2048,
                            unused_prefixes=("fc.",), random_options=dict(RANDOM_RESNET.options),
                            weights=weights, device=device, half=half, image_size=image_size,
                            exif_orientation=exif_orientation,
                            decode=decode, autocast=autocast, channels_last=channels_last, tf32=tf32)


def build_tencrop_irv2(weights: str = "imagenet", device: str = "cpu", half: bool = False, image_size: int = 299,
                       exif_orientation: bool = False,
                       decode: str = "auto", autocast: str = "none", channels_last: bool = False,
                       tf32: bool = False) -> TenCropExtractor:
    """Inception-ResNet-v2 (timm) global average pool of ten crops: ``[10, 1536]`` per image."""
    return TenCropExtractor(name="tencrop-irv2", arch="inception_resnet_v2", node="global_pool.flatten", dim=1536,
                            unused_prefixes=("classif.",), random_options=None, weights=weights, device=device,
                            half=half, image_size=image_size, exif_orientation=exif_orientation,
                            builder=build_timm_backbone, min_crop=MIN_CROP_IRV2,
                            normalisation="Inception (mean 0.5, std 0.5)", cut=False,
                            decode=decode, autocast=autocast, channels_last=channels_last, tf32=tf32)


register_extractor(ExtractorSpec(
    name="tencrop-vgg19", builder=build_tencrop_vgg19, kind="tencrop", output=(NUM_CROPS, 4096),
    weights=TorchvisionWeights(source="vgg19", arch="vgg19"), random=RandomInit("torchvision")))
register_extractor(ExtractorSpec(
    name="tencrop-resnet152", builder=build_tencrop_resnet152, kind="tencrop", output=(NUM_CROPS, 2048),
    weights=TorchvisionWeights(source="resnet152", arch="resnet152"), random=RANDOM_RESNET))
register_extractor(ExtractorSpec(
    name="tencrop-irv2", builder=build_tencrop_irv2, kind="tencrop", output=(NUM_CROPS, 1536),
    weights=TimmWeights(source="inception_resnet_v2", arch="inception_resnet_v2"),
    extra=TIMM_EXTRA, requires=("timm",), random=RandomInit("timm")))
