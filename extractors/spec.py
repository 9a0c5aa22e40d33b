"""What retr knows about one extractor, as data: :class:`ExtractorSpec`, registered by the extractor's own module
beside its builder (:func:`retr.extractors.base.register_extractor`), and the kinds of weights it can name.

Everything that lists extractors is derived from the specs: ``retr-pipeline extract --extractor`` choices, the
names ``retr-pipeline fetch-weights`` takes and shows, the weights ``extract-preset`` fetches first, the extras
an extractor needs (checked before it is built, one line naming the extra). Nothing here imports torch.
"""
from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from retr.common.downloads import SOURCES, Source
from retr.common.optional import require

#: the group every weight source is fetched with unless it names another (``retr-pipeline fetch-weights all``)
ALL = "all"


@dataclass(frozen=True, kw_only=True)
class WeightSource(ABC):
    """The weights an extractor's default ``--weights`` loads: one file, fetched ahead of time under the key of its
    :data:`~retr.common.downloads.SOURCES` entry (``resnet152``, ``butd``, ``clip-vit-b-32``).

    ``source``: that key, or a :class:`~retr.common.downloads.Source` given here (URL, file name, size, sha256)
    for a file the table does not list; ``group``: the name that fetches it with others — :data:`ALL` (``fetch-weights
    all``, what ``make extract`` needs) unless the file is large and no preset needs it (the CLIP weights: ``clip``).
    Subclasses say where the file is cached and how it is fetched: :class:`~retr.extractors.weights.TorchvisionWeights`
    (a torchvision weight enum), :class:`~retr.extractors.timm_weights.TimmWeights` (a timm tag),
    :class:`~retr.extractors.clip.OpenClipWeights` (an open_clip tag), :class:`~retr.extractors.weights.UrlWeights`
    (a URL with its size and checksum)."""

    source: str | Source
    group: str = ALL

    def __post_init__(self) -> None:
        if isinstance(self.source, str) and self.source not in SOURCES:
            raise ValueError(f"weights source {self.source!r} is not a key of retr.common.downloads.SOURCES; give a "
                             f"Source (URL, file name, size, sha256) instead")

    @property
    def entry(self) -> Source:
        """The :class:`~retr.common.downloads.Source` of the file (what it is, URL, size, checksums)."""
        return SOURCES[self.source] if isinstance(self.source, str) else self.source

    @property
    def key(self) -> str:
        """The name ``retr-pipeline fetch-weights`` takes for it (the source's key)."""
        return self.entry.key

    @property
    @abstractmethod
    def recorded(self) -> str:
        """The ``weights`` attribute of a feature set extracted with these weights (``ResNet152_Weights.IMAGENET1K_V1``,
        ``timm/inception_resnet_v2.tf_in1k``); for a file whose sha256 is published nowhere, its start
        (``bua-caffe-frcn-r101-k36.pth sha256:``). What a reproduction recipe can require of a feature set."""

    @abstractmethod
    def locate(self) -> Path | None:
        """The cached file, or None when it is not there (never uses the network)."""

    @abstractmethod
    def fetch(self, quiet: bool = False, mirror: str | None = None) -> Path:
        """The cached file, downloaded first when absent (offline: one-line
        :class:`~retr.common.errors.MissingResourceError` naming ``retr-pipeline fetch-weights KEY``)."""

    @abstractmethod
    def looked_in(self) -> str:
        """Where :meth:`locate` looks (folders or files, comma-separated), for the missing-weights line."""


@dataclass(frozen=True)
class RandomInit:
    """How ``--weights random`` is made: ``library``'s own initialisation of the network (``torchvision``, ``timm``,
    ``open_clip``), or retr's (``butd``: seeded normal weights and calibrated norms, docs/butd.md), with ``options``
    given to the network's builder — always under :data:`retr.extractors.weights.RANDOM_SEED` and made once per
    process in the one cache of :func:`retr.extractors.weights.seeded_random_model`."""

    library: str
    options: Mapping[str, Any] = field(default_factory=dict)


#: ``[K, D]`` of one image's features, or how it follows from the builder's options (defaults filled in)
Output = tuple[int, int] | Callable[[Mapping[str, Any]], tuple[int, int]]


@dataclass(frozen=True)
class ExtractorSpec:
    """Everything retr knows about one extractor besides its code.

    * ``name`` — what ``retr-pipeline extract --extractor`` takes (``resnet152-grid``);
    * ``builder(**options) -> Extractor`` — the one entry point; its signature is the set of options it takes;
    * ``kind`` — the feature set's ``kind`` (``grid``, ``maps``, ``tencrop``, ``regions``, ``clip``);
    * ``output`` — ``(K, D)`` of one image's ``features`` ``[K, D]``, or a function of the builder's options
      (a mapping with every default filled in) giving it (``resnet152-grid``: ``(grid_size², 2048)``);
      :func:`~retr.extractors.base.build_extractor` checks every built extractor against it;
    * ``weights`` — the :class:`WeightSource` its default ``--weights`` loads (None: none to fetch);
    * ``extra`` and ``requires`` — the extra of ``pyproject.toml`` (``pipeline``, ``clip``) that installs the
      modules ``requires`` names (``timm``, ``cv2``, ``open_clip``): checked before the builder runs;
    * ``random`` — how ``--weights random`` is made (:class:`RandomInit`); None when it has none.
    """

    name: str
    builder: Callable[..., Any]
    kind: str
    output: Output
    weights: WeightSource | None = None
    extra: str | None = None
    requires: tuple[str, ...] = ()
    random: RandomInit | None = None

    def __post_init__(self) -> None:
        if self.requires and not self.extra:
            raise ValueError(f"extractor {self.name!r} requires {', '.join(self.requires)} but names no extra")
        if not callable(self.output) and len(self.output) != 2:
            raise ValueError(f"output of extractor {self.name!r} must be (K, D), not {self.output!r}")

    @property
    def what(self) -> str:
        """How a message names it: ``the NAME extractor``."""
        return f"the {self.name} extractor"

    def defaults(self) -> dict[str, Any]:
        """The builder's options with their defaults (``**``-collected ones excluded)."""
        return {n: p.default for n, p in inspect.signature(self.builder).parameters.items()
                if p.kind is not inspect.Parameter.VAR_KEYWORD and p.default is not inspect.Parameter.empty}

    def feature_shape(self, options: Mapping[str, Any] | None = None) -> tuple[int, int]:
        """``(K, D)`` of one image's ``features`` built with ``options`` (the builder's defaults for the rest)."""
        if not callable(self.output):
            return tuple(self.output)
        return tuple(self.output({**self.defaults(), **(options or {})}))

    def check_extra(self) -> None:
        """Import every module of ``requires``; a missing one is one
        :class:`~retr.common.optional.MissingExtraError` line naming this extractor and its extra."""
        for module in self.requires:
            require(module, self.extra, self.what)
