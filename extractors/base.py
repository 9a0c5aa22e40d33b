"""The interface every extractor implements, and the registry of their specs (:class:`ExtractorSpec`).

The stage drives it: ``load(path)`` in workers (one preprocessed image, or :class:`ImageError`), ``collate``,
``to_device`` (main process), ``extract(batch)`` → numpy ``features`` ``[B, K, D]`` and each of ``extras`` (e.g.
``boxes`` ``[B, K, 4]``); ``attrs()`` the feature set's root attributes. Every module of this package is imported
on first use of the registry, so a new extractor is one module that calls :func:`register_extractor`."""
from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
from abc import ABC, abstractmethod
from typing import Any, Callable

import numpy as np
import torch

from retr.extractors.spec import ExtractorSpec
from retr.common.errors import ParameterError


class ImageError(Exception):
    """An image that cannot be used (missing, truncated, not an image, zero-size, …); ``str`` is the reason."""


class Extractor(ABC):
    """A feature extractor: preprocessing (in workers) and the network (in the main process)."""

    #: registry name, e.g. ``"resnet152-grid"``
    name: str
    #: feature-set kind: ``grid``, ``maps``, ``tencrop``, ``regions`` or ``clip``
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


#: name → spec. Each extractor module registers its own (:func:`register_extractor`, beside its builder).
_SPECS: dict[str, ExtractorSpec] = {}


def register_extractor(spec: ExtractorSpec) -> ExtractorSpec:
    """Make ``spec`` available (``retr-pipeline extract --extractor NAME``, fetch-weights, the presets' check);
    called by the extractor's module, beside its builder. Another builder under a taken name is a bug."""
    taken = _SPECS.setdefault(spec.name, spec)
    if taken.builder is not spec.builder:
        raise ValueError(f"extractor {spec.name!r} registered twice")
    _SPECS[spec.name] = spec
    return spec


def unregister_extractor(name: str) -> None:
    """Remove extractor ``name`` from the registry (for tests that register a throwaway extractor)."""
    _SPECS.pop(name, None)


@functools.cache
def _import_every_module() -> None:
    """Import every module of :mod:`retr.extractors`, subpackages included (once), so each registers its specs."""
    package = importlib.import_module("retr.extractors")
    for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
        importlib.import_module(module.name)


def available_extractors() -> list[str]:
    """Names of every registered extractor, sorted."""
    _import_every_module()
    return sorted(_SPECS)


def extractor_specs() -> list[ExtractorSpec]:
    """Every registered :class:`ExtractorSpec`, sorted by name."""
    return [_SPECS[name] for name in available_extractors()]


def extractor_spec(name: str) -> ExtractorSpec:
    """The spec of extractor ``name``; :class:`~retr.common.errors.ParameterError` lists the known ones."""
    names = available_extractors()
    if name not in _SPECS:
        raise ParameterError(f"unknown extractor {name!r} (available: {', '.join(names)})", "name")
    return _SPECS[name]


def extractors_requiring(module: str) -> list[str]:
    """Names of the extractors whose spec requires ``module`` (``timm``, ``open_clip``), in name order."""
    return [spec.name for spec in extractor_specs() if module in spec.requires]


def needed_by(module: str) -> str:
    """What needs ``module``, for its missing-extra line: ``the NAME extractor``, ``the NAME, NAME extractors``."""
    names = extractors_requiring(module)
    if not names:
        return f"the extractors that use {module}"
    return f"the {', '.join(names)} extractor{'s' if len(names) > 1 else ''}"


def declared_options(name: str) -> set[str]:
    """The options the builder of extractor ``name`` names in its signature (``**``-collected ones excluded)."""
    parameters = inspect.signature(extractor_spec(name).builder).parameters
    return {n for n, p in parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}


def build_extractor(name: str, **options: Any) -> Extractor:
    """The extractor ``name`` built with ``options``; :class:`~retr.common.errors.ParameterError` names a bad one,
    :class:`~retr.common.optional.MissingExtraError` a missing extra (before anything is built)."""
    spec = extractor_spec(name)
    parameters = inspect.signature(spec.builder).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        refused = sorted(set(options) - set(parameters))
        if refused:
            raise ParameterError(f"extractor {name!r} does not take {', '.join(refused)}", *refused)
    spec.check_extra()
    extractor = spec.builder(**options)
    declared = spec.feature_shape(options)
    if (extractor.name, extractor.kind, tuple(extractor.feature_shape)) != (name, spec.kind, declared):
        raise TypeError(f"extractor {name!r} built {extractor.name!r} of kind {extractor.kind!r} with features "
                        f"{list(extractor.feature_shape)}; its spec says kind {spec.kind!r}, {list(declared)}")
    return extractor
