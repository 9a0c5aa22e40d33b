"""The interface every extractor implements, and the registry that names them.

The stage drives it: ``load(path)`` in workers (one preprocessed image, or :class:`ImageError`), ``collate``,
``to_device`` (main process), ``extract(batch)`` → numpy ``features`` ``[B, K, D]`` and each of ``extras`` (e.g.
``boxes`` ``[B, K, 4]``); ``attrs()`` the feature set's root attributes."""
from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import Any, Callable

import numpy as np
import torch


class ImageError(Exception):
    """An image that cannot be used (missing, truncated, not an image, zero-size, …); ``str`` is the reason."""


class Extractor(ABC):
    """A feature extractor: preprocessing (in workers) and the network (in the main process)."""

    #: registry name, e.g. ``"resnet152-grid"``
    name: str
    #: feature-set kind: ``grid``, ``maps``, ``tencrop`` or ``regions``
    kind: str

    @property
    @abstractmethod
    def feature_shape(self) -> tuple[int, int]:
        """``(K, D)`` of one image's features."""

    @property
    def extras(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Further per-image datasets: name → (shape of one row, numpy dtype). None by default."""
        return {}

    @abstractmethod
    def attrs(self) -> dict[str, Any]:
        """Root attributes for the feature set (``kind``, ``extractor``, ``backbone``, ``weights``, ``image_size``…)."""

    @abstractmethod
    def load(self, path: str) -> Any:
        """Decode and preprocess one image file (runs in a worker); raise :class:`ImageError` if unusable."""

    def preprocessor(self) -> Callable[[str], Any]:
        """The picklable callable workers run on each path (default :meth:`load`); keep networks out of it."""
        return self.load

    def collator(self) -> Callable[[list[Any]], Any]:
        """The picklable callable that batches ``load`` results in workers: :func:`stack_samples` unless
        :meth:`collate` is overridden (then the bound method)."""
        return stack_samples if type(self).collate is Extractor.collate else self.collate

    def collate(self, samples: list[Any]) -> Any:
        """Batch ``load`` results (default: stack tensors)."""
        return stack_samples(samples)

    def to_device(self, batch: Any) -> tuple[Any, list[tuple[int, str]]]:
        """``(batch ready for extract, [(row, one-line reason)] dropped)``; default ``(batch, [])``."""
        return batch, []

    @abstractmethod
    def extract(self, batch: Any) -> dict[str, np.ndarray]:
        """Run the network: ``{"features": [B, K, D], <extra>: [B, …]}`` as numpy arrays."""

    def to(self, device: torch.device | str) -> "Extractor":
        """Move the network to ``device`` (and return self)."""
        return self


def stack_samples(samples: list[torch.Tensor]) -> torch.Tensor:
    """Default batching: ``torch.stack`` of same-shaped sample tensors."""
    return torch.stack(samples)


#: name → builder(**options) returning an :class:`Extractor`. Modules add themselves with :func:`register`.
_REGISTRY: dict[str, Callable[..., Extractor]] = {}


def register(name: str) -> Callable[[Callable[..., Extractor]], Callable[..., Extractor]]:
    """Decorator: make a builder available to ``retr-pipeline extract --extractor NAME``."""
    def decorate(builder: Callable[..., Extractor]) -> Callable[..., Extractor]:
        if name in _REGISTRY:
            raise ValueError(f"extractor {name!r} registered twice")
        _REGISTRY[name] = builder
        return builder
    return decorate


def available_extractors() -> list[str]:
    """Names of every registered extractor (importing the modules that define them)."""
    import retr.extractors.catalog  # noqa: F401  (imports every extractor module once)
    return sorted(_REGISTRY)


def declared_options(name: str) -> set[str]:
    """The options the builder of extractor ``name`` names in its signature (``**``-collected ones excluded)."""
    available_extractors()
    parameters = inspect.signature(_REGISTRY[name]).parameters
    return {n for n, p in parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}


def build_extractor(name: str, **options: Any) -> Extractor:
    """The extractor ``name`` built with ``options``; :class:`~retr.common.errors.ParameterError` names a bad one."""
    from retr.common.errors import ParameterError
    names = available_extractors()
    if name not in _REGISTRY:
        raise ParameterError(f"unknown extractor {name!r} (available: {', '.join(names)})", "name")
    builder = _REGISTRY[name]
    parameters = inspect.signature(builder).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        refused = sorted(set(options) - set(parameters))
        if refused:
            raise ParameterError(f"extractor {name!r} does not take {', '.join(refused)}", *refused)
    return builder(**options)
