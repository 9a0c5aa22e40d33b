"""The model registry (timm-style): ``create_model(name, **config)``, ``list_models()``, per-dataset presets.

A model module registers its class with ``@register_model("name")`` and its presets with
:func:`register_preset`; the training command and the evaluator find everything through here.
"""
from __future__ import annotations

from typing import Callable

from retr.common.errors import UserError

_MODELS: dict[str, type] = {}
_PRESETS: dict[str, Callable[[str | None, str | None], dict]] = {}
#: modules that register models on import; later models append themselves here
MODEL_MODULES = ["retr.trainers.models.scan", "retr.trainers.models.vsepp", "retr.trainers.models.jgcar",
                 "retr.trainers.models.smfea", "retr.trainers.models.sman", "retr.trainers.models.seam"]


def register_model(name: str):
    """Class decorator: make a :class:`MatchingModel` subclass creatable as ``name``."""
    def wrap(cls):
        if name in _MODELS and _MODELS[name] is not cls:
            raise ValueError(f"model {name!r} registered twice")
        cls.name = name
        _MODELS[name] = cls
        return cls
    return wrap


def register_preset(name: str, preset: Callable[[str | None, str | None], dict]) -> None:
    """``preset(dataset, direction) -> hyperparameters`` for model ``name`` (dataset None = the default)."""
    _PRESETS[name] = preset


def _load_all() -> None:
    import importlib
    for module in MODEL_MODULES:
        importlib.import_module(module)


def list_models() -> list[str]:
    _load_all()
    return sorted(_MODELS)


def model_class(name: str) -> type:
    _load_all()
    if name not in _MODELS:
        raise UserError(f"unknown model {name!r} (known: {', '.join(sorted(_MODELS))})")
    return _MODELS[name]


def create_model(name: str, **config):
    """Instantiate model ``name`` with its constructor arguments."""
    return model_class(name)(**config)


def preset(name: str, dataset: str | None = None, direction: str | None = None) -> dict:
    _load_all()
    if name not in _PRESETS:
        raise UserError(f"model {name!r} has no presets")
    return dict(_PRESETS[name](dataset, direction))
