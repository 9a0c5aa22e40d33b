"""The whole bottom-up-attention detector: backbone → proposals → region head → generate_tsv selection."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from retr.common.devices import exact_float32
from retr.extractors.butd.anchors import caffe_cell_anchors
from retr.extractors.butd.batching import pad_images
from retr.extractors.butd.backbone import ResNetC4
from retr.extractors.butd.heads import FEATURE_DIM, RegionHead
from retr.extractors.butd.rpn import ProposalGenerator
from retr.extractors.butd.selection import select_regions, select_regions_batched


@dataclass(frozen=True)
class DetectorSettings:
    """Test-time settings; the defaults are the original's (Caffe ``config.py`` TEST, ``generate_tsv.py``).

    ``pre_nms_topk``/``post_nms_topk``/``pooled_size`` below the defaults are speed options that change the output;
    they are recorded in the feature set's attributes."""

    pre_nms_topk: int = 6000
    post_nms_topk: int = 300
    rpn_nms_threshold: float = 0.7
    min_size: float = 16.0
    pooled_size: int = 14
    class_nms_threshold: float = 0.3
    conf_threshold: float = 0.2
    min_boxes: int = 36
    max_boxes: int = 36


@dataclass
class Regions:
    """The kept regions of one image (``n ≤ max_boxes`` rows), boxes in original-image pixels."""

    features: torch.Tensor      # [n, 2048]
    boxes: torch.Tensor         # [n, 4] x1, y1, x2, y2
    cls_prob: torch.Tensor      # [n, 1601] column 0 = background
    attr_prob: torch.Tensor     # [n, 401]  column 0 = no attribute
    max_conf: torch.Tensor      # [n] best per-class-NMS score


class BottomUpAttention(nn.Module):
    """ResNet-101 C4 Faster R-CNN with attribute head; parameter names match the MILVLG checkpoints.

    Children: ``backbone`` (:class:`ResNetC4`), ``proposal_generator`` (:class:`ProposalGenerator`), ``roi_heads``
    (:class:`RegionHead`)."""

    def __init__(self, settings: DetectorSettings = DetectorSettings()):
        super().__init__()
        self.settings = settings
        self.backbone = ResNetC4()
        self.proposal_generator = ProposalGenerator(settings.pre_nms_topk, settings.post_nms_topk,
                                                    settings.rpn_nms_threshold, settings.min_size)
        self.roi_heads = RegionHead(settings.pooled_size)

    @torch.no_grad()
    def detect(self, image: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
        """All proposals of one preprocessed image ``[3, H, W]`` (BGR, mean-subtracted, resized by ``scale``).

        Returns proposals ``[P, 4]`` (resized pixels), features ``[P, 2048]``, class probs ``[P, 1601]``, attribute
        probs ``[P, 401]``."""
        res4 = self.backbone(image.unsqueeze(0))
        proposals = self.proposal_generator(res4, (image.shape[-2], image.shape[-1]), scale)
        features, cls_prob, attr_prob = self.roi_heads(res4, proposals)
        return proposals, features, cls_prob, attr_prob

    @torch.no_grad()
    def forward(self, image: torch.Tensor, scale: float) -> Regions:
        """Detect and keep the regions ``generate_tsv`` keeps (see :mod:`retr.extractors.butd.selection`). In the
        precision torch is set to: :func:`run_detector` makes CUDA's exact."""
        s = self.settings
        proposals, features, cls_prob, attr_prob = self.detect(image, scale)
        boxes = proposals / scale
        keep, max_conf = select_regions(boxes, cls_prob.float(), s.class_nms_threshold, s.conf_threshold,
                                        s.min_boxes, s.max_boxes)
        return Regions(features[keep].float(), boxes[keep], cls_prob[keep].float(), attr_prob[keep].float(),
                       max_conf[keep])


    @torch.no_grad()
    def detect_batch(self, images: list[torch.Tensor], scales: list[float]
                     ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """:meth:`detect` of ``B`` images ``[3, H_b, W_b]`` in one backbone forward, each result equal to
        :meth:`detect`'s (padding masked: :mod:`retr.extractors.butd.batching`); one tuple per image."""
        if len(images) != len(scales):
            raise ValueError(f"{len(images)} images but {len(scales)} scales")
        image_hw = [(int(image.shape[-2]), int(image.shape[-1])) for image in images]
        res4, res4_hw = self.backbone.forward_padded(pad_images(images), image_hw)
        proposals = self.proposal_generator.forward_padded(res4, res4_hw, image_hw, list(scales))
        return [(p, *self.roi_heads(res4, p, b)) for b, p in enumerate(proposals)]

    @torch.no_grad()
    def forward_batch(self, images: list[torch.Tensor], scales: list[float]) -> list[Regions]:
        """:meth:`forward` of several images (one backbone forward, selection of all of them on the device).

        Each :class:`Regions` equals :meth:`forward`'s for that image alone (see :meth:`detect_batch`); the tensors
        stay on the model's device."""
        s = self.settings
        detections = self.detect_batch(images, scales)
        boxes = [proposals / scale for (proposals, *_), scale in zip(detections, scales)]
        order, kept, max_conf = select_regions_batched(boxes, [d[2].float() for d in detections],
                                                       s.class_nms_threshold, s.conf_threshold, s.min_boxes,
                                                       s.max_boxes)
        regions = []
        for b, count in enumerate(kept.tolist()):                       # the one host read of the selection
            keep = order[b, :count]
            _, features, cls_prob, attr_prob = detections[b]
            regions.append(Regions(features[keep].float(), boxes[b][keep], cls_prob[keep].float(),
                                   attr_prob[keep].float(), max_conf[b, keep]))
        return regions


@torch.no_grad()
def run_detector(model: BottomUpAttention, images: Sequence[torch.Tensor], scales: Sequence[float],
                 batch_size: int = 1, tf32: bool = False) -> list[Regions]:
    """One :class:`Regions` per image (on the model's device), ``batch_size`` images per forward (1: the original's
    one-image :meth:`BottomUpAttention.forward`).

    On CUDA the float32 arithmetic is exact (:func:`~retr.common.devices.exact_float32`) unless ``tf32``: TF32
    convolutions let a batch keep other boxes than its images alone (docs/butd.md, TF32)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    if len(images) != len(scales):
        raise ValueError(f"{len(images)} images but {len(scales)} scales")
    parameter = next(model.parameters())
    inputs = [image.to(parameter.device, dtype=parameter.dtype) for image in images]
    with nullcontext() if tf32 else exact_float32():
        if batch_size == 1:
            return [model(image, scale) for image, scale in zip(inputs, scales)]
        regions: list[Regions] = []
        for start in range(0, len(inputs), batch_size):
            regions += model.forward_batch(inputs[start:start + batch_size], list(scales[start:start + batch_size]))
        return regions


def empty_detector(settings: DetectorSettings = DetectorSettings(),
                   device: torch.device | str = "cpu") -> BottomUpAttention:
    """A detector with allocated but uninitialised parameters, to be filled by a checkpoint or randomize_.

    Skips the default initialisation of 65 M parameters (seconds on a CPU) that loading overwrites anyway. Only for
    strict loads: with ``allow_partial`` the parameters a file lacks would hold garbage."""
    with torch.device("meta"):
        model = BottomUpAttention(settings)
    model = model.to_empty(device=device)
    model.proposal_generator.cell_anchors = caffe_cell_anchors().to(device)
    return model


__all__ = ["BottomUpAttention", "DetectorSettings", "FEATURE_DIM", "Regions", "empty_detector", "run_detector"]
