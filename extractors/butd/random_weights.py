"""``weights="random"``: a deterministic, well-scaled random detector for tests, the demo and learning checks
(initialisation and norm calibration: docs/butd.md, "--weights random"). Seeded with every extractor's
:data:`~retr.extractors.weights.RANDOM_SEED` and kept in their one cache
(:func:`~retr.extractors.weights.seeded_random_model`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops.misc import FrozenBatchNorm2d

from retr.extractors.butd.backbone import Bottleneck
from retr.extractors.butd.model import BottomUpAttention, empty_detector
from retr.extractors.spec import RandomInit
from retr.extractors.weights import RANDOM_SEED, seeded_random_model

#: retr's own initialisation (the detector has no library's): the spec's ``random``
RANDOM = RandomInit("butd")
#: the calibration pseudo-image: [3, H, W] Gaussian noise with the spread of mean-subtracted 0–255 pixels
CALIBRATION_HW = (160, 224)
CALIBRATION_PIXEL_STD = 60.0
#: proposals through res5 during calibration
CALIBRATION_PROPOSALS = 32


#: output standard deviation of each residual branch's last norm (the others output 1)
RESIDUAL_GAIN = 0.2


def _calibrate_norm(module: FrozenBatchNorm2d, inputs: tuple[torch.Tensor]) -> None:
    x = inputs[0]
    module.running_mean.copy_(x.mean(dim=(0, 2, 3)))
    module.running_var.copy_(x.var(dim=(0, 2, 3), unbiased=False))
    module.weight.fill_(getattr(module, "calibration_gain", 1.0))
    module.bias.zero_()


@torch.no_grad()
def randomize_(model: BottomUpAttention, seed: int = RANDOM_SEED) -> BottomUpAttention:
    """Fill ``model`` with the seeded random weights and calibrated norms (in place; returns it).

    The result depends only on ``seed`` and the detector settings. It is made on the CPU once per process in the
    extractors' shared cache of random networks (key ``("butd", seed, settings)``) and copied into ``model``."""
    kept = seeded_random_model((RANDOM.library, seed, model.settings),
                               lambda: _randomized(model.settings, seed), copy_out=False)
    model.load_state_dict(kept.state_dict())
    return model


@torch.no_grad()
def _randomized(settings, seed: int) -> BottomUpAttention:
    """A new detector on the CPU with ``settings``, filled by :func:`_randomize`."""
    model = empty_detector(settings)
    _randomize(model, seed)
    return model


def _randomize(model: BottomUpAttention, seed: int) -> None:
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
    for module in model.modules():
        if isinstance(module, Bottleneck):
            module.conv3.norm.calibration_gain = RESIDUAL_GAIN
    device = next(model.parameters()).device
    coarse = torch.randn(1, 3, CALIBRATION_HW[0] // 16, CALIBRATION_HW[1] // 16, generator=generator)
    image = F.interpolate(coarse, size=CALIBRATION_HW, mode="bilinear", align_corners=False)[0]
    image = (image / image.std() * CALIBRATION_PIXEL_STD).to(device)
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
        for module in model.modules():
            if hasattr(module, "calibration_gain"):
                del module.calibration_gain
