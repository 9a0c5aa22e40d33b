"""The whole bottom-up-attention detector: backbone → proposals → region head → generate_tsv selection."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from retr.extractors.butd.anchors import caffe_cell_anchors
from retr.extractors.butd.backbone import ResNetC4
from retr.extractors.butd.heads import FEATURE_DIM, RegionHead
from retr.extractors.butd.rpn import ProposalGenerator
from retr.extractors.butd.selection import select_regions


@dataclass(frozen=True)
class DetectorSettings:
    """Test-time settings; the defaults are the original's (Caffe ``config.py`` TEST, ``generate_tsv.py``).

    ``pre_nms_topk``/``post_nms_topk``/``pooled_size`` below the defaults are speed options that change the
    output; they are recorded in the feature set's attributes.
    """

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

    Children: ``backbone`` (:class:`ResNetC4`), ``proposal_generator`` (:class:`ProposalGenerator`),
    ``roi_heads`` (:class:`RegionHead`).
    """

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
        """All proposals of one preprocessed image.

        Args:
            image: ``[3, H, W]`` float, BGR, mean-subtracted, already resized by ``scale``.
            scale: resize factor from the original image.

        Returns:
            proposals ``[P, 4]`` (resized pixels), features ``[P, 2048]``, class probs ``[P, 1601]``,
            attribute probs ``[P, 401]``.
        """
        res4 = self.backbone(image.unsqueeze(0))
        proposals = self.proposal_generator(res4, (image.shape[-2], image.shape[-1]), scale)
        features, cls_prob, attr_prob = self.roi_heads(res4, proposals)
        return proposals, features, cls_prob, attr_prob

    @torch.no_grad()
    def forward(self, image: torch.Tensor, scale: float) -> Regions:
        """Detect and keep the regions ``generate_tsv`` keeps (see :mod:`retr.extractors.butd.selection`)."""
        s = self.settings
        proposals, features, cls_prob, attr_prob = self.detect(image, scale)
        boxes = proposals / scale
        keep, max_conf = select_regions(boxes, cls_prob.float(), s.class_nms_threshold, s.conf_threshold,
                                        s.min_boxes, s.max_boxes)
        return Regions(features[keep].float(), boxes[keep], cls_prob[keep].float(), attr_prob[keep].float(),
                       max_conf[keep])


def empty_detector(settings: DetectorSettings = DetectorSettings(),
                   device: torch.device | str = "cpu") -> BottomUpAttention:
    """A detector with allocated but uninitialised parameters, to be filled by a checkpoint or randomize_.

    Skips the default initialisation of 65 M parameters (seconds on a CPU) that loading overwrites anyway.
    Only for strict loads: with ``allow_partial`` the parameters a file lacks would hold garbage.
    """
    with torch.device("meta"):
        model = BottomUpAttention(settings)
    model = model.to_empty(device=device)
    model.proposal_generator.cell_anchors = caffe_cell_anchors().to(device)
    return model


__all__ = ["BottomUpAttention", "DetectorSettings", "FEATURE_DIM", "Regions", "empty_detector"]
