"""The interface every extractor implements, and the registry that names them.

The extraction stage (``retr.pipeline.extract``) knows nothing about networks: it asks the registry for an
extractor by name and drives it through this interface —

1. ``load(path)`` runs in DataLoader worker processes: decode one image file and preprocess it into whatever
   the network takes (a tensor ``[3, H, W]``, a stack of crops ``[10, 3, 224, 224]``, a Caffe-style BGR array,
   …). It raises :class:`ImageError` with a one-line reason for an image that cannot be used; the stage records
   that reason in the feature set's ``errors`` and goes on.
2. ``collate(samples)`` turns a list of ``load`` results into one batch (default: ``torch.stack``).
3. ``to_device(batch)`` (main process; on CUDA on a side stream while the previous batch is in the network)
   moves — or decodes — a collated batch onto the device and returns it with the rows that turned out
   unusable there (default: the batch as it is, no failures).
4. ``extract(batch)`` runs the network and returns numpy arrays: ``features`` ``[B, K, D]`` and every dataset
   named in ``extras`` (e.g. ``boxes`` ``[B, K, 4]``), row ``b`` belonging to sample ``b``.

``attrs()`` gives the root attributes the feature set records (``kind``, ``extractor``, ``backbone``,
``weights``, ``image_size`` and any extra, e.g. vocabularies).
"""
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
        """The picklable callable DataLoader workers run on each path (default: the bound :meth:`load`).

        Extractors whose object holds a large network should return a small object without it, so that
        workers started with ``spawn``/``forkserver`` do not receive a copy of the network.
        """
        return self.load

    def collator(self) -> Callable[[list[Any]], Any]:
        """The picklable callable that batches ``load`` results in workers: :func:`stack_samples` unless
        :meth:`collate` is overridden (then the bound method)."""
        return stack_samples if type(self).collate is Extractor.collate else self.collate

    def collate(self, samples: list[Any]) -> Any:
        """Batch ``load`` results (default: stack tensors)."""
        return stack_samples(samples)

    def to_device(self, batch: Any) -> tuple[Any, list[tuple[int, str]]]:
        """``(the batch ready for extract, [(row of batch, one-line reason)] of rows dropped from it)``.

        Default: ``(batch, [])`` — the extractor moves its inputs itself in :meth:`extract`.
        """
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
    """The extractor ``name`` built with ``options`` (``weights``, ``device``, extractor-specific ones).

    Raises :class:`~retr.common.errors.ParameterError` (a ``ValueError``) for an unknown ``name``, an option the
    builder does not take, or an option value the extractor refuses; the message names the parameter.
    """
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
