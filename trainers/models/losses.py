"""The bidirectional hinge (triplet) loss every model trains with (VSE++ / SCAN ``ContrastiveLoss``).

``S`` [B, B] images × captions, diagonal matching: ``cost_s[i, j] = [m + S[i, j] − S[i, i]]₊``,
``cost_im[i, j] = [m + S[i, j] − S[j, j]]₊``, diagonal zeroed; ``max_violation`` keeps each row's / column's
largest. A **sum** over the batch, as the authors'; ``positives`` [B, B] bool excludes pairs as negatives."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def hinge_triplet_loss(scores: torch.Tensor, margin: float = 0.2, max_violation: bool = True,
                       positives: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of the bidirectional hinge loss of ``scores`` [B, B] (diagonal = matching pairs); a scalar."""
    if scores.dim() != 2 or scores.shape[0] != scores.shape[1]:
        raise ValueError(f"scores must be square [B, B], got {tuple(scores.shape)}")
    diagonal = scores.diagonal().view(-1, 1)
    cost_s = (margin + scores - diagonal).clamp(min=0)        # row i: captions vs image i's own caption
    cost_im = (margin + scores - diagonal.t()).clamp(min=0)   # column j: images vs caption j's own image
    excluded = torch.eye(scores.shape[0], dtype=torch.bool, device=scores.device)
    if positives is not None:
        excluded = excluded | positives.to(device=scores.device, dtype=torch.bool)
    cost_s = cost_s.masked_fill(excluded, 0)
    cost_im = cost_im.masked_fill(excluded, 0)
    if max_violation:
        return cost_s.max(dim=1)[0].sum() + cost_im.max(dim=0)[0].sum()
    return cost_s.sum() + cost_im.sum()


@dataclass
class BatchRanking:
    """How the matching pairs of one training batch rank among its other pairs (0-d tensors, no gradient).

    ``hits`` (rows and columns whose match strictly outscores every negative), ``expected``/``variance`` under a
    random order, ``trials``, ``hinge`` and ``hinge_at_equal_scores``; read by the collapse monitor."""

    hits: torch.Tensor
    expected: torch.Tensor
    variance: torch.Tensor
    trials: torch.Tensor
    hinge: torch.Tensor
    hinge_at_equal_scores: torch.Tensor


@torch.no_grad()
def in_batch_ranking(scores: torch.Tensor, margin: float, max_violation: bool, hinge: torch.Tensor,
                     positives: torch.Tensor | None = None) -> BatchRanking:
    """:class:`BatchRanking` of ``scores`` [B, B] (diagonal = matching pairs; ``positives`` [B, B] bool as in
    :func:`hinge_triplet_loss`, excluded from the negatives) whose hinge loss was ``hinge``."""
    scores = scores.detach().float()
    b = scores.shape[0]
    excluded = torch.eye(b, dtype=torch.bool, device=scores.device)
    if positives is not None:
        excluded = excluded | positives.to(device=scores.device, dtype=torch.bool)
    negatives = scores.masked_fill(excluded, float("-inf"))
    diagonal = scores.diagonal()
    counts = torch.cat([(~excluded).sum(1), (~excluded).sum(0)])                 # negatives per row, per column
    has_negative = counts > 0
    firsts = torch.cat([diagonal > negatives.max(1).values, diagonal > negatives.max(0).values])
    chance = 1.0 / (counts.float() + 1)
    at_equal = margin * (has_negative.sum() if max_violation else counts.sum()).float()
    chance = chance.where(has_negative, 0.0)         # not chance[has_negative]: that would read a count back
    return BatchRanking(hits=(firsts & has_negative).sum(), expected=chance.sum(),
                        variance=(chance * (1 - chance)).sum(), trials=has_negative.sum(),
                        hinge=hinge.detach().float(), hinge_at_equal_scores=at_equal)
