"""Several images through one detector forward, with every image's result equal to its one-image forward.

Images of a batch are zero-padded at the right and bottom to the batch's largest size (zeros *after* the mean
subtraction, as Caffe's ``im_list_to_blob`` and detectron2's ``ImageList`` pad). Padding alone would not keep
the results exact, for a reason that rounding the padded size to a multiple of the network's stride does not
remove: inside the network the padded area is no longer zero. The stem convolution turns the zero pixels into
``ReLU(BN bias)`` and later layers into other non-zero values, so every 3×3 convolution at the right/bottom
edge of the real image would see those values where the one-image forward sees its own zero padding, and the
ceil-mode max-pool and ROI pooling at that edge would take maxima over them where the one-image forward
ignores the positions. The difference then spreads inward by one cell per 3×3 convolution (30 of them before
res4).

So the batched forward keeps, for every image, the size its own feature map has at each resolution
(:func:`stage_sizes`, the same output-size rule the layers apply) and zeroes the positions outside it
(:func:`valid_mask`) wherever a layer reads a neighbourhood: before the stem max-pool, before the 3×3
convolution of every bottleneck, and on res4 (read by the RPN's 3×3 convolution and by ROI pooling). That is
exact because

* a convolution's zero padding *is* zeros at those positions, and the real image starts at the same origin in
  every map (padding is only at the right/bottom; strides count from the top-left), so the values at the real
  positions are the same sums of the same products;
* the max-pool and ROI-pool inputs follow a ReLU (values ≥ 0), and every window the one-image forward pools
  holds at least one real position, so adding zeros does not change a maximum (an ROI bin that is empty in the
  one-image forward is 0 there, and is all zeros, hence 0, here).

Whether the arithmetic is also *bitwise* the same depends on the convolution kernels summing in the same order
for another batch size and spatial size: on the CPU (oneDNN) it does, and ``tests/test_butd_batched.py``
checks features, boxes and ids with ``torch.equal``. Everything after the backbone (proposal layer, ROI heads,
selection) runs on each image's own tensors of the one-image shapes, so it is exact wherever the backbone is.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn


def conv_output_size(size: int, conv: nn.Conv2d, axis: int) -> int:
    """Output length along ``axis`` (0 = height, 1 = width) of ``conv`` for an input of length ``size``."""
    k, s, p, d = conv.kernel_size[axis], conv.stride[axis], conv.padding[axis], conv.dilation[axis]
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def pool_output_size(size: int, kernel: int, stride: int, padding: int = 0, ceil_mode: bool = False) -> int:
    """Output length of ``F.max_pool2d`` (PyTorch's rule, incl. the ceil-mode one: the last window starts inside)."""
    span = size + 2 * padding - kernel
    out = (math.ceil(span / stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def valid_mask(sizes: Sequence[tuple[int, int]], height: int, width: int, device: torch.device | str
               ) -> torch.Tensor:
    """``[B, 1, height, width]`` bool: True inside image ``b``'s own ``sizes[b]`` = (h, w) top-left block.

    Built from comparisons with Python integers, so on CUDA it needs no host-to-device copy.
    """
    rows = torch.arange(height, device=device)
    cols = torch.arange(width, device=device)
    return torch.stack([(rows < h)[:, None] & (cols < w)[None, :] for h, w in sizes])[:, None]


def pad_images(images: Sequence[torch.Tensor]) -> torch.Tensor:
    """``B`` images ``[3, H_b, W_b]`` → ``[B, 3, max H, max W]``, zeros at the right and bottom of each."""
    if not images:
        raise ValueError("pad_images needs at least one image")
    height = max(int(image.shape[-2]) for image in images)
    width = max(int(image.shape[-1]) for image in images)
    batch = images[0].new_zeros((len(images), images[0].shape[0], height, width))
    for b, image in enumerate(images):
        batch[b, :, : image.shape[-2], : image.shape[-1]] = image
    return batch


def stage_sizes(sizes: Sequence[tuple[int, int]], rule) -> list[tuple[int, int]]:
    """Apply a per-axis output-size ``rule(size, axis)`` to every image's (h, w)."""
    return [(rule(h, 0), rule(w, 1)) for h, w in sizes]


__all__ = ["conv_output_size", "pad_images", "pool_output_size", "stage_sizes", "valid_mask"]
