"""``retr-train MODEL``: one training command per registered model, generated from its spec.

The options are the fields of :class:`~retr.trainers.config.TrainConfig` (data, schedule, device, logging), the
spec's side files (``--trees``, ``--labels`` …), the fields of the model's config dataclass and the spec's
shortcut flags; each option's type, default and help come from its field. A value is taken from, lowest first:

1. the config dataclass's default;
2. the preset (``--preset``, else the settings file's, else the model's default preset);
3. the settings file (``--config``: a flat JSON/YAML mapping, or a run's ``config.json``);
4. the options given on the command line.

So ``retr-train scan --config runs/a/config.json --out runs/b --lr 1e-4`` repeats run ``a`` with one change.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from retr.common.cli import quiet_option, with_flags
from retr.common.errors import UserError
from retr.trainers.training.checkpoint import CONFIG
from retr.trainers.config import (TrainConfig, choices_of, field_types, read_settings_file,
                                   setting_fields)
from retr.trainers.models.registry import DATA_SIZES, ModelSpec

#: keys of a run's config.json that are records of the run, not settings
RUN_RECORDS = ("retr_version", "feature_attrs", "vocab_size", "train_images", "val_images_used", "model",
               "model_args", "inputs", "data_identity", "environment", "paths_from_run")
_EXPLICIT = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT, ParameterSource.PROMPT)


def flag_of(field: dataclasses.Field) -> str:
    """The option spelling of a settings field (its metadata ``flag`` or ``--field-name``)."""
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def _base_type(annotation: Any) -> Any:
    """``X | None`` → ``X``; other annotations unchanged."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return annotation


def option_for(field: dataclasses.Field, annotation: Any, shown: dict | None = None) -> click.Option:
    """A click option for one settings field (type, default and help from the field). ``shown`` overrides the
    default displayed in ``--help`` (the default preset's value); what counts is only whether an option was
    given, so the displayed default never overrides a preset or a settings file."""
    flag = flag_of(field)
    default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    if shown and field.name in shown:
        default = shown[field.name]
    help_text = field.metadata.get("help", "")
    base = _base_type(annotation)
    choices = choices_of(annotation)
    if base is bool:
        if "/" in flag:       # an on/off pair; None (unset) shows no default
            return click.Option([flag, field.name], default=default, help=help_text, show_default=default is not None)
        return click.Option([flag, field.name], is_flag=True, default=bool(default), help=help_text)
    if typing.get_origin(base) is tuple:
        return click.Option([flag, field.name], multiple=True, default=default, show_default=True, help=help_text)
    kind = click.Choice([str(c) for c in choices]) if choices else {int: int, float: float}.get(base, str)
    if field.metadata.get("flag_value") is not None:        # an option whose value may be left out
        return click.Option([flag, field.name], type=kind, default=default, show_default=default is not None,
                            help=help_text, is_flag=False, flag_value=field.metadata["flag_value"])
    return click.Option([flag, field.name], type=kind, default=default, show_default=default is not None,
                        help=help_text)


def settings_options(cls: type, shown: dict | None = None) -> list[click.Option]:
    types = field_types(cls)
    return [option_for(f, types[f.name], shown) for f in setting_fields(cls)] + alias_options(cls)


def _alias_name(field: str, flag: str) -> str:
    return f"alias_{field}_{flag.lstrip('-').replace('-', '_')}"


def alias_options(cls: type) -> list[click.Option]:
    """Hidden flags for the older spellings of settings (metadata ``aliases``), e.g. ``--no-preload``."""
    return [click.Option([flag, _alias_name(f.name, flag)], is_flag=True, default=False, hidden=True)
            for f in setting_fields(cls) for flag in f.metadata.get("aliases", {})]


def apply_aliases(cls: type, values: dict, explicit: set[str]) -> None:
    """An alias flag given sets its setting's value, as if the setting had been given (in place)."""
    for f in setting_fields(cls):
        for flag, value in f.metadata.get("aliases", {}).items():
            name = _alias_name(f.name, flag)
            if values.pop(name, False):
                values[f.name] = value
                explicit.add(f.name)
            explicit.discard(name)


def _flag_names(spec: ModelSpec) -> dict[str, str]:
    """Setting name → flag, for error messages."""
    fields = [*setting_fields(TrainConfig), *setting_fields(spec.config_class)]
    names = {f.name: flag_of(f).split("/")[0] for f in fields}
    names.update({i.name: "--" + i.name.replace("_", "-") for i in spec.inputs})
    return names


def evaluate_hint(cfg: TrainConfig) -> str:
    """The ``retr-train eval`` command for a finished run, with the protocol(s) its test split's size fits."""
    from retr.manifests.schema import read_manifest
    from retr.trainers.evaluation.metrics import PROTOCOLS, protocols_for

    num_images = len(read_manifest(cfg.manifest, splits=["test"]))
    fitting = protocols_for(num_images)
    if fitting:
        return " or ".join(f"retr-train eval {cfg.out} --protocol {p}" for p in fitting if p != "coco-1k-first")
    return (f"retr-train eval {cfg.out} --protocol {'|'.join(PROTOCOLS)} --allow-size-mismatch (the test split has "
            f"{num_images} images, no protocol's size)")


def gather_settings(spec: ModelSpec, values: dict, explicit: set[str]) -> tuple[TrainConfig, dict]:
    """Merge defaults, preset, settings file and explicit options into a :class:`TrainConfig` (whose
    ``model_args`` is the model's full config) and the side files ``{input name: path}``."""
    train_names = {f.name for f in setting_fields(TrainConfig)}
    model_names = {f.name for f in dataclasses.fields(spec.config_class)}
    input_names = {i.name for i in spec.inputs}
    cli_model_names = {f.name for f in setting_fields(spec.config_class)}
    given = {k: values[k] for k in explicit if k in train_names | cli_model_names}
    given_inputs = {k: values[k] for k in explicit if k in input_names}
    for flag, (_, overrides) in spec.shortcuts.items():
        if _shortcut_name(flag) in explicit and values[_shortcut_name(flag)]:
            given.update(overrides)
    from_file: dict = {}
    if values.get("config"):
        try:
            from_file = read_settings_file(values["config"])
        except (OSError, ValueError) as exc:
            raise UserError(f"--config: {exc}") from None
        if from_file.get("model", spec.name) != spec.name:
            raise UserError(f"--config {values['config']} is a {from_file['model']} run, not {spec.name}")
        file_inputs = from_file.get("inputs") or {}
        _, moved = spec.upgrade({k: v for k, v in from_file.items() if k in model_names | {"trees", "concepts",
                                                                                          "labels"}}, file_inputs)
        from_file = {k: v for k, v in from_file.items()
                     if k not in RUN_RECORDS and k not in DATA_SIZES and k not in ("trees", "concepts", "labels")}
        from_file.update(moved)
        unknown = sorted(set(from_file) - train_names - model_names - input_names - _data_size_names(spec))
        if unknown:
            raise UserError(f"--config {values['config']}: unknown setting(s) for {spec.name}: {', '.join(unknown)}")
        from_file = {k: v for k, v in from_file.items() if k not in _data_size_names(spec)}
    preset_name = spec.preset_for(given.get("preset") or from_file.get("preset"), {**from_file, **given})
    preset_values = spec.resolve_preset(preset_name)
    from_file_inputs = {k: from_file.pop(k) for k in list(from_file) if k in input_names}
    merged = {**preset_values, **from_file, **given}
    from_file.update(from_file_inputs)
    for name in ("features", "manifest", "out"):
        if not merged.get(name):
            raise UserError(f"--{name} is required (or give it in --config)")
    flags = _flag_names(spec)
    try:
        model_config = spec.make_config({k: v for k, v in merged.items() if k in model_names})
        train_values = {k: v for k, v in merged.items() if k in train_names}
        cfg = TrainConfig(model=spec.name, model_args=asdict(model_config),
                          **{**train_values, "preset": preset_name})
    except ValueError as exc:
        raise UserError(with_flags(str(exc), flags, flags)) from None
    inputs = {k: v for k, v in {**{k: from_file.get(k) for k in input_names}, **given_inputs}.items() if v}
    missing = [i.name for i in spec.inputs if i.required and i.name not in inputs]
    if missing:
        raise UserError(f"{spec.name} needs --{missing[0].replace('_', '-')}")
    cfg.inputs = inputs
    if cfg.epochs < 1 or cfg.batch_size < 2:
        raise UserError("--epochs must be ≥ 1 and --batch-size ≥ 2")
    return cfg, inputs


def resume_settings(spec: ModelSpec, values: dict, explicit: set[str]) -> TrainConfig:
    """``--resume``: the run's own settings (its ``config.json``; ``--out`` is all it needs), with the options
    given now applied where a resume may change them (``resume_applies`` settings, and ``--features`` /
    ``--manifest`` that the loop checks hold the same data). Any other option given must equal the run's, else
    one line names each difference."""
    out = values.get("out")
    if not out:
        raise UserError("--resume needs --out (the run to continue)")
    if values.get("config"):
        raise UserError("--resume continues from the run's own config.json; leave out --config")
    from retr.trainers.training import checkpoint as ckpt

    if not (Path(out) / ckpt.CONFIG).is_file():
        raise UserError(f"nothing to resume in {out} (no run there); start without --resume")
    saved = ckpt.upgrade_config(ckpt.read_config(out))
    if saved.get("model") != spec.name:
        raise UserError(f"{out} is a {saved.get('model')} run; continue it with `retr-train {saved.get('model')} "
                        f"--resume --out {out}`")
    from retr.trainers.training.loop import config_differences

    train_names = {f.name for f in setting_fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in saved.items() if k in {f.name for f in dataclasses.fields(TrainConfig)}})
    flags = _flag_names(spec)
    model_names = {f.name for f in setting_fields(spec.config_class)}
    given = {k: values[k] for k in explicit if k in model_names}
    for flag, (_, overrides) in spec.shortcuts.items():
        if _shortcut_name(flag) in explicit and values[_shortcut_name(flag)]:
            given.update(overrides)
    # the run's folder is where it is now, wherever it started; --features/--manifest: the loop checks the data
    changes: dict[str, Any] = {"out": out}
    for name in explicit & train_names - {"out"}:
        changes[name] = tuple(values[name]) if isinstance(getattr(cfg, name), tuple) else values[name]
    asked = dataclasses.replace(cfg, model_args={**cfg.model_args, **given}, **changes)
    differences = [with_flags(d, flags, flags) for d in config_differences(asked, saved)]
    differences += [f"{flags.get(i.name, i.name)} {values[i.name]} (run: {cfg.inputs.get(i.name)})"
                    for i in spec.inputs if i.name in explicit and not _same_path(values[i.name], cfg.inputs.get(i.name))]
    if differences:
        raise UserError(f"{out} cannot change on resume: {'; '.join(differences)}; resume with the run's settings "
                        "(leave those options out) or choose another --out")
    return asked


def _same_path(a: str | None, b: str | None) -> bool:
    return bool(a) and bool(b) and Path(a).resolve() == Path(b).resolve()


def _data_size_names(spec: ModelSpec) -> set[str]:
    """Constructor arguments that follow from the data (sizes), besides ``vocab_size``/``img_dim``."""
    import inspect

    params = inspect.signature(spec.model_class.__init__).parameters
    return {n for n, p in params.items() if n not in ("self", "config", "settings") and p.kind is p.POSITIONAL_OR_KEYWORD}


def _shortcut_name(flag: str) -> str:
    return "shortcut_" + flag.lstrip("-").replace("-", "_")


def _help(spec: ModelSpec) -> str:
    lines = [spec.summary, ""]
    if spec.presets:
        lines.append(f"Presets (--preset; default {spec.default_preset}, whose values the defaults below show): "
                     + ", ".join(spec.presets) + ".")
        lines.append("")
    if spec.examples:
        lines += ["\b", "Example:", *("  " + e for e in spec.examples)]
    return "\n".join(lines)


def training_command(spec: ModelSpec) -> click.Command:
    """``retr-train NAME``, built from ``spec`` (see the module docstring)."""
    params: list[click.Parameter] = []
    shown = spec.resolve_preset(spec.default_preset, {})
    for option in settings_options(TrainConfig, shown):
        if option.name == "preset":
            option.type = click.Choice(list(spec.presets)) if spec.presets else option.type
        params.append(option)
    for name in ("features", "manifest", "out"):
        next(p for p in params if p.name == name).show_default = False
    params += [click.Option(["--" + i.name.replace("_", "-"), i.name], type=click.Path(dir_okay=False),
                            default=None, help=i.help + (" (required)" if i.required else ""))
               for i in spec.inputs]
    params += settings_options(spec.config_class, shown)
    params += [click.Option([flag, _shortcut_name(flag)], is_flag=True, default=False, help=help_text)
               for flag, (help_text, _) in spec.shortcuts.items()]
    params += [click.Option(["--config"], type=click.Path(dir_okay=False), default=None,
                            help="Settings from a JSON/YAML file or a run's config.json (options override it)."),
               click.Option(["--resume"], is_flag=True,
                            help="Continue the run in --out from its newest checkpoint, with its own settings "
                                 "(--out is enough; --epochs, --device, --workers … may change, other options "
                                 "must equal the run's)."),
               click.Option(["--trust-checkpoint"], is_flag=True,
                            help="With --resume: read a checkpoint that holds Python objects besides tensors (they "
                                 "can run code: only for files you trust).")]
    params.append(_quiet_param())

    def callback(**values) -> None:
        from retr.trainers.training.loop import train

        ctx = click.get_current_context()
        explicit = {name for name in values if ctx.get_parameter_source(name) in _EXPLICIT}
        for settings_class in (TrainConfig, spec.config_class):
            apply_aliases(settings_class, values, explicit)
        out = Path(values["out"]) if values.get("out") else None
        if values["resume"] and out is not None and not out.is_file() and not (out / CONFIG).is_file():
            # a requeued job always passes --resume: a run killed before it wrote config.json starts now
            cfg, _ = gather_settings(spec, values, explicit)
            click.echo(f"note: nothing to resume in {out} (it stopped before its settings were written); "
                       "starting the run", err=True)
            values["resume"] = False
        elif values["resume"]:
            cfg = resume_settings(spec, values, explicit)
        else:
            cfg, _ = gather_settings(spec, values, explicit)
        pending = []
        if not values["resume"] and "preset" not in explicit and not values.get("config") and cfg.preset:
            pending.append(f"note: no --preset given: starting from {cfg.preset}'s published settings "
                           f"(presets: {', '.join(spec.presets)}); options given override them")

        def log(message: str) -> None:
            if pending and message.startswith("training "):     # once the run has started, not before an error
                click.echo(pending.pop(), err=True)
            click.echo(message, err=True)
        train(cfg, resume=values["resume"], quiet=values["quiet"], log=log, trust_checkpoint=values["trust_checkpoint"])
        if spec.after_training is not None:
            spec.after_training(cfg.out, cfg, log)
        click.echo(f"run written to {cfg.out} (evaluate: {evaluate_hint(cfg)})")

    return click.Command(spec.name, params=params, callback=callback, help=_help(spec),
                         short_help=spec.summary.split(". ")[0].rstrip("."))


def _quiet_param() -> click.Parameter:
    """The shared ``--quiet`` option (:func:`retr.common.cli.quiet_option`) as a parameter object."""
    def holder() -> None:
        """placeholder"""
    return click.command()(quiet_option(holder)).params[-1]
