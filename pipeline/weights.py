"""The weights retr downloads, located and fetched ahead of time (``retr-pipeline fetch-weights``, ``extract-preset``).

Named by what they are (``resnet152``, ``butd``, ``stanza`` …) or by extractor; each lands where its loader
looks first. Every name but ``stanza`` comes from the extractors' specs (:class:`retr.extractors.spec.WeightSource`,
:func:`weights_catalog`): a new extractor's weights are fetched by naming it. Sources:
:data:`retr.common.downloads.SOURCES`; docs/extraction.md ("Downloads").
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from retr.common.downloads import SOURCES, Source, format_bytes, is_offline
from retr.common.errors import MissingResourceError, ParameterError
from retr.extractors.spec import ALL, WeightSource
from retr.parsers.backends import STANZA_LANGUAGE, fetch_parser_models, missing_models_error, stanza_model_dir

logger = logging.getLogger(__name__)

#: the parser's models: fetched by name and with ``all``, after every extractor's weights
STANZA = "stanza"


@dataclass(frozen=True)
class WeightsItem:
    """One set of weights: where it is cached (``locate`` → path or None), how to fetch it, where it is looked for."""

    name: str
    source: Source                                # what it is, its size
    locate: Callable[[], Path | None]
    fetch: Callable[[bool, str | None], Path]     # (quiet, mirror) → path
    looked_in: Callable[[], str]

    @property
    def what(self) -> str:
        return self.source.what


def _extractor_item(weights: WeightSource) -> WeightsItem:
    """The item of an extractor's :class:`~retr.extractors.spec.WeightSource`."""
    return WeightsItem(weights.key, weights.entry, weights.locate, weights.fetch, weights.looked_in)


def _stanza(model_dir: Path | None) -> WeightsItem:
    def folder() -> tuple[Path, str]:
        return stanza_model_dir(model_dir)

    def locate() -> Path | None:
        path, _ = folder()
        return path if (path / "resources.json").is_file() and (path / STANZA_LANGUAGE).is_dir() else None

    def fetch(quiet: bool, mirror: str | None) -> Path:
        path, source = folder()
        if is_offline():
            raise missing_models_error(path, source)
        return fetch_parser_models(path)

    return WeightsItem(STANZA, SOURCES[STANZA], locate, fetch, lambda: str(folder()[0]))


@dataclass(frozen=True)
class WeightsCatalog:
    """The names ``fetch-weights`` takes, derived from the extractors' specs.

    ``sources``: weights name → its :class:`~retr.extractors.spec.WeightSource`, in the order of the
    :data:`~retr.common.downloads.SOURCES` table (sources the table lacks after it, by extractor name);
    ``groups``: group name (``all``, ``clip``) → weights names, ``all`` ending with :data:`STANZA`;
    ``extractors``: extractor name → the weights name of its default ``--weights``."""

    sources: dict[str, WeightSource]
    groups: dict[str, tuple[str, ...]]
    extractors: dict[str, str]

    @property
    def names(self) -> tuple[str, ...]:
        """Every weights name, ``all``'s first (then :data:`STANZA`), then the other groups'."""
        named = [n for group in self.groups.values() for n in group]
        return tuple(dict.fromkeys(self.groups[ALL] + tuple(named)))

    @property
    def by_extractor(self) -> dict[str, str]:
        """Extractor name → weights name, for the extractors whose weights go by another name (``resnet152-grid``
        → ``resnet152``; the CLIP weights are named by their extractor), in weights order then name order."""
        order = {name: i for i, name in enumerate(self.names)}
        renamed = [(extractor, name) for extractor, name in self.extractors.items() if extractor != name]
        return dict(sorted(renamed, key=lambda pair: (order[pair[1]], pair[0])))

    def describe(self) -> str:
        """The names, for ``fetch-weights --help``: ``all (default), resnet152, …, or extractor names (…); …``."""
        parts = [f"{ALL} (default), {', '.join(self.groups[ALL])}, or extractor names "
                 f"({', '.join(self.by_extractor)})"]
        for group, members in self.groups.items():
            if group != ALL:
                size = format_bytes(sum(self.sources[name].entry.download_bytes for name in members))
                named = " (named by their extractors)" if set(members) <= set(self.extractors) else ""
                parts.append(f"{', '.join(members)}{named}, or {group} for all {len(members)} (not part of {ALL}: "
                             f"{size} no preset needs)")
        return "; ".join(parts)


def weights_catalog() -> WeightsCatalog:
    """The :class:`WeightsCatalog` of the registered extractors (imports them: torch, torchvision)."""
    from retr.extractors.base import extractor_specs  # cost: torch (retr-pipeline --help)

    specs = [spec for spec in extractor_specs() if spec.weights is not None]
    table = {key: i for i, key in enumerate(SOURCES)}
    sources: dict[str, WeightSource] = {}
    for spec in sorted(specs, key=lambda s: (table.get(s.weights.key, len(table)), s.name)):
        if sources.setdefault(spec.weights.key, spec.weights) != spec.weights:
            raise ValueError(f"extractors declare two different weights named {spec.weights.key!r}")
    groups: dict[str, tuple[str, ...]] = {ALL: ()}
    for key, source in sources.items():
        groups[source.group] = groups.get(source.group, ()) + (key,)
    groups[ALL] += (STANZA,)
    return WeightsCatalog(sources, groups, {spec.name: spec.weights.key for spec in specs})


def weights_items(names: Iterable[str], stanza_dir: Path | None = None) -> list[WeightsItem]:
    """The items named (weights names, group names such as ``all`` and ``clip``, or extractor names), each once,
    in :attr:`WeightsCatalog.names` order."""
    catalog = weights_catalog()
    wanted: set[str] = set()
    for name in names:
        if name in catalog.groups:
            wanted.update(catalog.groups[name])
        elif name in catalog.names:
            wanted.add(name)
        elif name in catalog.extractors:
            wanted.add(catalog.extractors[name])
        else:
            others = [f"{group}, {', '.join(members)}" for group, members in catalog.groups.items() if group != ALL]
            raise ParameterError(f"unknown weights {name!r} (expected {ALL}, {', '.join(catalog.groups[ALL])}, "
                                 f"{', '.join(others)}, or an extractor name: {', '.join(catalog.by_extractor)})",
                                 "names")
    return [_stanza(stanza_dir) if name == STANZA else _extractor_item(catalog.sources[name])
            for name in catalog.names if name in wanted]


def ensure_weights(items: list[WeightsItem], quiet: bool = False,
                   mirror: str | None = None) -> list[tuple[WeightsItem, Path, bool]]:
    """``(item, path, downloaded now)`` for every item, fetching the missing ones (each announced on the ``retr``
    logger unless ``quiet``). Offline with anything missing: ONE :class:`MissingResourceError` naming all of it
    and ``retr-pipeline fetch-weights NAME…``."""
    found = [(item, item.locate()) for item in items]
    missing = [item for item, path in found if path is None]
    if missing and is_offline():
        places = list(dict.fromkeys(place for item in missing for place in item.looked_in().split(", ")))
        raise MissingResourceError(
            "weights " + ", ".join(item.name for item in missing), places,
            f"run retr-pipeline fetch-weights {' '.join(item.name for item in missing)} on a connected machine and "
            f"copy what it downloads to those folders (RETR_OFFLINE is set, so retr does not download here)")
    out = []
    for item, path in found:
        if path is None:
            if not quiet:
                logger.info(f"{item.name}: downloading {item.what} (about "
                            f"{format_bytes(item.source.download_bytes)})")
            path = item.fetch(quiet, mirror)
            out.append((item, path, True))
        else:
            out.append((item, path, False))
    return out
