"""The Caffe-style ResNet-101 "C4" backbone (stem, res2–res4) and the bottleneck block res5 reuses.

Where it differs from torchvision's ResNet: docs/butd.md ("Faithfulness"); names follow detectron2's layout of the
MILVLG checkpoints (``backbone.stem.conv1.weight`` …), so they load key for key."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops.misc import FrozenBatchNorm2d

from retr.extractors.butd.batching import conv_output_size, pool_output_size, stage_sizes, valid_mask

#: blocks per stage of ResNet-101: res2, res3, res4 (backbone) and res5 (region head)
RESNET101_BLOCKS = {"res2": 3, "res3": 4, "res4": 23, "res5": 3}


class ConvNorm(nn.Conv2d):
    """A bias-free convolution followed by its frozen batch norm (stored as the child ``norm``).

    Input ``[B, C_in, H, W]`` → ``[B, C_out, H', W']``; no activation."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 padding: int = 0, dilation: int = 1):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                         dilation=dilation, bias=False)
        self.norm = FrozenBatchNorm2d(out_channels, eps=1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(super().forward(x))


class Bottleneck(nn.Module):
    """ResNet bottleneck with the stride in the first 1×1 conv (Caffe ResNet / detectron2 ``stride_in_1x1``).

    ``conv1`` 1×1/stride → ReLU → ``conv2`` 3×3 (dilation d, padding d) → ReLU → ``conv3`` 1×1, plus the identity or
    the 1×1/stride ``shortcut`` projection, then ReLU."""

    def __init__(self, in_channels: int, bottleneck_channels: int, out_channels: int, stride: int = 1,
                 dilation: int = 1):
        super().__init__()
        self.shortcut = (ConvNorm(in_channels, out_channels, 1, stride=stride)
                         if in_channels != out_channels or stride != 1 else None)
        self.conv1 = ConvNorm(in_channels, bottleneck_channels, 1, stride=stride)
        self.conv2 = ConvNorm(bottleneck_channels, bottleneck_channels, 3, padding=dilation, dilation=dilation)
        self.conv3 = ConvNorm(bottleneck_channels, out_channels, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, C_in, H, W]`` → ``[B, C_out, H', W']``.

        ``mask`` (padded batches only, see :mod:`retr.extractors.butd.batching`): ``[B, 1, H', W']`` bool, True at
        each image's real positions; the 3×3 conv's input is zeroed elsewhere, as its own zero padding."""
        out = F.relu_(self.conv1(x))
        if mask is not None:
            out = out.masked_fill_(~mask, 0.0)
        out = F.relu_(self.conv2(out))
        out = self.conv3(out)
        out = out + (self.shortcut(x) if self.shortcut is not None else x)
        return F.relu_(out)


def make_stage(num_blocks: int, in_channels: int, bottleneck_channels: int, out_channels: int,
               first_stride: int, dilation: int = 1) -> nn.Sequential:
    """``num_blocks`` bottlenecks; only the first changes channels/stride. Children are named ``0``, ``1``, …"""
    blocks = [Bottleneck(in_channels if i == 0 else out_channels, bottleneck_channels, out_channels,
                         stride=first_stride if i == 0 else 1, dilation=dilation) for i in range(num_blocks)]
    return nn.Sequential(*blocks)


class CaffeStem(nn.Module):
    """``conv1`` 7×7/2 (pad 3) + frozen BN → ReLU → max-pool 3×3/2, pad 0, ceil mode. ``[B,3,H,W]`` → ``[B,64,·,·]``."""

    def __init__(self):
        super().__init__()
        self.conv1 = ConvNorm(3, 64, 7, stride=2, padding=3)

    pool_kernel, pool_stride = 3, 2

    def forward(self, x: torch.Tensor, sizes: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """``sizes`` (padded batches only): each image's (h, w); the pool's input is zeroed outside them."""
        x = F.relu_(self.conv1(x))
        if sizes is not None:
            conv_sizes = stage_sizes(sizes, lambda n, axis: conv_output_size(n, self.conv1, axis))
            x = x.masked_fill_(~valid_mask(conv_sizes, x.shape[-2], x.shape[-1], x.device), 0.0)
        return F.max_pool2d(x, kernel_size=self.pool_kernel, stride=self.pool_stride, padding=0, ceil_mode=True)

    def output_sizes(self, sizes: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Each image's (h, w) after the stem, as its one-image forward gives it."""
        conv = stage_sizes(sizes, lambda n, axis: conv_output_size(n, self.conv1, axis))
        return stage_sizes(conv, lambda n, axis: pool_output_size(n, self.pool_kernel, self.pool_stride, 0, True))


class ResNetC4(nn.Module):
    """Stem + res2 + res3 + res4 of ResNet-101: ``[B, 3, H, W]`` → res4 ``[B, 1024, ~H/16, ~W/16]``."""

    out_channels = 1024
    stride = 16

    def __init__(self):
        super().__init__()
        self.stem = CaffeStem()
        self.res2 = make_stage(RESNET101_BLOCKS["res2"], 64, 64, 256, first_stride=1)
        self.res3 = make_stage(RESNET101_BLOCKS["res3"], 256, 128, 512, first_stride=2)
        self.res4 = make_stage(RESNET101_BLOCKS["res4"], 512, 256, 1024, first_stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res4(self.res3(self.res2(self.stem(x))))

    def forward_padded(self, x: torch.Tensor, sizes: list[tuple[int, int]]
                       ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """A padded batch ``[B, 3, H, W]`` and each image's (h, w) → (res4 ``[B, 1024, H4, W4]``, each res4 (h, w)),
        equal to :meth:`forward` inside each image's size and zero outside."""
        sizes = [(int(h), int(w)) for h, w in sizes]
        x = self.stem(x, sizes)
        sizes = self.stem.output_sizes(sizes)
        masks: dict[tuple, torch.Tensor] = {}
        for stage in (self.res2, self.res3, self.res4):
            for block in stage:
                sizes = stage_sizes(sizes, lambda n, axis: conv_output_size(n, block.conv1, axis))
                height = conv_output_size(x.shape[-2], block.conv1, 0)
                width = conv_output_size(x.shape[-1], block.conv1, 1)
                key = (tuple(sizes), height, width)
                if key not in masks:
                    masks[key] = valid_mask(sizes, height, width, x.device)
                x = block(x, masks[key])
        return x.masked_fill_(~masks[key], 0.0), sizes
