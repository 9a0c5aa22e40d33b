"""Matching models and their registry (timm-style).

Each model module defines its model class, its config dataclass and presets, and registers a
:class:`~retr.trainers.models.registry.ModelSpec` with :func:`register_model`; every module of this package is
imported on first use of the registry, so adding a model is adding a module."""
from __future__ import annotations

from retr.trainers.models.registry import (InputFile, ModelInputs, ModelSpec, create_model, get_spec, list_models,
                                           model_class, preset, register_model, unregister_model)

__all__ = ["InputFile", "ModelInputs", "ModelSpec", "create_model", "get_spec", "list_models", "model_class",
           "preset", "register_model", "unregister_model"]
