"""The model registry (timm-style): one :class:`ModelSpec` per model, registered by the model's own module.

A spec names everything the trainer needs to know about a model and nothing is defined elsewhere:

* ``model_class`` — the :class:`~retr.trainers.models.base.MatchingModel` subclass; it takes tensors only;
* ``config_class`` — a dataclass of the model's settings (a :class:`~retr.trainers.config.Settings` whose fields
  are :func:`~retr.trainers.config.setting` s): the one definition of each setting's name, type, default and help;
  the model is built from it (``model_class(vocab_size, img_dim, …sizes, config=…)``);
* ``presets`` — named overrides (``{"f30k": {"epochs": 30, "lambda_softmax": 4.0}, …}``) of the schedule
  (:data:`~retr.trainers.config.SCHEDULE_KEYS`) and of the config's fields, checked at registration;
* ``inputs`` and ``load_inputs`` — for models that need more than features and captions: the side files
  (trees, concepts, labels) and the function that reads them into tensors (:class:`ModelInputs`), or a pretrained
  part's weights (VSE∞'s BERT);
* ``caption_vocabulary`` — for a model whose settings fix how captions are tokenised (VSE∞ with BERT: the
  pretrained model's WordPiece vocabulary), that vocabulary; otherwise a run builds SCAN's word vocabulary from its
  captions (or reads ``--vocab``);
* ``feature_kinds`` and ``check_features`` — the feature kinds the model's papers use (training on another is a
  note, ``reproduce`` refuses it) and, where the model's settings fix the shape it takes, the refusal of a
  feature set they cannot take, in the options a user can give instead.

``retr-train MODEL`` is generated from the spec (:mod:`retr.trainers.commands.train`); a run's settings are merged
and read back by :mod:`retr.trainers.config`, which takes the spec for what is the model's. Every module in this
package is imported on first use, so a new model is one module that calls :func:`register_model`.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from retr.common.errors import UserError
from retr.store.features import KINDS
from retr.trainers.config import SCHEDULE_KEYS, Settings, make_config, preset_values


@dataclass(frozen=True)
class InputFile:
    """A side file a model reads through its spec's ``load_inputs`` (an option ``--NAME`` of its command).
    ``what``: the file in words (``a trees.h5 file``: a wrong path's one line says it); ``resources``: names the
    option takes besides a file (resources fetched on first use, e.g. ``glove``)."""

    name: str
    help: str
    required: bool = False
    what: str = "a file"
    resources: tuple[str, ...] = ()


@dataclass
class ModelInputs:
    """What ``load_inputs`` returns: ``sizes`` — constructor arguments that follow from the files (e.g.
    ``num_concepts``), ``settings`` — settings the files fix (SMFEA's ``concept_vectors="fixed"`` and its
    ``concept_word_dim``: the loop applies them to the run's config), ``tensors`` — training-time data handed to
    :meth:`~retr.trainers.models.base.MatchingModel.prepare_training` (e.g. ``{"nodes": [M, 7] long}``) — and the
    notes to print."""

    sizes: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


LoadInputs = Callable[..., ModelInputs]


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer knows about one model (see the module docstring).

    ``load_inputs(data, files, config, vocab) -> ModelInputs``: ``data`` is the training split
    (:class:`~retr.trainers.data.splits.SplitData`), ``files`` ``{input name: path or None}``, ``config`` the model's
    config dataclass, ``vocab`` the run's caption vocabulary. ``caption_vocabulary(config, given) -> vocabulary or
    None``: the vocabulary ``config`` fixes (None: the run's own, built or ``--vocab``); ``given`` is the ``--vocab``
    the user gave, which it refuses in one line where it fixes one. ``preset_name(name, explicit) -> name`` lets a model pick a finer preset from explicit
    settings (SCAN: the dataset's preset for the chosen direction and aggregation). ``shortcuts`` are extra
    flags that set several settings (``{"--no-kl": ("help", {"kl_weight": 0.0})}``). ``upgrade_args`` turns the
    stored ``model_args`` of runs written before a change into today's ``(model_args, inputs)`` (called by
    :func:`retr.trainers.config.upgrade_stored`). ``after_training``
    names the reports made once a run is trained (:data:`retr.trainers.evaluation.reports.AFTER_TRAINING`),
    e.g. SMFEA's ``tree_accuracy``. ``feature_kinds``: the kinds of feature set (``grid``, ``maps``, ``tencrop``,
    ``regions``, ``clip``) its papers trained on, empty for any. ``check_features(config, (K, D)) -> str | None``:
    why the model built with ``config`` (its config dataclass) cannot take ``[K, D]`` features, in the command's
    options (None: it can).
    """

    name: str
    model_class: type
    config_class: type
    summary: str
    examples: tuple[str, ...] = ()
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    default_preset: str | None = None
    preset_name: Callable[[str, Mapping[str, Any]], str] | None = None
    inputs: tuple[InputFile, ...] = ()
    load_inputs: LoadInputs | None = None
    caption_vocabulary: Callable[..., Any] | None = None
    shortcuts: Mapping[str, tuple[str, Mapping[str, Any]]] = field(default_factory=dict)
    upgrade_args: Callable[[dict], tuple[dict, dict]] | None = None
    after_training: tuple[str, ...] = ()
    feature_kinds: tuple[str, ...] = ()
    check_features: Callable[[Mapping[str, Any], tuple[int, int]], str | None] | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.config_class, type) and issubclass(self.config_class, Settings)):
            raise ValueError(f"the config class of {self.name} must be a dataclass deriving from "
                             "retr.trainers.config.Settings (validated when made)")
        known = {f.name for f in dataclasses.fields(self.config_class)}
        for preset, values in self.presets.items():
            unknown = sorted(set(values) - known - set(SCHEDULE_KEYS))
            if unknown:
                raise ValueError(f"preset {self.name}/{preset} sets unknown setting(s): {', '.join(unknown)}")
        for flag, (_, values) in self.shortcuts.items():
            unknown = sorted(set(values) - known)
            if unknown:
                raise ValueError(f"shortcut {flag} of {self.name} sets unknown setting(s): {', '.join(unknown)}")
        if not self.examples:
            raise ValueError(f"model {self.name} needs at least one example command (shown in --help)")
        if self.default_preset is not None and self.default_preset not in self.presets:
            raise ValueError(f"default preset {self.default_preset!r} of {self.name} is not among its presets")
        unknown_kinds = sorted(set(self.feature_kinds) - set(KINDS))
        if unknown_kinds:
            raise ValueError(f"feature kind(s) {', '.join(unknown_kinds)} of {self.name} are not among {KINDS}")

    def preset_for(self, name: str | None, explicit: Mapping[str, Any] | None = None) -> str | None:
        """The name of the preset that applies: ``name`` (None: the default preset), refined by ``explicit``
        settings through ``preset_name`` (SCAN: ``f30k`` + ``--direction i2t`` → ``f30k-i2t-avg``)."""
        name = name or self.default_preset
        if name is not None and self.preset_name is not None:
            name = self.preset_name(name, explicit or {})
        if name is not None and name not in self.presets:
            raise UserError(f"model {self.name} has no preset {name!r} (known: {', '.join(self.presets)})")
        return name

    def resolve_preset(self, name: str | None, explicit: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The overrides of the preset that applies (:meth:`preset_for`)."""
        name = self.preset_for(name, explicit)
        return {} if name is None else dict(self.presets[name])

    @property
    def setting_names(self) -> set[str]:
        """The names of the model's settings (its config dataclass's fields)."""
        return {f.name for f in dataclasses.fields(self.config_class)}



_SPECS: dict[str, ModelSpec] = {}
_LOADED = False


def register_model(spec: ModelSpec) -> ModelSpec:
    """Register ``spec`` (called at the bottom of the model's module); sets ``model_class.name``."""
    if spec.name in _SPECS and _SPECS[spec.name].model_class is not spec.model_class:
        raise ValueError(f"model {spec.name!r} registered twice")
    spec.model_class.name = spec.name
    _SPECS[spec.name] = spec
    return spec


def unregister_model(name: str) -> None:
    """Remove model ``name`` from the registry (for tests that register a throwaway model)."""
    _SPECS.pop(name, None)


def _load_all() -> None:
    """Import every module of this package (found in its folder, so the package itself is not imported from
    here), so each registers its spec."""
    global _LOADED
    if _LOADED:
        return
    package = __name__.rpartition(".")[0]
    for module in pkgutil.iter_modules([str(Path(__file__).resolve().parent)]):
        importlib.import_module(f"{package}.{module.name}")
    _LOADED = True


def list_models() -> list[str]:
    """Names of every registered model, sorted."""
    _load_all()
    return sorted(_SPECS)


def get_spec(name: str) -> ModelSpec:
    _load_all()
    if name not in _SPECS:
        raise UserError(f"unknown model {name!r} (known: {', '.join(sorted(_SPECS))})")
    return _SPECS[name]


def model_class(name: str) -> type:
    return get_spec(name).model_class


def create_model(name: str, config=None, **kwargs):
    """An untrained model ``name`` (a script's entry point; training builds its model from the run's settings):
    the data sizes (``vocab_size``, ``img_dim``, …) as keywords, and its settings as ``config`` (its config
    dataclass) or as keywords (the config made from them, unknown names refused by name)."""
    spec = get_spec(name)
    names = {f.name for f in dataclasses.fields(spec.config_class)}
    unknown = sorted(set(kwargs) - names - set(inspect.signature(spec.model_class.__init__).parameters))
    if unknown:
        raise ValueError(f"unknown setting(s) for {spec.config_class.__name__}: {', '.join(unknown)}")
    settings = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    if settings:
        if config is not None:
            raise ValueError(f"give {name}'s settings as config or as keywords, not both ({', '.join(settings)})")
        config = make_config(spec.config_class, settings)
    return spec.model_class(config=config, **kwargs)


def preset(name: str, dataset: str | None = None, **explicit) -> dict:
    """The settings preset ``dataset`` of model ``name`` means (None: its default preset), refined by
    ``explicit`` settings: the config's defaults with the preset's overrides (and its schedule) applied."""
    return preset_values(get_spec(name), dataset, **explicit)
