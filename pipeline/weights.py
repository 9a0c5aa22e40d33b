"""The weights retr downloads, located and fetched ahead of time (``retr-pipeline fetch-weights``, ``extract-preset``).

Named by what they are (``resnet152``, ``butd``, ``stanza`` …) or by extractor; each lands where its loader
looks first. Sources: :data:`retr.common.downloads.SOURCES`; docs/extraction.md ("Downloads").
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from retr.common.downloads import SOURCES, format_bytes, is_offline
from retr.common.errors import MissingResourceError, ParameterError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightsItem:
    """One set of weights: where it is cached (``locate`` → path or None), how to fetch it, where it is looked for."""

    name: str
    source: str                                   # key of SOURCES
    locate: Callable[[], Path | None]
    fetch: Callable[[bool, str | None], Path]     # (quiet, mirror) → path
    looked_in: Callable[[], str]

    @property
    def what(self) -> str:
        return SOURCES[self.source].what


def _torchvision(arch: str) -> WeightsItem:
    def cached() -> Path:
        from retr.extractors.weights import hub_checkpoint_path, imagenet_weights
        return hub_checkpoint_path(imagenet_weights(arch, "imagenet").url)

    def fetch(quiet: bool, mirror: str | None) -> Path:
        from retr.extractors.weights import fetch_imagenet_weights
        return fetch_imagenet_weights(arch, "imagenet", quiet=quiet, mirror=mirror)

    return WeightsItem(arch, arch, lambda: cached() if cached().is_file() else None, fetch,
                       lambda: str(cached().parent))


def _timm(arch: str) -> WeightsItem:
    def locate() -> Path | None:
        from retr.extractors.timm_weights import TIMM_DEFAULT_TAG, _pretrained_cfg, cached_hub_file
        return cached_hub_file(_pretrained_cfg(arch, TIMM_DEFAULT_TAG).hf_hub_id)

    def fetch(quiet: bool, mirror: str | None) -> Path:
        from retr.extractors.timm_weights import fetch_timm_weights
        return fetch_timm_weights(arch, quiet=quiet)

    def looked_in() -> str:
        from retr.extractors.timm_weights import hf_hub_cache
        return str(hf_hub_cache())

    return WeightsItem(arch, arch, locate, fetch, looked_in)


def _clip(name: str) -> WeightsItem:
    def locate() -> Path | None:
        from retr.extractors.clip import DEFAULT_WEIGHTS, FAMILY, HUB_FILES, _hub_id
        from retr.extractors.timm_weights import cached_hub_file
        return cached_hub_file(_hub_id(FAMILY[name], DEFAULT_WEIGHTS), HUB_FILES)

    def fetch(quiet: bool, mirror: str | None) -> Path:
        from retr.extractors.clip import FAMILY, fetch_clip_weights
        return fetch_clip_weights(FAMILY[name], quiet=quiet)

    def looked_in() -> str:
        from retr.extractors.timm_weights import hf_hub_cache
        return str(hf_hub_cache())

    return WeightsItem(name, name, locate, fetch, looked_in)


def _butd() -> WeightsItem:
    def locate() -> Path | None:
        from retr.extractors.butd.extractor import find_default_checkpoint
        return find_default_checkpoint()

    def fetch(quiet: bool, mirror: str | None) -> Path:
        from retr.extractors.butd.checkpoint import fetch_checkpoint
        from retr.extractors.butd.extractor import default_checkpoint_path, find_default_checkpoint
        return find_default_checkpoint() or fetch_checkpoint(default_checkpoint_path(), quiet=quiet, mirror=mirror)

    def looked_in() -> str:
        from retr.extractors.butd.extractor import default_checkpoint_candidates
        return ", ".join(str(c) for c in default_checkpoint_candidates())

    return WeightsItem("butd", "butd", locate, fetch, looked_in)


def _stanza(model_dir: Path | None) -> WeightsItem:
    def folder() -> tuple[Path, str]:
        from retr.parsers.backends import stanza_model_dir
        return stanza_model_dir(model_dir)

    def locate() -> Path | None:
        from retr.parsers.backends import STANZA_LANGUAGE
        path, _ = folder()
        return path if (path / "resources.json").is_file() and (path / STANZA_LANGUAGE).is_dir() else None

    def fetch(quiet: bool, mirror: str | None) -> Path:
        from retr.parsers.backends import fetch_parser_models, missing_models_error
        path, source = folder()
        if is_offline():
            raise missing_models_error(path, source)
        return fetch_parser_models(path)

    return WeightsItem("stanza", "stanza", locate, fetch, lambda: str(folder()[0]))


#: extractor name → the weights its default ``--weights`` needs
EXTRACTOR_WEIGHTS = {"resnet152-grid": "resnet152", "tencrop-resnet152": "resnet152", "vgg16-maps": "vgg16",
                     "tencrop-vgg19": "vgg19", "tencrop-irv2": "inception_resnet_v2", "butd-regions": "butd"}
WEIGHTS_NAMES = ("resnet152", "vgg16", "vgg19", "inception_resnet_v2", "butd", "stanza")
#: OpenAI's CLIP weights (named by their extractor); not in ``all`` (4.6 GB, no preset needs them): ``clip`` is all four
CLIP_NAMES = ("clip-vit-b-32", "clip-vit-b-16", "clip-vit-l-14", "clip-vit-l-14-336")


def weights_items(names: Iterable[str], stanza_dir: Path | None = None) -> list[WeightsItem]:
    """The items named (weights names, extractor names or ``all``), each once, in :data:`WEIGHTS_NAMES` order."""
    wanted: set[str] = set()
    for name in names:
        if name == "all":
            wanted.update(WEIGHTS_NAMES)
        elif name == "clip":
            wanted.update(CLIP_NAMES)
        elif name in WEIGHTS_NAMES + CLIP_NAMES:
            wanted.add(name)
        elif name in EXTRACTOR_WEIGHTS:
            wanted.add(EXTRACTOR_WEIGHTS[name])
        else:
            raise ParameterError(f"unknown weights {name!r} (expected all, {', '.join(WEIGHTS_NAMES)}, clip, "
                                 f"{', '.join(CLIP_NAMES)}, or an extractor name: {', '.join(EXTRACTOR_WEIGHTS)})",
                                 "names")
    build = {"resnet152": lambda: _torchvision("resnet152"), "vgg16": lambda: _torchvision("vgg16"),
             "vgg19": lambda: _torchvision("vgg19"), "inception_resnet_v2": lambda: _timm("inception_resnet_v2"),
             "butd": _butd, "stanza": lambda: _stanza(stanza_dir)}
    build.update({name: (lambda n=name: _clip(n)) for name in CLIP_NAMES})
    return [build[name]() for name in WEIGHTS_NAMES + CLIP_NAMES if name in wanted]


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
                            f"{format_bytes(SOURCES[item.source].download_bytes)})")
            path = item.fetch(quiet, mirror)
            out.append((item, path, True))
        else:
            out.append((item, path, False))
    return out
