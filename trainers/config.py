"""Settings as dataclasses: the one definition of every training and model setting.

A setting is a dataclass field made with :func:`setting`: its name, type annotation, default and help are the
only place it is defined. The training command (:mod:`retr.trainers.commands.train`) builds its options from
these fields, ``config.json`` stores them, and presets (:class:`~retr.trainers.models.registry.ModelSpec`) are
named overrides of them.

* :class:`TrainConfig` — what every run has: data, schedule, device, logging (one per run);
* each model module's config dataclass (``SCANConfig``, …) — that model's own settings.

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
import json
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from retr.common.errors import UserError
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


@dataclass
class TrainConfig:
    """Everything a training run depends on besides the model's own settings (stored in ``config.json``).

    ``model_args`` holds the model's settings (its config dataclass as a dict) plus the sizes that follow
    from the data (``vocab_size``, ``img_dim``, and e.g. SMFEA's dictionary sizes); ``inputs`` the side files
    the model's spec reads into tensors (``{"trees": path, …}``).
    """

    model: str = setting("", cli=False)
    model_args: dict = setting(default_factory=dict, cli=False)
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
        self.preload = preload_choice(self.preload)
        validate_settings(self)
        if self.batch_size % self.accum_steps:
            raise ValueError(f"accum_steps {self.accum_steps} must divide batch_size {self.batch_size}")


#: the settings ``--resume`` applies (the fields marked ``resume_applies``)
RESUME_APPLIES = tuple(f.name for f in fields(TrainConfig) if f.metadata.get("resume_applies"))

#: the schedule settings a model's preset may set besides the model's own
SCHEDULE_KEYS = ("epochs", "batch_size", "lr", "lr_update", "grad_clip", "early_stop", "warmup_epochs", "drop_last")


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
    number lies outside its ``at_least``/``below`` bounds (a size of 0, a dropout of 1)."""
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


def make_config(cls: type, values: dict | None = None, **more: Any):
    """``cls(**values, **more)`` with unknown names refused by name (``ValueError``) and choices checked."""
    values = {**(values or {}), **more}
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown setting(s) for {cls.__name__}: {', '.join(unknown)}")
    config = cls(**values)
    validate_settings(config)
    return config


def read_settings_file(path: str | Path) -> dict:
    """Settings from a JSON or YAML file: a flat ``{setting: value}`` mapping, or a run's ``config.json``
    (its ``model_args`` are flattened in; sizes that follow from the data are dropped by the caller). A file that
    is absent, a folder, not UTF-8 text or does not parse is a :class:`UserError` in one line starting with the
    path (a parse error: its line and column)."""
    from retr.common.textfiles import read_utf8

    path = Path(path)
    yaml_file = path.suffix.lower() in (".yaml", ".yml")
    text = read_utf8(path, f"a settings file ({'YAML' if yaml_file else 'JSON'})")
    if yaml_file:
        import yaml

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
