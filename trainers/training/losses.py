"""The bidirectional hinge (triplet) loss every model trains with, written once.

For a score matrix ``S`` [B, B] of images (rows) × captions (columns) whose diagonal holds the matching pairs
(VSE++ / SCAN, ``ContrastiveLoss``)::

    cost_s[i, j]  = [margin + S[i, j] - S[i, i]]₊   caption j as a negative of image i
    cost_im[i, j] = [margin + S[i, j] - S[j, j]]₊   image i as a negative of caption j

with the diagonal zeroed. ``max_violation=True`` (hardest negatives, VSE++) keeps only the largest violation of
each row of ``cost_s`` and each column of ``cost_im``; otherwise every violation counts. The result is a **sum**
over the batch, as in the authors' code (not a mean: the learning rates of the papers assume it).

As in the authors' code, two captions of one image in a batch are negatives of each other; pass
``positives`` (a [B, B] bool mask of pairs that must not be used as negatives) to exclude such pairs instead.
"""
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
    """How the matching pairs of one training batch rank among its other pairs (tensors, no gradient).

    The collapse monitor (:mod:`retr.trainers.training.collapse`) reads these after each step: a model whose scores have
    collapsed to equal values ranks the matching pair first no more often than chance, whatever its loss.

    * ``hits`` — 0-d: rows (images) whose matching caption outscores every negative caption, plus columns
      (captions) whose matching image outscores every negative image (a tie counts as a miss);
    * ``expected`` / ``variance`` — 0-d: the mean and variance of ``hits`` for scores in random order (a row with
      ``n`` negatives ranks its pair first with probability ``1 / (n + 1)``);
    * ``trials`` — rows plus columns that have at least one negative;
    * ``hinge`` — 0-d: the batch's hinge loss; ``hinge_at_equal_scores`` — its value when every score is equal
      (``2·B·margin`` for hardest negatives, ``2·B·(B−1)·margin`` for the sum, fewer with ``positives``).
    """

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
    return BatchRanking(hits=(firsts & has_negative).sum(), expected=chance[has_negative].sum(),
                        variance=(chance * (1 - chance))[has_negative].sum(), trials=has_negative.sum(),
                        hinge=hinge.detach().float(), hinge_at_equal_scores=at_equal)
