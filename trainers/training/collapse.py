"""Telling a collapsed training run from a slow one, while it trains.

The hardest-negative hinge (VSE++), trained from scratch on small or weak data, can drive every score of a
batch to the same value: each hinge term then equals the margin, the loss sits at ``2·B·margin`` and the model
ranks at chance (fartashf/vsepp#27, kuanghuei/SCAN#36). Neither the loss nor the spread of the scores tells
this apart from a run that learns slowly: a run that learns sits at the same loss for epochs, with a score
spread just as small. What differs is the *ordering*, so the monitor watches that.

**In-batch retrieval.** After every step the model's :class:`~retr.trainers.training.losses.BatchRanking` says how many
rows (images) and columns (captions) of the batch rank their matching pair strictly first, and how many would
by chance (``1 / (n + 1)`` for a row with ``n`` negatives: ``1/B`` for a batch of ``B``). Over the last
:data:`STRETCH` steps the counts are summed; the run is *at chance* when the hits exceed the chance
expectation by less than :data:`Z_AT_CHANCE` standard deviations (a binomial count, normal approximation).

* Why a stretch of 20 steps: a batch of 128 gives 256 rankings a step, so 20 steps hold 5,120 of them with a
  chance expectation of 40 hits (two a step, whatever B; standard deviation 6.3). Measured on the 150-image synthetic set (docs/benchmarks.md,
  "Training collapse"; 5 steps an epoch): over steps 1–20 the published SCAN loss ranked 0.58% first
  (z = −1.9, it fires at step 20, epoch 4), while the runs that learn — `--sum-violation` and
  `--warmup-epochs 1/2/4` — ranked 2.5–2.9% first (z = 14 to 17). Twenty steps are four epochs of that set.
* Why two standard deviations: under true collapse the statistic is about N(0, 1) or below (ties count as
  misses), so a check fires with probability 0.98 or more; a run that is learning at all is many deviations
  above. The learning tests (SCAN and VSE++ on hardest negatives, batch 32) stay silent.
* The first check is at step :data:`STRETCH` (a full stretch); every step after that is checked, so a run
  that collapses later (after a warm-up, after a learning-rate change) is caught too. The warning is given
  once per run, and the state is kept in the checkpoint, so a resumed run warns where the uninterrupted one did.
* The loss is only a hint: the line quotes the hinge next to its equal-scores value.

**Validation at chance.** At the end of training, the last validation recalls are compared with what a random
ordering gives for the validation split's size (:func:`chance_recalls`): the R@1, R@5 and R@10 hits of both
directions are summed and the same two-standard-deviation test applied.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from retr.trainers.training.losses import BatchRanking

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
    """Probability that a random ordering puts a match in the top K, per direction: ``{"i2t": {K: p},
    "t2i": {K: p}}`` for a split whose caption ``c`` shows image ``caption_image[c]`` ([n_cap] int).

    Text→image: one matching image among ``N``, so ``min(K, N) / N``. Image→text, for an image with ``c`` of the
    ``T`` captions: ``1 − C(T − c, K) / C(T, K)``, averaged over the images.
    """
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
