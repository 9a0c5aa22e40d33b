"""Which regions are kept: ``generate_tsv``'s per-class NMS selection, computed for all classes at once.

Greedy suppression of every class together (exact, with pruning), box order and ties: docs/butd.md ("The box
selection without 1,600 NMS calls")."""
from __future__ import annotations

import torch

from retr.extractors.butd.boxes import legacy_iou


def per_class_max_conf(boxes: torch.Tensor, class_scores: torch.Tensor, nms_threshold: float = 0.3,
                       prune_every: int = 8) -> torch.Tensor:
    """Each box's best score over the classes in whose NMS it survives: ``[P]``.

    ``boxes`` ``[P, 4]``; ``class_scores`` ``[P, C]`` (foreground only); ``nms_threshold`` legacy IoU (0.3)."""
    return per_class_max_conf_batched([boxes], [class_scores], nms_threshold, prune_every)[0, : len(boxes)]


def per_class_max_conf_batched(boxes: list[torch.Tensor], class_scores: list[torch.Tensor],
                               nms_threshold: float = 0.3, prune_every: int = 8) -> torch.Tensor:
    """:func:`per_class_max_conf` of ``B`` images at once → ``[B, P]`` (P = the most proposals).

    ``boxes`` ``B`` × ``[P_b, 4]``, ``class_scores`` ``B`` × ``[P_b, C]`` (≥ 0, one device). Missing proposals score
    ``-inf`` (rank last, so each image's result is bitwise its own); a class that can no longer raise a maximum is
    dropped."""
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
    """:func:`choose_boxes` of ``B`` images on ``max_conf``'s ``[B, P]`` device → ``(order [B, K], kept [B])``,
    ``K = min(P, max_boxes)``: image ``b`` keeps ``order[b, :kept[b]]``."""
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
    """generate_tsv's selection → (kept indices ``[n]``, ``max_conf`` ``[P]``) from ``boxes`` ``[P, 4]`` and
    ``cls_prob`` ``[P, 1 + C]`` (column 0 background)."""
    max_conf = per_class_max_conf(boxes, cls_prob[:, 1:], nms_threshold)
    return choose_boxes(max_conf, conf_threshold, min_boxes, max_boxes), max_conf


def select_regions_batched(boxes: list[torch.Tensor], cls_prob: list[torch.Tensor], nms_threshold: float = 0.3,
                           conf_threshold: float = 0.2, min_boxes: int = 36, max_boxes: int = 36
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`select_regions` of ``B`` images on their device → ``(order [B, K], kept [B], max_conf [B, P])``."""
    max_conf = per_class_max_conf_batched(boxes, [p[:, 1:] for p in cls_prob], nms_threshold)
    order, kept = choose_boxes_batched(max_conf, [len(b) for b in boxes], conf_threshold, min_boxes, max_boxes)
    return order, kept, max_conf
