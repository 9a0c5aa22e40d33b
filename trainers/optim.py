"""Optimiser pieces torch does not offer: several optimisers behaving as one (JGCAR's SGD + RMSprop)."""
from __future__ import annotations

from typing import Sequence

import torch


class PerGroupOptimizer(torch.optim.Optimizer):
    """Several torch optimisers, each over its own parameters, behaving as one :class:`~torch.optim.Optimizer`.

    JGCAR trains its global part with SGD and its co-attention with RMSprop (§3.1). The shared loop holds one
    optimiser and one learning-rate scheduler; this wrapper shares the inner optimisers' ``param_groups``
    (the same dicts, so a scheduler's lr changes reach them), steps each, and saves/loads their states
    together. torch has no built-in for this (``torch.optim`` optimisers apply one algorithm to all groups).
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        self.optimizers = list(optimizers)
        groups = [g for opt in self.optimizers for g in opt.param_groups]
        super().__init__(groups, defaults={})
        self.param_groups = groups          # the very dicts of the inner optimisers

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for opt in self.optimizers:
            opt.step()
        return loss

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        for opt, state in zip(self.optimizers, state_dict["optimizers"]):
            opt.load_state_dict(state)
        self.param_groups = [g for opt in self.optimizers for g in opt.param_groups]
