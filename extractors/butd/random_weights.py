"""``--weights random``: a deterministic, well-scaled random detector for tests, the demo and learning checks.

The detections are meaningless, but the whole flow runs and the features are finite and of moderate size:
convolutions get He-normal weights (fan-out, as torchvision's ResNets), linear layers N(0, 0.01²) (the
original heads' init), and every frozen batch norm's statistics are *calibrated*: one forward pass over a fixed
pseudo-image sets each norm's running mean/variance to the statistics of its own input, so every norm outputs
zero-mean, unit-variance activations, as a trained network's norms roughly do. Without that, 33 residual
blocks of random weights grow the activations past float16's range.
"""
from __future__ import annotations

import torch
from torch import nn
from torchvision.ops.misc import FrozenBatchNorm2d

from retr.extractors.butd.model import BottomUpAttention

#: seed of the random weights (recorded as ``weights = "random"``; the same seed gives the same network)
RANDOM_SEED = 0
#: the calibration pseudo-image: [3, H, W] Gaussian noise with the spread of mean-subtracted 0–255 pixels
CALIBRATION_HW = (160, 224)
CALIBRATION_PIXEL_STD = 60.0
#: proposals through res5 during calibration
CALIBRATION_PROPOSALS = 32


def _calibrate_norm(module: FrozenBatchNorm2d, inputs: tuple[torch.Tensor]) -> None:
    x = inputs[0]
    module.running_mean.copy_(x.mean(dim=(0, 2, 3)))
    module.running_var.copy_(x.var(dim=(0, 2, 3), unbiased=False))
    module.weight.fill_(1.0)
    module.bias.zero_()


@torch.no_grad()
def randomize_(model: BottomUpAttention, seed: int = RANDOM_SEED) -> BottomUpAttention:
    """Fill ``model`` with the seeded random weights and calibrated norms (in place; returns it)."""
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            fan_out = module.out_channels * module.kernel_size[0] * module.kernel_size[1]
            std = (2.0 / fan_out) ** 0.5
            if module in (model.proposal_generator.rpn_head.objectness_logits,
                          model.proposal_generator.rpn_head.anchor_deltas):
                std = 0.01
            module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.01)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
    device = next(model.parameters()).device
    image = (torch.randn(3, *CALIBRATION_HW, generator=generator) * CALIBRATION_PIXEL_STD).to(device)
    hooks = [m.register_forward_pre_hook(_calibrate_norm) for m in model.modules()
             if isinstance(m, FrozenBatchNorm2d)]
    proposals = model.proposal_generator
    saved_topk = proposals.post_nms_topk
    proposals.post_nms_topk = CALIBRATION_PROPOSALS  # the res5 norms need samples, not all 300 regions
    try:
        model.detect(image, scale=1.0)
    finally:
        proposals.post_nms_topk = saved_topk
        for hook in hooks:
            hook.remove()
    return model
