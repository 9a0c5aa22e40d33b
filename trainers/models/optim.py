"""Optimiser pieces torch does not offer: several optimisers behaving as one (JGCAR's SGD + RMSprop)."""
from __future__ import annotations

from typing import Sequence
import inspect

import torch


class PerGroupOptimizer(torch.optim.Optimizer):
    """Several torch optimisers, each over its own parameters, behaving as one (JGCAR's SGD + RMSprop, §3.1).

    Shares the inner ``param_groups`` dicts (a scheduler's lr reaches them), steps each, saves/loads them together.
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


#: ``--optimizer-impl`` choices: how torch runs an optimiser's update over the parameters
IMPLEMENTATIONS = ("auto", "fused", "foreach", "loop")


def inner_optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimisers that do the work: the parts of a :class:`PerGroupOptimizer`, else ``optimizer``."""
    return list(optimizer.optimizers) if isinstance(optimizer, PerGroupOptimizer) else [optimizer]


def supports_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether torch has a fused kernel for this optimiser class (Adam, AdamW, SGD …; not RMSprop, Adadelta)."""
    return "fused" in inspect.signature(type(optimizer).__init__).parameters


def resolve_implementation(requested: str, optimizer: torch.optim.Optimizer, device: torch.device) -> str:
    """The implementation ``requested`` means for one torch optimiser on ``device``.

    ``auto``: ``fused`` on CUDA where torch has a fused kernel for the class, else ``foreach`` on CUDA; ``loop``
    (torch's own default there, so CPU runs keep their numbers) elsewhere. ``fused`` on a class without a fused
    kernel is ``foreach``, the next fastest."""
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"optimizer_impl must be one of {', '.join(IMPLEMENTATIONS)}, not {requested!r}")
    if requested == "auto":
        if device.type != "cuda":
            return "loop"
        requested = "fused"
    if requested == "fused" and not supports_fused(optimizer):
        return "foreach"
    return requested


def apply_implementation(optimizer: torch.optim.Optimizer, requested: str, device: torch.device) -> list[str]:
    """Run every inner optimiser with the implementation ``requested`` resolves to; returns one name per optimiser
    (e.g. ``["fused", "foreach"]``). Works after ``load_state_dict`` too, moving ``step`` counters (docs/trainer.md,
    "On the GPU")."""
    chosen = []
    for inner in inner_optimizers(optimizer):
        impl = resolve_implementation(requested, inner, device)
        chosen.append(impl)
        for group in inner.param_groups:
            if "fused" in group or impl == "fused":
                group["fused"] = impl == "fused"
            group["foreach"] = impl == "foreach"
            for p in group["params"]:
                state = inner.state.get(p, {})
                step = state.get("step")
                if isinstance(step, torch.Tensor):
                    on_device = impl == "fused" or group.get("capturable", False)
                    state["step"] = step.to(dtype=torch.float32, device=p.device if on_device else "cpu")
    return chosen
