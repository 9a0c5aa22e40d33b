"""The Caffe anchor table of the bottom-up-attention RPN and its shift over the feature map.

The original ``generate_anchors`` (py-faster-rcnn) is reproduced instead of torchvision's ``AnchorGenerator``, which
centres and rounds differently: a 16×16 base box ``[0, 0, 15, 15]`` (centre 7.5), for each aspect ratio ``h/w`` a
box of the same area with ``w = round(sqrt(256 / ratio))`` and ``h = round(w · ratio)`` (NumPy's round-half-to-even,
as in the original), then each such box scaled by 4, 8, 16, 32. Order is ratio-major."""
from __future__ import annotations

import numpy as np
import torch

#: aspect ratios (height / width) and scales of the bottom-up-attention RPN
ANCHOR_RATIOS = (0.5, 1.0, 2.0)
ANCHOR_SCALES = (4, 8, 16, 32)
#: stride of the res4 feature map in input pixels
FEATURE_STRIDE = 16


def _box_from_size(width: np.ndarray, height: np.ndarray, x_ctr: float, y_ctr: float) -> np.ndarray:
    """Boxes ``[n, 4]`` (x1, y1, x2, y2; inclusive pixel ends) of the given sizes around one centre."""
    return np.stack([x_ctr - 0.5 * (width - 1), y_ctr - 0.5 * (height - 1),
                     x_ctr + 0.5 * (width - 1), y_ctr + 0.5 * (height - 1)], axis=1)


def caffe_cell_anchors(base_size: int = FEATURE_STRIDE, ratios: tuple[float, ...] = ANCHOR_RATIOS,
                       scales: tuple[int, ...] = ANCHOR_SCALES) -> torch.Tensor:
    """The ``[len(ratios)·len(scales), 4]`` float32 anchor table (12×4 by default), ratio-major."""
    width = height = float(base_size)
    x_ctr, y_ctr = 0.5 * (width - 1), 0.5 * (height - 1)
    area = width * height
    ratio_widths = np.round(np.sqrt(area / np.asarray(ratios, dtype=np.float64)))
    ratio_heights = np.round(ratio_widths * np.asarray(ratios, dtype=np.float64))
    scales_arr = np.asarray(scales, dtype=np.float64)
    rows = [_box_from_size(w * scales_arr, h * scales_arr, x_ctr, y_ctr)
            for w, h in zip(ratio_widths, ratio_heights)]
    return torch.from_numpy(np.concatenate(rows, axis=0).astype(np.float32))


def shift_anchors(cell_anchors: torch.Tensor, height: int, width: int,
                  stride: int = FEATURE_STRIDE) -> torch.Tensor:
    """Every anchor at every feature-map cell: ``[height·width·A, 4]`` in input pixels, (h, w, anchor) order."""
    device = cell_anchors.device
    shift_y, shift_x = torch.meshgrid(torch.arange(height, device=device, dtype=torch.float32) * stride,
                                      torch.arange(width, device=device, dtype=torch.float32) * stride,
                                      indexing="ij")
    shifts = torch.stack([shift_x, shift_y, shift_x, shift_y], dim=-1).reshape(-1, 1, 4)
    return (shifts + cell_anchors.reshape(1, -1, 4)).reshape(-1, 4)
