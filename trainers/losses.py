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
