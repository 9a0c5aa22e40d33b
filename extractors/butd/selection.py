"""Which regions are kept: ``generate_tsv``'s per-class NMS selection, computed for all classes at once.

The original loops over the 1,600 object classes and, for each, runs NMS (legacy "+1" overlap, 0.3) on the
proposals with that class's scores; every box that survives in a class records that class's score if it beats
its best so far (``max_conf``). Then boxes with ``max_conf ≥ 0.2`` are kept; if fewer than ``min_boxes``, the
``min_boxes`` best by ``max_conf``; if more than ``max_boxes``, the ``max_boxes`` best.

All classes share the same boxes, so this module computes the pairwise overlap once and runs the greedy
suppression for every class together: at step ``i`` each class looks at its ``i``-th best box; the box is kept
if no kept box of that class suppressed it, and it suppresses, in that class, every box overlapping it by more
than the threshold. That is exactly greedy NMS per class (a box is only ever suppressed by a higher-ranked
kept box), with ``P`` steps of ``[C, P]`` tensor operations instead of ``C`` NMS calls, and classes that can
no longer change any box's ``max_conf`` are dropped along the way (exact; see :func:`per_class_max_conf`).

Order of the kept boxes: as in the original, index (proposal) order when the thresholded count is within
``[min_boxes, max_boxes]``, else decreasing ``max_conf``. Ties in ``max_conf`` (the original leaves their order
to NumPy's unstable sort) are broken by proposal index.
"""
from __future__ import annotations

import torch

from retr.extractors.butd.boxes import legacy_iou


def per_class_max_conf(boxes: torch.Tensor, class_scores: torch.Tensor, nms_threshold: float = 0.3,
                       prune_every: int = 8) -> torch.Tensor:
    """Each box's best score over the classes in whose NMS it survives: ``[P]``.

    Args:
        boxes: ``[P, 4]`` proposals (any pixel frame; the original uses original-image pixels).
        class_scores: ``[P, C]`` scores of the foreground classes only (background column removed).
        nms_threshold: legacy IoU threshold of the per-class NMS (0.3).
        prune_every: every this many ranks, classes that can no longer change the result are dropped.

    Pruning (exact): the decisions for ranks already processed are final, so the maximum over them is a lower
    bound ``L[b]`` of the result. A class whose remaining (lower-ranked) boxes all score ``≤ L[b]`` in it can
    neither raise any box's maximum (the original updates only on a strictly larger score) nor matter for any
    other class, so it is dropped. With peaked class probabilities most classes go after a few ranks.
    """
    num_boxes, num_classes = class_scores.shape
    max_conf = class_scores.new_zeros(num_boxes)
    if num_boxes == 0 or num_classes == 0:
        return max_conf
    overlaps = legacy_iou(boxes.float()) > nms_threshold                  # [P, P] bool
    scores = class_scores.t().contiguous()                                # [C, P]
    order = torch.argsort(scores, dim=1, descending=True, stable=True)    # [C, P] box index at each rank
    sorted_scores = torch.gather(scores, 1, order)                        # [C, P] decreasing
    suppressed = torch.zeros_like(scores, dtype=torch.bool)               # [C, P] by box index
    kept = torch.zeros_like(suppressed)
    for rank in range(num_boxes):
        if rank and rank % prune_every == 0:
            kept_scores = torch.where(kept, scores, torch.zeros_like(scores))
            max_conf = torch.maximum(max_conf, kept_scores.max(dim=0).values)
            remaining = sorted_scores[:, rank:] > max_conf[order[:, rank:]]
            needed = remaining.any(dim=1)
            if not bool(needed.all()):
                if not bool(needed.any()):
                    return max_conf
                scores, order, sorted_scores = scores[needed], order[needed], sorted_scores[needed]
                suppressed, kept = suppressed[needed], kept[needed]
        rows = torch.arange(len(scores), device=scores.device)
        current = order[:, rank]                                          # [c]
        alive = ~suppressed[rows, current]                                # [c]
        kept[rows, current] = alive
        suppressed |= overlaps[current] & alive[:, None]
    kept_scores = torch.where(kept, scores, torch.zeros_like(scores))
    return torch.maximum(max_conf, kept_scores.max(dim=0).values)


def choose_boxes(max_conf: torch.Tensor, conf_threshold: float = 0.2, min_boxes: int = 36,
                 max_boxes: int = 36) -> torch.Tensor:
    """Indices ``[n]`` of the kept boxes (``n ≤ max_boxes``; ``n < min_boxes`` only if there are fewer boxes)."""
    above = torch.nonzero(max_conf >= conf_threshold, as_tuple=False).flatten()
    if min_boxes <= len(above) <= max_boxes:
        return above
    index = torch.arange(len(max_conf), device=max_conf.device)
    # sort by (-max_conf, index): stable sort on index order, then by decreasing confidence
    by_conf = index[torch.argsort(max_conf, descending=True, stable=True)]
    return by_conf[: (min_boxes if len(above) < min_boxes else max_boxes)]


def select_regions(boxes: torch.Tensor, cls_prob: torch.Tensor, nms_threshold: float = 0.3,
                   conf_threshold: float = 0.2, min_boxes: int = 36, max_boxes: int = 36
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """generate_tsv's selection: (kept indices ``[n]``, ``max_conf`` ``[P]``).

    Args:
        boxes: ``[P, 4]`` proposals in original-image pixels.
        cls_prob: ``[P, 1 + C]`` class probabilities, column 0 = background (ignored).
    """
    max_conf = per_class_max_conf(boxes, cls_prob[:, 1:], nms_threshold)
    return choose_boxes(max_conf, conf_threshold, min_boxes, max_boxes), max_conf
