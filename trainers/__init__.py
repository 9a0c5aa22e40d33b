"""Cached-tensor datasets, losses, the matching models, evaluation, the training loop and ``retr-train``."""
