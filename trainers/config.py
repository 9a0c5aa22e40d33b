"""A run's settings: the one definition of every setting, and the one place they are merged and read back.

**Defined.** A setting is a dataclass field made with :func:`setting`: its name, type annotation, default and help
are the only place it is defined. Two kinds of dataclass hold them, both :class:`Settings` (validated once, when
made):

* :class:`TrainConfig` — what every run has: data, schedule, device, logging — and, in ``model_config``, the
  model's own settings as its config dataclass;
* each model module's config dataclass (``SCANConfig``, …: its spec's ``config_class``).

**Merged.** :func:`settings_from_options` makes a new run's ``TrainConfig`` once, from, lowest first: the config
dataclass's defaults, the preset (``--preset``, else the settings file's, else the model's default), the settings
file (``--config``: a flat JSON/YAML mapping, or a run's ``config.json``) and the options given; every later stage
receives that object. :func:`settings_for_resume` and :func:`resumed_settings` continue a stored run with what may
change on ``--resume``.

**Stored and read back.** :meth:`TrainConfig.as_stored` is ``config.json``'s form (the model's settings and the sizes
that follow from the data together as ``model_args``); :func:`settings_from_stored` reads that form back, runs
written before a change upgraded by their spec's ``upgrade_args`` (:func:`upgrade_stored`).

A model setting's route, e.g. SCAN's ``lambda_softmax``: its option (generated from the field by
:mod:`retr.trainers.commands.train`) → :func:`settings_from_options` here (``SCANConfig`` made and validated, in
``TrainConfig.model_config``) → the loop builds the model from that object (:func:`retr.trainers.training.loop.
build_model`) → the model (``SCAN``: its constructor keeps it, its attention uses it, both in its module;
docs/trainer.md, "Adding a model").

The functions that need a model's spec take it as an argument (this layer imports no model).

Field metadata understood by the command builder:

* ``help`` — the option's help text;
* ``flag`` — the option's spelling when it is not ``--field-name``: ``"--max-violation/--sum-violation"`` (an
  on/off pair), ``"--no-imgnorm"`` (a single flag that sets ``True``), ``"--train-split"`` (another name);
* ``cli=False`` — not an option (filled by the loop or the command, e.g. the model name);
* ``flag_value`` — the value of the option given without one (``--amp`` alone is ``--amp fp16``);
* ``aliases`` — older spellings kept working: ``{"--no-preload": "off"}`` is a hidden flag that sets the value;
* ``resume_applies=True`` — a ``TrainConfig`` setting that ``--resume`` may change (applied and recorded in
  ``config.json``: more epochs, another device); any other setting given on resume must equal the run's;
* ``at_least`` / ``below`` — the bounds of a number (``below`` excluded): a size is at least 1, a dropout below 1.
  :func:`validate_settings` checks them, and the choices, whenever a settings dataclass is made.

Types: ``int``, ``float``, ``str``, ``bool``, ``Literal[...]`` (a choice), ``X | None`` (None: unset or
"choose for me"), ``tuple[str, ...]`` (an option given several times).
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Mapping, NamedTuple

import yaml

from retr.common.errors import UserError, with_flags
from retr.common.textfiles import read_utf8
from retr.store.vocab import DEFAULT_THRESHOLD


def setting(default: Any = dataclasses.MISSING, help: str = "", *, flag: str | None = None, cli: bool = True,
            default_factory: Any = dataclasses.MISSING, resume_applies: bool = False,
            flag_value: Any = None, aliases: dict[str, Any] | None = None, at_least: float | None = None,
            below: float | None = None) -> Any:
    """A dataclass field that is a user-facing setting (see the module docstring for the metadata)."""
    metadata = {"help": help, "flag": flag, "cli": cli, "resume_applies": resume_applies, "flag_value": flag_value,
                "aliases": aliases or {}, "at_least": at_least, "below": below}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


class Settings:
    """Base of every settings dataclass (:class:`TrainConfig`, each model's config): a value outside its field's
    choices or bounds is a ``ValueError`` naming the setting, raised when the dataclass is made
    (:func:`validate_settings`)."""

    def __post_init__(self) -> None:
        validate_settings(self)


@dataclass
class TrainConfig(Settings):
    """Everything a training run depends on (stored in ``config.json``: :meth:`as_stored`).

    ``model_config`` is the model's own settings, its spec's config dataclass (``SCANConfig``, …; None before a
    model is chosen); ``sizes`` the model's constructor arguments that follow from the data, filled by the loop
    (``vocab_size``, ``img_dim``, e.g. SMFEA's dictionary sizes and the word vectors' file); ``inputs`` the side
    files the model's spec reads into tensors (``{"trees": path, …}``).
    """

    model: str = setting("", cli=False)
    model_config: Settings | None = setting(None, cli=False)
    sizes: dict = setting(default_factory=dict, cli=False)
    inputs: dict = setting(default_factory=dict, cli=False)
    features: str = setting("", "Feature set (.h5).")
    manifest: str = setting("", "Manifest (.jsonl).")
    out: str = setting("", "Run directory.")
    preset: str | None = setting(None, "Published settings to start from (explicit options override them).")
    epochs: int = setting(30, "Training epochs.", resume_applies=True, at_least=1)
    batch_size: int = setting(128, "Global batch (split over DDP ranks).", at_least=2)
    lr: float = setting(2e-4, "Learning rate.", at_least=0)
    lr_update: int = setting(15, "Multiply the lr by 0.1 every N epochs.", at_least=1)
    grad_clip: float = setting(2.0, "Gradient-norm clip (0 = off).", at_least=0)
    warmup_epochs: int = setting(0, "Train the first N epochs on the sum of violations, then on the model's "
                                    "configured loss (VSE∞'s warm-up against the hardest-negative collapse; the "
                                    "papers used none).", at_least=0)
    early_stop: int = setting(0, "Stop after N epochs without a better validation rSum (0 = never).", resume_applies=True,
                          at_least=0)
    seed: int = setting(0, "Seed of every random number generator.", at_least=0)
    device: str = setting("auto", "cpu, cuda, cuda:1 … (auto: cuda if any).", resume_applies=True)
    workers: int = setting(0, "DataLoader worker processes (0: batches are read in the training process, enough "
                              "for cached features; extraction's default is 2, for decoding images).",
                           resume_applies=True, at_least=0)
    preload: Literal["auto", "host", "gpu", "off"] = setting(
        "auto", "Where the features are held: host (memory; --preload alone), gpu (on the training device, batches "
        "gathered there; falls back to host when they do not fit), off (read from the file per batch); auto: from "
        "the memory free at start, gpu on CUDA while 25 % of the device stays free, else host while max(4 GiB, 25 %) "
        "of the available host memory stays free (sets < 256 MiB always), else off; the log says which and why.",
        flag_value="host", resume_applies=True, aliases={"--no-preload": "off"})
    amp: Literal["off", "fp16", "bf16"] = setting(
        "off", "Mixed precision: bf16 autocast (CPU and CUDA), fp16 autocast with a gradient scaler (CUDA only); "
        "--amp alone is fp16.", flag_value="fp16")
    optimizer_impl: Literal["auto", "fused", "foreach", "loop"] = setting(
        "auto", "How the optimiser updates the parameters: fused (one kernel), foreach (batched tensor ops), loop "
        "(one parameter at a time); auto: fused on CUDA where torch has it (else foreach), loop on CPU.",
        resume_applies=True)
    compile: Literal["off", "default", "reduce-overhead", "max-autotune"] = setting(
        "off", "torch.compile the model's training scoring function with this mode (--compile alone: default); "
        "the losses equal eager's to rounding.", flag_value="default", resume_applies=True)
    ema: float = setting(0.0, "Keep an exponential moving average of the weights with this decay (e.g. 0.999), "
                              "saved as ema.pt (eval --checkpoint ema.pt); 0 = off.", at_least=0, below=1)
    drop_last: bool = setting(False, "Drop each epoch's last, smaller training batch (CVSE's loader does; SMFEA's "
                                     "presets).", flag="--drop-last/--keep-last")
    accum_steps: int = setting(1, "Split each batch into N micro-batches, one backward each, one optimiser step "
                                  "(a negative is then another pair of the same micro-batch: B/N−1 of them).", at_least=1)
    train_splits: tuple[str, ...] = setting(("train", "restval"),
                                            "Training split (repeat the option, or give a comma-separated list).",
                                            flag="--train-split")
    val_split: str = setting("val", "Validation split.")
    val_images: int = setting(1000, "Validate on the first N validation images (0 = all).", at_least=0)
    vocab: str | None = setting(None, "Use this vocabulary (SCAN's {name}_vocab.json) instead of building one.")
    vocab_splits: tuple[str, ...] = setting((), "Build the vocabulary from these splits' captions (default: the "
                                                "training splits; SCAN's and VSE++'s vocab.py read train + dev: "
                                                "--vocab-split train,restval,val).", flag="--vocab-split")
    vocab_threshold: int = setting(DEFAULT_THRESHOLD, "Keep words seen at least N times in training.", at_least=1)
    log_every: int = setting(10, "Steps between metrics lines (0 = none).", resume_applies=True, at_least=0)
    log: tuple[str, ...] = setting((), "Also log to: tensorboard (RUN/tensorboard/), wandb (Weights & Biases; "
                                       "WANDB_MODE=offline writes RUN/wandb/ only); repeatable.",
                                   resume_applies=True)
    wandb_project: str = setting("retr", "W&B project of --log wandb.", resume_applies=True)
    wandb_name: str | None = setting(None, "W&B run name of --log wandb (default: the run folder's name).",
                                     resume_applies=True)
    keep_checkpoints: int = setting(2, "Epoch checkpoints kept (best.pt is kept besides; 0 = all).", resume_applies=True,
                                   at_least=0)

    def __post_init__(self) -> None:
        # --train-split repeated or comma-separated (as every command's split option)
        self.train_splits = tuple(p.strip() for s in self.train_splits for p in str(s).split(",") if p.strip())
        self.vocab_splits = tuple(p.strip() for s in self.vocab_splits for p in str(s).split(",") if p.strip())
        self.log = (self.log,) if isinstance(self.log, str) else tuple(self.log)     # config.json holds a list
        self.preload = preload_choice(self.preload)
        super().__post_init__()
        if self.batch_size % self.accum_steps:
            raise ValueError(f"accum_steps {self.accum_steps} must divide batch_size {self.batch_size}")

    def as_stored(self) -> dict:
        """These settings as ``config.json`` (and a checkpoint's ``config``) store them: every field, the model's
        settings and ``sizes`` together as ``model_args`` (the layout every stored run has)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("model_config", "sizes")}
        out["inputs"] = dict(self.inputs)
        out["model_args"] = {**(asdict(self.model_config) if self.model_config is not None else {}), **self.sizes}
        return out


#: the settings ``--resume`` applies (the fields marked ``resume_applies``)
RESUME_APPLIES = tuple(f.name for f in fields(TrainConfig) if f.metadata.get("resume_applies"))

#: the schedule settings a model's preset may set besides the model's own
SCHEDULE_KEYS = ("epochs", "batch_size", "lr", "lr_update", "grad_clip", "early_stop", "warmup_epochs", "drop_last")

#: keys of a run's config.json that are records of the run, not settings
RUN_RECORDS = ("retr_version", "feature_attrs", "vocab_size", "train_images", "val_images_used", "model",
               "model_args", "inputs", "data_identity", "environment", "paths_from_run")

#: side files that runs written before the spec registry kept among their model's settings
OLD_SIDE_FILES = ("trees", "concepts", "labels")


def setting_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of a settings dataclass that are command-line options."""
    return [f for f in fields(cls) if f.metadata.get("cli", True)]


def field_types(cls: type) -> dict[str, Any]:
    """Resolved type annotations of a settings dataclass (``from __future__ import annotations`` safe)."""
    return typing.get_type_hints(cls)


def choices_of(annotation: Any) -> tuple | None:
    """The allowed values of a ``Literal[...]`` (or ``Literal[...] | None``) annotation, else None."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is Literal:
            return typing.get_args(arg)
    return None


#: where the training features may be held (``TrainConfig.preload``, :class:`retr.trainers.data.splits.ImageFeatures`)
PRELOAD_CHOICES = choices_of(field_types(TrainConfig)["preload"])   # its Literal


def preload_choice(value: str | bool | None) -> str:
    """``value`` as one of :data:`PRELOAD_CHOICES`. ``--preload`` was an on/off pair before it could name the GPU:
    runs, settings files and callers may hold ``None``/``True``/``False``, which mean ``auto``/``host``/``off``.
    Anything else raises ``ValueError`` naming the setting."""
    if value is None or isinstance(value, bool):
        return {None: "auto", True: "host", False: "off"}[value]
    if value not in PRELOAD_CHOICES:
        raise ValueError(f"preload must be one of {', '.join(PRELOAD_CHOICES)}, not {value!r}")
    return value


def validate_settings(config: Any) -> None:
    """Raise ``ValueError`` naming the setting when a ``Literal`` field holds a value outside its choices, or a
    number lies outside its ``at_least``/``below`` bounds (a size of 0, a dropout of 1). Every settings dataclass
    calls it once, when it is made (:class:`Settings`)."""
    hints = field_types(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        allowed = choices_of(hints[f.name])
        if allowed is not None and value is not None and value not in allowed:
            raise ValueError(f"{f.name} must be one of {', '.join(map(str, allowed))}, not {value!r}")
        low, high = f.metadata.get("at_least"), f.metadata.get("below")
        if value is None or isinstance(value, bool) or (low is None and high is None):
            continue
        if not isinstance(value, (int, float)):
            raise ValueError(f"{f.name} must be a number, not {value!r}")
        if (low is not None and not value >= low) or (high is not None and not value < high):
            bounds = f"≥ {low:g}" if high is None else f"< {high:g}" if low is None else f"in [{low:g}, {high:g})"
            raise ValueError(f"{f.name} must be {bounds}, not {value!r}")




def make_config(cls: type, values: Mapping[str, Any] | None = None):
    """``cls(**values)`` with unknown names refused by name (``ValueError``); the choices and bounds are checked
    as the dataclass is made (:class:`Settings`)."""
    values = dict(values or {})
    unknown = sorted(set(values) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"unknown setting(s) for {cls.__name__}: {', '.join(unknown)}")
    return cls(**values)


# ------------------------------------------------------------------------------------------------ flags

def flag_of(field: dataclasses.Field) -> str:
    """The option spelling of a settings field (its metadata ``flag`` or ``--field-name``)."""
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def flag_names(spec) -> dict[str, str]:
    """Setting name → flag of ``spec``'s command (a :class:`~retr.trainers.models.registry.ModelSpec`), for error
    messages."""
    named = [*setting_fields(TrainConfig), *setting_fields(spec.config_class)]
    names = {f.name: flag_of(f).split("/")[0] for f in named}
    names.update({i.name: "--" + i.name.replace("_", "-") for i in spec.inputs})
    return names


def shortcut_name(flag: str) -> str:
    """The parameter name of a spec's shortcut flag (``--no-kl`` → ``shortcut_no_kl``)."""
    return "shortcut_" + flag.lstrip("-").replace("-", "_")


def shortcut_values(spec, values: Mapping[str, Any], explicit: set[str]) -> dict[str, Any]:
    """The settings the shortcut flags given set (``--no-kl`` → ``{"kl_weight": 0.0}``)."""
    out: dict[str, Any] = {}
    for flag, (_, overrides) in spec.shortcuts.items():
        if shortcut_name(flag) in explicit and values[shortcut_name(flag)]:
            out.update(overrides)
    return out


# ------------------------------------------------------------------------------------------------ merged

def settings_from_options(spec, values: Mapping[str, Any], explicit: set[str]) -> TrainConfig:
    """A new run's settings for ``spec``'s model: its config's defaults ← the preset ← the settings file
    (``values["config"]``) ← the options given (``explicit``: the names of ``values`` given on the command line),
    made once into one :class:`TrainConfig` with its side files. A value outside its bounds, an unknown setting in
    the file, a required option or side file left out: one :class:`UserError` naming the flag."""
    train_names = {f.name for f in setting_fields(TrainConfig)}
    model_names = {f.name for f in fields(spec.config_class)}
    input_names = {i.name for i in spec.inputs}
    given = {k: values[k] for k in explicit if k in train_names | {f.name for f in setting_fields(spec.config_class)}}
    given.update(shortcut_values(spec, values, explicit))
    given_inputs = {k: values[k] for k in explicit if k in input_names}
    from_file, file_inputs = _settings_file(spec, values["config"]) if values.get("config") else ({}, {})
    preset = spec.preset_for(given.get("preset") or from_file.get("preset"), {**from_file, **given})
    merged = {**spec.resolve_preset(preset), **from_file, **given, "preset": preset}
    for name in ("features", "manifest", "out"):
        if not merged.get(name):
            raise UserError(f"--{name} is required (or give it in --config)")
    inputs = {k: v for k, v in {**file_inputs, **given_inputs}.items() if v}
    flags = flag_names(spec)
    try:
        cfg = TrainConfig(model=spec.name,
                          model_config=make_config(spec.config_class,
                                                   {k: v for k, v in merged.items() if k in model_names}),
                          inputs=inputs, **{k: v for k, v in merged.items() if k in train_names})
    except ValueError as exc:
        raise UserError(with_flags(str(exc), flags, flags)) from None
    missing = [i.name for i in spec.inputs if i.required and i.name not in inputs]
    if missing:
        raise UserError(f"{spec.name} needs --{missing[0].replace('_', '-')}")
    return cfg


def _settings_file(spec, path) -> tuple[dict, dict]:
    """``(settings, side files)`` of the settings file ``path`` for ``spec``'s model: a run's records and the sizes
    that follow from its data left out, side files an older run kept among its settings moved to the side files
    (its spec's ``upgrade_args``); a run of another model, or a name that is no setting of this one, refused."""
    try:
        data = read_settings_file(path)
    except UserError as exc:                       # each message starts with the file's path
        raise UserError(f"--config {exc}") from None
    except OSError as exc:
        raise UserError(f"--config {path}: {exc.strerror or exc}") from None
    if data.get("model", spec.name) != spec.name:
        raise UserError(f"--config {path} is a {data['model']} run, not {spec.name}")
    model_names = {f.name for f in fields(spec.config_class)}
    _, inputs = _upgrade_model_args(spec, {k: v for k, v in data.items() if k in model_names | set(OLD_SIDE_FILES)},
                                    data.get("inputs") or {})
    settings = {k: v for k, v in data.items()
                if k not in RUN_RECORDS and k not in OLD_SIDE_FILES and k not in inputs}
    sizes = data_size_names(spec)
    known = {f.name for f in setting_fields(TrainConfig)} | model_names | sizes
    unknown = sorted(set(settings) - known - {i.name for i in spec.inputs})
    if unknown:
        raise UserError(f"--config {path}: unknown setting(s) for {spec.name}: {', '.join(unknown)}")
    input_names = {i.name for i in spec.inputs}
    inputs.update({k: v for k, v in settings.items() if k in input_names})
    return {k: v for k, v in settings.items() if k not in sizes and k not in input_names}, \
        {k: v for k, v in inputs.items() if k in input_names}


def data_size_names(spec) -> set[str]:
    """The model's constructor arguments that follow from the data (``vocab_size``, ``img_dim``, SMFEA's
    dictionary sizes, the word vectors' file …): every one but ``config``."""
    params = inspect.signature(spec.model_class.__init__).parameters
    return {n for n, p in params.items() if n not in ("self", "config") and p.kind is p.POSITIONAL_OR_KEYWORD}


def preset_values(spec, name: str | None = None, **explicit) -> dict[str, Any]:
    """The settings preset ``name`` of ``spec``'s model means (None: its default preset), refined by ``explicit``
    settings: the config's defaults with the preset's overrides (and its schedule) applied."""
    return {**asdict(spec.config_class()), **spec.resolve_preset(name, explicit)}


def read_settings_file(path: str | Path) -> dict:
    """Settings from a JSON or YAML file: a flat ``{setting: value}`` mapping, or a run's ``config.json``
    (its ``model_args`` are flattened in; sizes that follow from the data are dropped by
    :func:`settings_from_options`). A file that is absent, a folder, not UTF-8 text or does not parse is a
    :class:`UserError` in one line starting with the path (a parse error: its line and column)."""
    path = Path(path)
    yaml_file = path.suffix.lower() in (".yaml", ".yml")
    text = read_utf8(path, f"a settings file ({'YAML' if yaml_file else 'JSON'})")
    if yaml_file:
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
            raise UserError(f"{path}{where}: not YAML ({problem})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path} line {exc.lineno}, column {exc.colno}: not JSON ({exc.msg}); settings files "
                            "are JSON, or YAML named .yaml/.yml") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} holds {type(data).__name__ if data is not None else 'nothing'}, not a mapping of "
                        "settings (setting: value)")
    if isinstance(data.get("model_args"), dict):
        flat = {k: v for k, v in data.items() if k != "model_args"}
        flat.update(data["model_args"])
        data = flat
    return data


# ------------------------------------------------------------------------------------------------ stored

def _upgrade_model_args(spec, model_args: Mapping[str, Any], inputs: Mapping[str, Any] | None) -> tuple[dict, dict]:
    """``(model_args, inputs)`` of a run written before a change, in today's form (the spec's ``upgrade_args``:
    side files kept among the settings move to ``inputs``; a setting added later gets its old value)."""
    inputs = dict(inputs or {})
    model_args = dict(model_args)
    if spec.upgrade_args is not None:
        model_args, moved = spec.upgrade_args(model_args)
        inputs = {**moved, **inputs}
    return dict(model_args), inputs


def upgrade_stored(spec, stored: Mapping[str, Any]) -> dict:
    """A stored run's ``config.json`` (or a checkpoint's ``config``) in today's form: ``--amp`` of before its
    choices, side files and settings its spec upgrades (:func:`_upgrade_model_args`)."""
    stored = dict(stored)
    if isinstance(stored.get("amp"), bool):           # before --amp fp16|bf16: a flag meaning fp16 on CUDA
        stored["amp"] = "fp16" if stored["amp"] else "off"
    stored["model_args"], stored["inputs"] = _upgrade_model_args(spec, stored.get("model_args") or {},
                                                                  stored.get("inputs"))
    return stored


def settings_from_stored(spec, stored: Mapping[str, Any]) -> TrainConfig:
    """The :class:`TrainConfig` a stored run's ``config.json`` (or a checkpoint's ``config``) of ``spec``'s model
    holds, in today's form (:func:`upgrade_stored`; upgrading a form already upgraded changes nothing); its records
    (version, data identity …) are left out. A setting its model no longer has is a ``ValueError`` naming it."""
    stored = upgrade_stored(spec, stored)
    names = {f.name for f in fields(spec.config_class)}
    model_args = stored["model_args"]
    known = {f.name for f in fields(TrainConfig)} - {"model", "model_config", "sizes", "inputs"}
    return TrainConfig(model=spec.name, inputs=stored["inputs"],
                       model_config=make_config(spec.config_class, {k: v for k, v in model_args.items() if k in names}),
                       sizes={k: v for k, v in model_args.items() if k not in names},
                       **{k: v for k, v in stored.items() if k in known})


# ------------------------------------------------------------------------------------------------ resumed

class Difference(NamedTuple):
    """A setting or data fingerprint asked for now (``given``) that is not the run's (``stored``); both as shown."""

    name: str
    given: str
    stored: str

    def __str__(self) -> str:
        return f"{self.name} {self.given} (run: {self.stored})"


#: what a run's settings may differ in without being another run: where its data and folder are now
WHERE = ("features", "manifest", "inputs", "out")


def setting_differences(asked: TrainConfig, stored: TrainConfig,
                        may_differ: tuple[str, ...] = RESUME_APPLIES) -> list[Difference]:
    """Each setting of ``asked`` (model settings and :class:`TrainConfig`'s; the data paths, side files and run
    folder aside) that is not ``stored``'s; settings named in ``may_differ`` are not compared."""
    new_model, old_model = asdict(asked.model_config), asdict(stored.model_config)
    differences = [Difference(k, repr(new_model.get(k)), repr(v)) for k, v in old_model.items()
                   if new_model.get(k) != v]
    differences += [Difference(f.name, repr(getattr(asked, f.name)), repr(getattr(stored, f.name)))
                    for f in sorted(fields(TrainConfig), key=lambda f: f.name)
                    if f.name not in may_differ and f.name not in ("model", "model_config", "sizes", *WHERE)
                    and getattr(asked, f.name) != getattr(stored, f.name)]
    return differences


def resumed_settings(stored: TrainConfig, asked: TrainConfig, folder) -> TrainConfig:
    """The run's own settings (``stored``) with those a resume may change taken from ``asked``
    (:data:`RESUME_APPLIES`: epochs, device, workers …, and where its data and folder are now); any other
    difference is refused in one line that names each setting."""
    if stored.model != asked.model:
        raise UserError(f"{folder} is a {stored.model} run; continue it with `retr-train {stored.model} --resume "
                        f"--out {folder}`")
    differences = setting_differences(asked, stored)
    if differences:
        raise UserError(f"{folder} cannot change on resume: {'; '.join(map(str, differences))}; resume with the "
                        "run's settings (leave those options out) or choose another --out")
    return dataclasses.replace(stored, **{k: getattr(asked, k) for k in (*RESUME_APPLIES, *WHERE)})


def settings_for_resume(spec, stored: TrainConfig, values: Mapping[str, Any], explicit: set[str]) -> TrainConfig:
    """``--resume``: the run's own settings (``stored``, from its ``config.json``), with the options given now
    applied where a resume may change them (``resume_applies`` settings, and ``--features``/``--manifest``, which
    the loop checks hold the same data; the run's folder is where it is now). Any other option given must equal
    the run's, else one line names each difference, by flag."""
    flags = flag_names(spec)
    train_names = {f.name for f in setting_fields(TrainConfig)}
    model_names = {f.name for f in setting_fields(spec.config_class)}
    given = {k: values[k] for k in explicit if k in model_names}
    given.update(shortcut_values(spec, values, explicit))
    changes: dict[str, Any] = {"out": values["out"]}
    for name in explicit & train_names - {"out"}:
        changes[name] = tuple(values[name]) if isinstance(getattr(stored, name), tuple) else values[name]
    try:
        asked = dataclasses.replace(stored, model_config=dataclasses.replace(stored.model_config, **given), **changes)
    except ValueError as exc:
        raise UserError(with_flags(str(exc), flags, flags)) from None
    differences = [f"{flags.get(d.name, d.name)} {d.given} (run: {d.stored})"
                   for d in setting_differences(asked, stored)]
    differences += [f"{flags.get(i.name, i.name)} {values[i.name]} (run: {stored.inputs.get(i.name)})"
                    for i in spec.inputs
                    if i.name in explicit and not _same_path(values[i.name], stored.inputs.get(i.name))]
    if differences:
        raise UserError(f"{values['out']} cannot change on resume: {'; '.join(differences)}; resume with the run's "
                        "settings (leave those options out) or choose another --out")
    return asked


def _same_path(a: str | None, b: str | None) -> bool:
    return bool(a) and bool(b) and Path(a).resolve() == Path(b).resolve()


# ------------------------------------------------------------------------------------------------ fields

def margin_setting(default: float) -> Any:
    """The hinge margin of a model's ranking loss (one help text for every model)."""
    return setting(default, "Hinge margin of the ranking loss.", at_least=0)


def violation_setting(default: bool) -> Any:
    """Hardest negatives or the sum over negatives (one flag pair for every model)."""
    return setting(default, "Hardest negatives (VSE++) or the sum over all negatives (VSE0).",
                   flag="--max-violation/--sum-violation")


def embed_size_setting(default: int) -> Any:
    return setting(default, "Joint embedding size d.", at_least=1)


def word_dim_setting(default: int) -> Any:
    return setting(default, "Word embedding size.", at_least=1)


def size_setting(default: int | None, help: str) -> Any:
    """A model's size or count setting: a whole number of at least 1 (None: the model's choice, where allowed)."""
    return setting(default, help, at_least=1)


def dropout_setting(default: float, help: str) -> Any:
    """A dropout probability, in [0, 1)."""
    return setting(default, help, at_least=0, below=1)


def word_vectors_setting() -> Any:
    """Where a model's word embeddings start (loaded by :func:`retr.trainers.models.side_inputs.add_word_vectors`)."""
    return setting("random", "Word embeddings start from: random (the model's own init), glove (GloVe 840B.300d, "
                             "downloaded on first use), glove-6b (6B.300d), or a GloVe-format .txt/.zip file; words "
                             "the vectors lack keep the random init.")


def freeze_word_vectors_setting() -> Any:
    return setting(False, "Keep the loaded word vectors fixed (default: fine-tuned, as SMAN and CVSE did).",
                   flag="--freeze-word-vectors/--fine-tune-word-vectors")
