"""Evaluation: similarity matrices, the field's protocols and metrics, two-step retrieval."""
