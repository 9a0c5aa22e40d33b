"""The region proposal network of the Caffe model and its test-time proposal layer.

Head: 3×3 conv 1024→512 + ReLU; ``objectness_logits`` → 24 channels (0–11 background, 12–23 foreground);
``anchor_deltas`` → 48 (anchor-major dx, dy, dw, dh). Proposal layer: docs/butd.md ("Settings")."""
from __future__ import annotations

import torch
from torch import nn

from retr.extractors.butd.anchors import FEATURE_STRIDE, caffe_cell_anchors, shift_anchors
from retr.extractors.butd.boxes import clip_boxes, decode_deltas, keep_min_size, legacy_nms


class RPNHead(nn.Module):
    """``[1, 1024, h, w]`` → (foreground probability ``[h·w·A]``, deltas ``[h·w·A, 4]``) in (h, w, anchor) order."""

    def __init__(self, in_channels: int = 1024, hidden_channels: int = 512, num_anchors: int = 12):
        super().__init__()
        self.num_anchors = num_anchors
        self.conv = nn.Conv2d(in_channels, hidden_channels, 3, padding=1)
        self.objectness_logits = nn.Conv2d(hidden_channels, 2 * num_anchors, 1)
        self.anchor_deltas = nn.Conv2d(hidden_channels, 4 * num_anchors, 1)

    def maps(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, 1024, h, w]`` → (foreground probability ``[B, A, h, w]``, deltas ``[B, A, 4, h, w]``)."""
        hidden = torch.relu(self.conv(features))
        logits = self.objectness_logits(hidden)                       # [B, 2A, h, w]
        a = self.num_anchors
        two_way = logits.reshape(len(logits), 2, a, *logits.shape[2:])  # [B, bg|fg, A, h, w]
        fg_prob = torch.softmax(two_way, dim=1)[:, 1]                  # [B, A, h, w]
        deltas = self.anchor_deltas(hidden)                            # [B, 4A, h, w]
        return fg_prob, deltas.reshape(len(deltas), a, 4, *deltas.shape[2:])

    @staticmethod
    def flatten(fg_prob: torch.Tensor, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One image's maps ``[A, h, w]``, ``[A, 4, h, w]`` → ``[h·w·A]``, ``[h·w·A, 4]`` (h, w, anchor order)."""
        return fg_prob.permute(1, 2, 0).reshape(-1), deltas.permute(2, 3, 0, 1).reshape(-1, 4)

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fg_prob, deltas = self.maps(features)
        return self.flatten(fg_prob[0], deltas[0])


class ProposalGenerator(nn.Module):
    """RPN head + Caffe test-time proposal layer (6000 → NMS 0.7 → 300; ``min_size`` 16 original pixels)."""

    def __init__(self, pre_nms_topk: int = 6000, post_nms_topk: int = 300, nms_threshold: float = 0.7,
                 min_size: float = 16.0):
        super().__init__()
        self.rpn_head = RPNHead()
        self.register_buffer("cell_anchors", caffe_cell_anchors(), persistent=False)
        self.pre_nms_topk, self.post_nms_topk = pre_nms_topk, post_nms_topk
        self.nms_threshold, self.min_size = nms_threshold, min_size

    @torch.no_grad()
    def forward(self, features: torch.Tensor, image_hw: tuple[int, int], scale: float) -> torch.Tensor:
        """Proposals ``[P, 4]`` (P ≤ post_nms_topk, resized-image pixels, best first) from res4 ``[1, 1024, h, w]``,
        the resized input's ``image_hw`` and ``scale``."""
        fg_prob, deltas = self.rpn_head(features)
        return self.propose(fg_prob, deltas, (features.shape[-2], features.shape[-1]), image_hw, scale)

    @torch.no_grad()
    def forward_padded(self, features: torch.Tensor, feature_hw: list[tuple[int, int]],
                       image_hw: list[tuple[int, int]], scales: list[float]) -> list[torch.Tensor]:
        """Per-image proposals ``[P_b, 4]`` of a padded batch (res4 ``[B, 1024, h, w]``, zero outside each
        ``feature_hw[b]``), each as :meth:`forward` on the image alone; the head runs once."""
        fg_maps, delta_maps = self.rpn_head.maps(features)
        proposals = []
        for b, (h, w) in enumerate(feature_hw):
            fg_prob, deltas = self.rpn_head.flatten(fg_maps[b, :, :h, :w], delta_maps[b, ..., :h, :w])
            proposals.append(self.propose(fg_prob, deltas, (h, w), image_hw[b], scales[b]))
        return proposals

    def propose(self, fg_prob: torch.Tensor, deltas: torch.Tensor, feature_hw: tuple[int, int],
                image_hw: tuple[int, int], scale: float) -> torch.Tensor:
        """The proposal layer on one image: ``[h·w·A]`` probabilities, ``[h·w·A, 4]`` deltas → ``[P, 4]``."""
        anchors = shift_anchors(self.cell_anchors, feature_hw[0], feature_hw[1], FEATURE_STRIDE)
        boxes = clip_boxes(decode_deltas(anchors, deltas.float()), *image_hw)
        keep = keep_min_size(boxes, self.min_size * scale)
        boxes, fg_prob = boxes[keep], fg_prob[keep].float()
        order = torch.argsort(fg_prob, descending=True, stable=True)[: self.pre_nms_topk]
        boxes, fg_prob = boxes[order], fg_prob[order]
        keep = legacy_nms(boxes, fg_prob, self.nms_threshold)[: self.post_nms_topk]
        return boxes[keep]
