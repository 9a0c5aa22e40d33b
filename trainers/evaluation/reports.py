"""The reports a model's spec asks for once a run is trained (``ModelSpec.after_training`` names them): each a
function of ``(run directory, TrainConfig)`` that writes its file into the run and logs to ``retr``."""
from __future__ import annotations

from typing import Callable

from retr.trainers.evaluation.tree_accuracy import report_tree_accuracy

#: report name → what makes it
AFTER_TRAINING: dict[str, Callable[..., None]] = {"tree_accuracy": report_tree_accuracy}


def report_after_training(spec, run, cfg) -> None:
    """Make every report ``spec.after_training`` names for the trained run ``run`` (a name without a report is a
    ``KeyError``: tests/test_model_registry.py checks every registered spec)."""
    for name in spec.after_training:
        AFTER_TRAINING[name](str(run), cfg)
