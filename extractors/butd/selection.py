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

    One image of :func:`per_class_max_conf_batched`.
    """
    return per_class_max_conf_batched([boxes], [class_scores], nms_threshold, prune_every)[0, : len(boxes)]


def per_class_max_conf_batched(boxes: list[torch.Tensor], class_scores: list[torch.Tensor],
                               nms_threshold: float = 0.3, prune_every: int = 8) -> torch.Tensor:
    """:func:`per_class_max_conf` of ``B`` images at once: ``[B, P]`` with ``P`` = the most proposals of an image.

    Args:
        boxes: ``B`` tensors ``[P_b, 4]``; class_scores: ``B`` tensors ``[P_b, C]`` (scores ≥ 0, on one device).

    Row ``b`` holds image ``b``'s result in its first ``P_b`` entries (zeros after). The rows of the greedy
    suppression are (image, class) pairs, each with its own image's overlap matrix, so ``P`` steps serve all
    images. An image with fewer proposals gets score ``-inf`` for the missing ones: they rank after all of its
    real boxes and can only suppress boxes ranked after them, so the real boxes' decisions are those of the image
    alone (and the result is made of the same scores, hence bitwise equal).

    Pruning (exact): the decisions for ranks already processed are final, so the maximum over them is a lower
    bound ``L[b]`` of the result. A class whose remaining (lower-ranked) boxes all score ``≤ L[b]`` in it can
    neither raise any box's maximum (the original updates only on a strictly larger score) nor matter for any
    other class, so it is dropped. With peaked class probabilities most classes go after a few ranks.
    """
    num_images = len(boxes)
    counts = [len(b) for b in boxes]
    num_boxes = max(counts, default=0)
    num_classes = class_scores[0].shape[1] if class_scores else 0
    device = class_scores[0].device if class_scores else torch.device("cpu")
    dtype = class_scores[0].dtype if class_scores else torch.float32
    max_conf = torch.zeros((num_images, num_boxes), dtype=dtype, device=device)
    if num_boxes == 0 or num_classes == 0:
        return max_conf
    overlaps = torch.zeros((num_images, num_boxes, num_boxes), dtype=torch.bool, device=device)
    scores = torch.full((num_images, num_classes, num_boxes), float("-inf"), dtype=dtype, device=device)
    for b, (image_boxes, image_scores) in enumerate(zip(boxes, class_scores)):
        overlaps[b, : counts[b], : counts[b]] = legacy_iou(image_boxes.float()) > nms_threshold
        scores[b, :, : counts[b]] = image_scores.t()
    scores = scores.reshape(num_images * num_classes, num_boxes)          # [R, P] rows = (image, class)
    row_image = torch.arange(num_images, device=device).repeat_interleave(num_classes)   # [R]
    order = torch.argsort(scores, dim=1, descending=True, stable=True)    # [R, P] box index at each rank
    sorted_scores = torch.gather(scores, 1, order)                        # [R, P] decreasing
    suppressed = torch.zeros_like(scores, dtype=torch.bool)               # [R, P] by box index
    kept = torch.zeros_like(suppressed)

    def image_max(kept: torch.Tensor, scores: torch.Tensor, row_image: torch.Tensor) -> torch.Tensor:
        kept_scores = torch.where(kept, scores, torch.zeros_like(scores))
        return max_conf.scatter_reduce(0, row_image[:, None].expand_as(kept_scores), kept_scores, "amax")

    for rank in range(num_boxes):
        if rank and rank % prune_every == 0:
            max_conf = image_max(kept, scores, row_image)
            remaining = sorted_scores[:, rank:] > torch.gather(max_conf[row_image], 1, order[:, rank:])
            needed = remaining.any(dim=1)
            if not bool(needed.all()):
                if not bool(needed.any()):
                    return max_conf
                scores, order, sorted_scores = scores[needed], order[needed], sorted_scores[needed]
                suppressed, kept, row_image = suppressed[needed], kept[needed], row_image[needed]
        rows = torch.arange(len(scores), device=device)
        current = order[:, rank]                                          # [r]
        alive = ~suppressed[rows, current]                                # [r]
        kept[rows, current] = alive
        suppressed |= overlaps[row_image, current] & alive[:, None]
    return image_max(kept, scores, row_image)


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


def choose_boxes_batched(max_conf: torch.Tensor, counts: list[int], conf_threshold: float = 0.2,
                         min_boxes: int = 36, max_boxes: int = 36) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`choose_boxes` of ``B`` images at once, on ``max_conf``'s device with no host round trip.

    Args:
        max_conf: ``[B, P]`` (row ``b``: image ``b``'s ``counts[b]`` boxes first, the rest ignored).

    Returns:
        ``(order [B, K], kept [B])`` with ``K = min(P, max_boxes)``: image ``b`` keeps ``order[b, :kept[b]]``,
        the indices :func:`choose_boxes` gives it, in the same order.
    """
    num_images, num_boxes = max_conf.shape
    device = max_conf.device
    index = torch.arange(num_boxes, device=device)
    real = torch.stack([index < n for n in counts]) if counts else index.new_zeros((0, num_boxes), dtype=torch.bool)
    conf = torch.where(real, max_conf, torch.full_like(max_conf, float("-inf")))
    above = real & (conf >= conf_threshold)
    count = above.sum(dim=1)                                                   # [B]
    in_range = (count >= min_boxes) & (count <= max_boxes)
    # index order of the boxes above the threshold (a stable sort puts them first), else decreasing max_conf
    by_index = torch.argsort((~above).to(torch.uint8), dim=1, stable=True)
    by_conf = torch.argsort(conf, dim=1, descending=True, stable=True)
    order = torch.where(in_range[:, None], by_index, by_conf)[:, :max_boxes]
    available = real.sum(dim=1).clamp(max=min_boxes)
    kept = torch.where(in_range, count, torch.where(count < min_boxes, available, torch.full_like(count, max_boxes)))
    return order, kept


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


def select_regions_batched(boxes: list[torch.Tensor], cls_prob: list[torch.Tensor], nms_threshold: float = 0.3,
                           conf_threshold: float = 0.2, min_boxes: int = 36, max_boxes: int = 36
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`select_regions` of ``B`` images on their device: ``(order [B, K], kept [B], max_conf [B, P])``.

    Args:
        boxes: ``B`` tensors ``[P_b, 4]`` in original-image pixels; cls_prob: ``B`` tensors ``[P_b, 1 + C]``.

    Image ``b`` keeps ``order[b, :kept[b]]``; ``max_conf[b, :P_b]`` is its ``max_conf``. No value is copied to
    the host (the pruning of the suppression loop only reads back whether classes are left).
    """
    max_conf = per_class_max_conf_batched(boxes, [p[:, 1:] for p in cls_prob], nms_threshold)
    order, kept = choose_boxes_batched(max_conf, [len(b) for b in boxes], conf_threshold, min_boxes, max_boxes)
    return order, kept, max_conf
