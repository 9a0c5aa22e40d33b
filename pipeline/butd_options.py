"""Command-line options of the ``butd-regions`` extractor, added to ``retr-pipeline extract``.

The extractor itself (:func:`retr.extractors.butd.extractor.build_butd_regions`) takes these as plain keyword
arguments; each option's parameter name is the builder's, so the command passes them on unchanged and the
builder's errors (``post_nms_topk … must be at least max_boxes``) come back in these flags.

Every option defaults to None (or off), meaning "the extractor's own default"; the original's settings are
the defaults, and the size/proposal/pool options below them are documented speed options.
"""
from __future__ import annotations

from typing import Callable

import click

BUTD_OPTIONS = [
    click.option("--short-side", type=int, default=None,
                 help="butd-regions: Caffe scaling target of the short side (default 600)."),
    click.option("--max-side", type=int, default=None,
                 help="butd-regions: cap on the long side (default 1000)."),
    click.option("--pre-nms-topk", type=int, default=None,
                 help="butd-regions: RPN boxes kept before NMS (default 6000)."),
    click.option("--post-nms-topk", type=int, default=None,
                 help="butd-regions: proposals kept after NMS (default 300; fewer is faster, must be >= --max-boxes)."),
    click.option("--pooled-size", type=int, default=None,
                 help="butd-regions: ROI pool side before res5 (default 14; 7 is ~4x faster, not the original)."),
    click.option("--min-boxes", type=int, default=None, help="butd-regions: MIN_BOXES (default 36)."),
    click.option("--max-boxes", type=int, default=None, help="butd-regions: MAX_BOXES (default 36)."),
    click.option("--conf-threshold", type=float, default=None,
                 help="butd-regions: max_conf threshold of the box selection (default 0.2)."),
    click.option("--object-vocab", type=click.Path(dir_okay=False), default=None,
                 help="butd-regions: objects_vocab.txt (1600 lines), recorded in the feature set."),
    click.option("--attr-vocab", type=click.Path(dir_okay=False), default=None,
                 help="butd-regions: attributes_vocab.txt (400 lines), recorded in the feature set."),
    click.option("--detector-batch", type=click.IntRange(min=1), default=None,
                 help="butd-regions: images per detector forward, padded to the largest (default 4 on CUDA, 1 on "
                      "CPU; at most --batch-size). Each image's regions are its one-image forward's up to the "
                      "convolution library's summation order; recorded in the feature set."),
    click.option("--allow-partial", is_flag=True,
                 help="butd-regions: load a checkpoint even if keys are missing or unexpected."),
    click.option("--trust-checkpoint", is_flag=True,
                 help="butd-regions: allow a checkpoint holding Python objects beyond tensors (trusted files only)."),
]


def butd_options(f: Callable) -> Callable:
    """Decorate a click command with :data:`BUTD_OPTIONS` (passed on as keyword arguments)."""
    for option in reversed(BUTD_OPTIONS):
        f = option(f)
    return f
