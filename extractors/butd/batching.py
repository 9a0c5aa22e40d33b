"""Several images through one detector forward, with every image's result equal to its one-image forward.

Positions outside each image's own feature map are zeroed wherever a layer reads a neighbourhood; why that is exact
and when it is bitwise: docs/butd.md ("Batching")."""
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
    """``[B, 1, height, width]`` bool: True inside image ``b``'s own ``sizes[b]`` = (h, w) top-left block."""
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
