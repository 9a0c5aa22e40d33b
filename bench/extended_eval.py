"""Benchmark: ECCV Caption, CxC and COCO 1K/5K on a 5,000 × 25,000 matrix — retr's vectorised evaluator against
the authors' own per-query loops (``eccv_caption.Metrics``).

Data: the real COCO 5K test ids (from the installed eccv-caption package) and a random float64 matrix, each true
pair raised by ``--signal`` (the cost hardly depends on the values; the default gives a mid-range model).

* ``retr``: :func:`retr.trainers.evaluation.coco_extended.extended_metrics` as ``retr-train eval --extended`` runs
  it (every number both ways), under each tie rule.
* ``baseline``: what the package asks of its user, then its loops: each query's ranked list (``np.argsort`` of
  every row and every column, reversed: the authors' order) turned into Python lists of COCO ids, then
  ``Metrics.compute_all_metrics`` with every target (ECCV mAP@R, R-Precision, R@1; CxC, COCO 1K and 5K R@1/5/10).
  Its loops read only the start of each list (the first R ≤ 48 items, or the first ten of a query's 1K fold), so
  the lists are cut at ``--list-length`` items (checked long enough); whole lists of 25,000 Python ints per query
  would need ~9 GB.

One JSON line per tie rule (retr's seconds, the baseline's, the speed-up, and whether every number equals 100 ×
the package's), then peak memory. ::

    python bench/extended_eval.py
"""
from __future__ import annotations

import argparse
import json
import resource
import time
import warnings

import numpy as np

from retr.trainers.evaluation import coco_extended as ce

TARGETS = ("eccv_map_at_r", "eccv_rprecision", "eccv_r1", "coco_1k_recalls", "coco_5k_recalls", "cxc_recalls")


def baseline(sims: np.ndarray, ids: ce.MatrixIds, annotations: ce.Annotations, length: int) -> tuple[dict, dict]:
    """(numbers, seconds of each step) of the package's way, on ``np.argsort`` lists (official ties)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from eccv_caption import Metrics
    seconds = {}
    start = time.perf_counter()
    i2t_order = np.argsort(sims, axis=1)[:, ::-1][:, :length]
    t2i_order = np.argsort(np.ascontiguousarray(sims.T), axis=1)[:, ::-1][:, :length]
    seconds["argsort"] = time.perf_counter() - start
    start = time.perf_counter()
    i2t = {int(q): ids.caption_ids[row].tolist() for q, row in zip(ids.image_ids, i2t_order)}
    t2i = {int(q): ids.image_ids[row].tolist() for q, row in zip(ids.caption_ids, t2i_order)}
    seconds["lists"] = time.perf_counter() - start
    _check_length(i2t_order, t2i_order, ids, annotations)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = Metrics().compute_all_metrics(i2t, t2i, target_metrics=TARGETS, Ks=(1, 5, 10), verbose=False)
    seconds["loops"] = time.perf_counter() - start
    return {name: {d: 100 * float(raw[name][d]) for d in ("i2t", "t2i")} for name in ce.METRIC_NAMES}, seconds


def _check_length(i2t_order, t2i_order, ids, annotations) -> None:
    """Every cut list holds ten items of its query's 1K fold (COCO 1K reads no further)."""
    fold = dict(zip(annotations.caption_ids.tolist(), np.arange(25000) // 5000))
    image_fold = {i: fold[c] for c, i in zip(annotations.caption_ids.tolist(), annotations.caption_image.tolist())}
    caption_folds = np.array([fold[int(c)] for c in ids.caption_ids])
    image_folds = np.array([image_fold[int(i)] for i in ids.image_ids])
    assert ((caption_folds[i2t_order] == image_folds[:, None]).sum(axis=1) >= 10).all(), "raise --list-length"
    assert ((image_folds[t2i_order] == caption_folds[:, None]).sum(axis=1) >= 10).all(), "raise --list-length"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--signal", type=float, default=0.9, help="added to every true pair's uniform score")
    parser.add_argument("--list-length", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    annotations = ce.load_annotations()
    load = time.perf_counter() - start
    owner = dict(zip(annotations.caption_ids.tolist(), annotations.caption_image.tolist()))
    ids = ce.matrix_ids([f"coco_{i}" for i in annotations.image_ids.tolist()],
                        [f"coco_{owner[c]}#{c}" for c in annotations.caption_ids.tolist()],
                        annotations.caption_ids.tolist(), "bench")
    ce.check_test_set(annotations, ids)
    rng = np.random.default_rng(args.seed)
    sims = rng.random((5000, 25000))
    sims[ids.caption_image, np.arange(25000)] += args.signal
    theirs, base = baseline(sims, ids, annotations, args.list_length)
    base_total = sum(base.values())
    for ties in ("official", "pessimistic"):
        start = time.perf_counter()
        ours = ce.extended_metrics(sims, ids, annotations, ties)
        seconds = time.perf_counter() - start
        print(json.dumps({"bench": "extended_eval", "matrix": [5000, 25000], "ties": ties,
                          "retr_seconds": round(seconds, 3), "annotations_load_seconds": round(load, 3),
                          "baseline_seconds": {k: round(v, 3) for k, v in base.items()},
                          "baseline_total_seconds": round(base_total, 3),
                          "speedup": round(base_total / seconds, 1),
                          "equal_to_package": ours == theirs if ties == "official" else None,
                          "eccv_map_at_r": ours["eccv_map_at_r"], "cxc_r1": ours["cxc_r1"]}))
    print(json.dumps({"bench": "extended_eval", "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                      // 1024}))


if __name__ == "__main__":
    main()
