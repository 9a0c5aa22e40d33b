"""The names of the files in a run's folder (and in an export's): what every module that reads or writes a run
uses, in one place. What each file holds: docs/trainer.md ("Run directory")."""
from __future__ import annotations

#: the run's settings and records (``retr-train MODEL`` writes it at every start; an export has its own)
CONFIG = "config.json"
#: the caption vocabulary (SCAN's ``{name}_vocab.json`` format)
VOCAB = "vocab.json"
#: the checkpoint of the best validation rSum
BEST = "best.pt"
#: the typed metrics log (:mod:`retr.trainers.runs.run_log`)
METRICS = "metrics.jsonl"
#: every evaluation's numbers (``retr-train eval``)
EVAL = "eval.json"
#: an exported model's weights (``retr-train export``): its folder holds them, ``config.json`` and ``vocab.json``
WEIGHTS = "model.safetensors"
#: the OS lock rank 0 holds while the run trains
LOCK = "run.lock"
#: the moving average of the weights (``--ema``)
EMA = "ema.pt"
