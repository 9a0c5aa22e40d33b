"""Telling a collapsed training run from a slow one, while it trains: in-batch ranking against chance.

Why it watches the ordering, and why 20 steps and two standard deviations: docs/trainer.md ("Warm-up and the
collapse monitor")."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from retr.trainers.models.losses import BatchRanking

#: steps summed per check, and the first step checked
STRETCH = 20
#: at chance: hits less than this many standard deviations above the chance expectation
Z_AT_CHANCE = 2.0
#: what a user can do about a collapse (named in the warning)
REMEDIES = ("--warmup-epochs 2 (sum of violations first, as VSE∞)", "--sum-violation", "a lower --lr",
            "a smaller --batch-size")


@dataclass
class StepRanking:
    """One step's in-batch ranking as plain numbers (checkpointed with the monitor)."""

    hits: float
    expected: float
    variance: float
    trials: float
    hinge: float
    hinge_at_equal_scores: float

    @classmethod
    def of(cls, ranking: BatchRanking) -> "StepRanking":
        """The numbers of a model's ``batch_ranking`` (one device-to-host copy)."""
        values = torch.stack([getattr(ranking, name).float() for name in cls.__dataclass_fields__]).tolist()
        return cls(*values)


@dataclass
class CollapseMonitor:
    """Watches the in-batch ranking step by step and says once when it has stayed at chance for a stretch."""

    stretch: int = STRETCH
    z_at_chance: float = Z_AT_CHANCE
    recent: deque = field(default_factory=deque)
    warned_at: int | None = None

    def observe(self, step: int, ranking: StepRanking | None) -> dict | None:
        """Record ``step``'s ranking; returns the collapse event (once) when the last ``stretch`` steps are at
        chance, else None. Steps without a ranking (a batch without negatives) are skipped."""
        if ranking is None or ranking.trials == 0:
            return None
        self.recent.append(ranking)
        while len(self.recent) > self.stretch:
            self.recent.popleft()
        if self.warned_at is not None or len(self.recent) < self.stretch:
            return None
        hits = sum(r.hits for r in self.recent)
        expected = sum(r.expected for r in self.recent)
        sd = math.sqrt(max(sum(r.variance for r in self.recent), 1e-12))
        z = (hits - expected) / sd
        if z >= self.z_at_chance:
            return None
        self.warned_at = step
        trials = sum(r.trials for r in self.recent)
        return {"event": "collapse", "step": step, "stretch": self.stretch,
                "in_batch_top1": hits / trials, "chance": expected / trials, "z": z,
                "hinge": float(np.mean([r.hinge for r in self.recent])),
                "hinge_at_equal_scores": float(np.mean([r.hinge_at_equal_scores for r in self.recent]))}

    def state_dict(self) -> dict:
        return {"recent": [vars(r).copy() for r in self.recent], "warned_at": self.warned_at}

    def load_state_dict(self, state: dict) -> None:
        self.recent = deque(StepRanking(**r) for r in state.get("recent", []))
        self.warned_at = state.get("warned_at")


def collapse_message(event: dict, epoch: int) -> str:
    """The one warning line of a collapse ``event`` (from :meth:`CollapseMonitor.observe`)."""
    return (f"warning: training has collapsed (step {event['step']}, epoch {epoch + 1}): over the last "
            f"{event['stretch']} steps the matching pair ranked first in its batch row or column "
            f"{100 * event['in_batch_top1']:.2f}% of the time, chance is {100 * event['chance']:.2f}% "
            f"(hinge {event['hinge']:.1f}, equal-scores value {event['hinge_at_equal_scores']:.1f}): every score "
            f"is alike, as hardest negatives from scratch often do; restart with {', '.join(REMEDIES[:-1])} "
            f"or {REMEDIES[-1]}")


# ------------------------------------------------------------------------------------------------ validation

def chance_recalls(caption_image: np.ndarray, ks: tuple[int, ...] = (1, 5, 10)) -> dict[str, dict[int, float]]:
    """``{"i2t": {K: p}, "t2i": {K: p}}``: probability that a random ordering puts a match in the top K.

    ``caption_image`` ``[n_cap]`` int: the image of each caption."""
    caption_image = np.asarray(caption_image)
    n_cap = caption_image.size
    per_image = np.bincount(caption_image)
    per_image = per_image[per_image > 0]
    n_img = per_image.size
    out: dict[str, dict[int, float]] = {"i2t": {}, "t2i": {}}
    for k in ks:
        out["t2i"][k] = min(k, n_img) / n_img
        none_in_top = [math.comb(n_cap - c, k) / math.comb(n_cap, k) if k <= n_cap else 0.0 for c in per_image]
        out["i2t"][k] = float(np.mean([1 - p for p in none_in_top]))
    return out


def recall_at_chance(metrics: dict, caption_image: np.ndarray, z_at_chance: float = Z_AT_CHANCE) -> dict | None:
    """The validation-at-chance event when ``metrics`` (``{"i2t": {"r1", "r5", "r10"}, "t2i": …, "rsum"}``, in
    percent) are no better than a random ordering of the split (``caption_image`` [n_cap]), else None."""
    chance = chance_recalls(caption_image)
    caption_image = np.asarray(caption_image)
    queries = {"i2t": np.unique(caption_image).size, "t2i": caption_image.size}
    hits = expected = variance = 0.0
    chance_rsum = 0.0
    for direction, per_k in chance.items():
        n = queries[direction]
        for k, p in per_k.items():
            hits += metrics[direction][f"r{k}"] / 100 * n
            expected += p * n
            variance += p * (1 - p) * n
            chance_rsum += 100 * p
    z = (hits - expected) / math.sqrt(max(variance, 1e-12))
    if z >= z_at_chance:
        return None
    return {"event": "val_at_chance", "rsum": float(metrics["rsum"]), "chance_rsum": chance_rsum, "z": z}


def val_at_chance_message(event: dict, epochs: int) -> str:
    return (f"warning: after {epochs} epoch(s) validation recall is still at chance (rSum {event['rsum']:.1f}, "
            f"a random ordering gives {event['chance_rsum']:.1f}): the model has not learned to rank; if a "
            f"collapse was reported above, restart with {REMEDIES[0]}")
