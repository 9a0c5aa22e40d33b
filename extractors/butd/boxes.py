"""Box arithmetic of the Caffe detector: "+1" widths, decode, clip, size filter, legacy NMS.

The original code (py-faster-rcnn) treats boxes as inclusive pixel ranges, so a box ``[x1, x2]`` is ``x2 − x1 + 1``
wide. Every function here keeps that convention. Boxes are ``[N, 4]`` (x1, y1, x2, y2)."""
from __future__ import annotations

import torch
from torchvision.ops import box_iou, nms

#: add to (x1, y1, x2, y2) to turn inclusive "+1" boxes into the half-open boxes torchvision measures
_PLUS_ONE = (0.0, 0.0, 1.0, 1.0)


def plus_one(boxes: torch.Tensor) -> torch.Tensor:
    """``[N, 4]`` boxes with 1 added to x2 and y2, so that torchvision's areas equal the legacy "+1" areas."""
    return boxes + boxes.new_tensor(_PLUS_ONE)


def decode_deltas(anchors: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """Caffe ``bbox_transform_inv``: apply (dx, dy, dw, dh) ``[N, 4]`` to ``anchors`` ``[N, 4]`` → ``[N, 4]``.

    Widths are ``x2 − x1 + 1``; no delta weights and no clamping of ``dw``/``dh`` (as in the original)."""
    widths = anchors[:, 2] - anchors[:, 0] + 1.0
    heights = anchors[:, 3] - anchors[:, 1] + 1.0
    ctr_x = anchors[:, 0] + 0.5 * widths
    ctr_y = anchors[:, 1] + 0.5 * heights
    dx, dy, dw, dh = deltas.unbind(dim=1)
    pred_ctr_x = dx * widths + ctr_x
    pred_ctr_y = dy * heights + ctr_y
    pred_w = torch.exp(dw) * widths
    pred_h = torch.exp(dh) * heights
    return torch.stack([pred_ctr_x - 0.5 * pred_w, pred_ctr_y - 0.5 * pred_h,
                        pred_ctr_x + 0.5 * pred_w, pred_ctr_y + 0.5 * pred_h], dim=1)


def clip_boxes(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Clip ``[N, 4]`` boxes to ``[0, width − 1] × [0, height − 1]`` (pixels of the image they live in)."""
    x = boxes[:, 0::2].clamp(min=0.0, max=float(width - 1))
    y = boxes[:, 1::2].clamp(min=0.0, max=float(height - 1))
    return torch.stack([x[:, 0], y[:, 0], x[:, 1], y[:, 1]], dim=1)


def keep_min_size(boxes: torch.Tensor, min_size: float) -> torch.Tensor:
    """Indices ``[M]`` of boxes whose "+1" width and height are both ≥ ``min_size`` pixels."""
    widths = boxes[:, 2] - boxes[:, 0] + 1.0
    heights = boxes[:, 3] - boxes[:, 1] + 1.0
    return torch.nonzero((widths >= min_size) & (heights >= min_size), as_tuple=False).flatten()


def legacy_nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy NMS with "+1" areas (the Caffe/py-faster-rcnn ``nms``), as indices ``[M]`` by decreasing score.

    torchvision's kernel on boxes shifted by ``[0, 0, 1, 1]`` computes exactly the legacy overlap (a box is
    suppressed when its IoU with a kept, higher-scoring box is ``> iou_threshold``)."""
    return nms(plus_one(boxes), scores, iou_threshold)


def legacy_iou(boxes: torch.Tensor) -> torch.Tensor:
    """Pairwise "+1" IoU ``[N, N]`` of ``[N, 4]`` boxes (the overlap :func:`legacy_nms` thresholds)."""
    shifted = plus_one(boxes)
    return box_iou(shifted, shifted)
