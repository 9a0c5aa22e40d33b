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
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from retr.common.cli import InputPath, quiet_option
from retr.common.errors import UserError
from retr.manifests.schema import read_manifest
from retr.trainers.commands.options import no_verify_option
from retr.trainers.config import (TrainConfig, choices_of, field_types, flag_of, setting_fields, settings_for_resume,
                                  settings_from_options, shortcut_name)
from retr.trainers.evaluation.metrics import PROTOCOLS, protocols_for
from retr.trainers.evaluation.reports import report_after_training
from retr.trainers.models.registry import ModelSpec
from retr.trainers.runs.checkpoint import holds_run, read_settings
from retr.trainers.runs.layout import CONFIG
from retr.trainers.training import loop
from retr.trainers.training.preflight import check_feature_rows, check_training

_EXPLICIT = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT, ParameterSource.PROMPT)


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
    params += [click.Option(["--" + i.name.replace("_", "-"), i.name],
                            type=InputPath("file", i.what, takes=set(i.resources).__contains__ if i.resources
                                           else None),
                            default=None, help=i.help + (" (required)" if i.required else ""))
               for i in spec.inputs]
    params += settings_options(spec.config_class, shown)
    params += [click.Option([flag, shortcut_name(flag)], is_flag=True, default=False, help=help_text)
               for flag, (help_text, _) in spec.shortcuts.items()]
    params += [click.Option(["--config"], type=InputPath("file", "a JSON or YAML settings file"), default=None,
                            help="Settings from a JSON/YAML file or a run's config.json (options override it)."),
               click.Option(["--allow-nonempty-out"], is_flag=True,
                            help="Train into a non-empty --out that holds no run (refused otherwise: the run's files "
                                 "would lie among others)."),
               click.Option(["--resume"], is_flag=True,
                            help="Continue the run in --out from its newest checkpoint, with its own settings "
                                 "(--out is enough; --epochs, --device, --workers … may change, other options "
                                 "must equal the run's)."),
               click.Option(["--trust-checkpoint"], is_flag=True,
                            help="With --resume: read a checkpoint that holds Python objects besides tensors (they "
                                 "can run code: only for files you trust).")]
    params.extend(_params_of(no_verify_option, quiet_option))

    def callback(**values) -> None:
        ctx = click.get_current_context()
        explicit = {name for name in values if ctx.get_parameter_source(name) in _EXPLICIT}
        for settings_class in (TrainConfig, spec.config_class):
            apply_aliases(settings_class, values, explicit)
        out = Path(values["out"]) if values.get("out") else None
        if values["resume"] and out is not None and not (out / CONFIG).is_file():
            if out.exists() and not out.is_dir():
                raise UserError(f"--resume --out {out}: {out} is a file, not a run folder")
            if not values.get("features") and not values.get("config"):
                raise UserError(f"nothing to resume in {out}: no run there (no {CONFIG}); start the run without "
                                "--resume (with --features and --manifest)")
            # a requeued job always passes --resume with its whole command: a run killed before it wrote
            # config.json starts now
            cfg = settings_from_options(spec, values, explicit)
            click.echo(f"note: nothing to resume in {out} (it stopped before its settings were written); "
                       "starting the run", err=True)
            values["resume"] = False
        elif values["resume"]:
            cfg = settings_for_resume(spec, stored_run(spec, values), values, explicit)
        else:
            cfg = settings_from_options(spec, values, explicit)
        if not values["resume"] and holds_run(cfg.out):
            raise UserError(f"{cfg.out} already holds a run; pass --resume to continue it or choose another --out")
        notes = tuple(f"note: {note}" for note in check_training(cfg, resume=values["resume"],
                                                                  allow_nonempty_out=values["allow_nonempty_out"]))
        if not values["no_verify"]:
            check_feature_rows(cfg.features, quiet=values["quiet"])
        if not values["resume"] and "preset" not in explicit and not values.get("config") and cfg.preset:
            notes += (f"note: no --preset given: starting from {cfg.preset}'s published settings "
                      f"(presets: {', '.join(spec.presets)}); options given override them",)
        loop.train(cfg, resume=values["resume"], quiet=values["quiet"], trust_checkpoint=values["trust_checkpoint"],
              notes=notes)
        report_after_training(spec, cfg.out, cfg)
        click.echo(f"run written to {cfg.out} (evaluate: {evaluate_hint(cfg)})")

    return click.Command(spec.name, params=params, callback=callback, help=_help(spec),
                         short_help=spec.summary.split(". ")[0].rstrip("."))


def stored_run(spec: ModelSpec, values: dict) -> TrainConfig:
    """``--resume``: the settings of the run in ``--out`` (its ``config.json``; ``--out`` is all it needs), refused
    in one line when there is none, when ``--config`` is given too, or when it is another model's."""
    out = values.get("out")
    if not out:
        raise UserError("--resume needs --out (the run to continue)")
    if values.get("config"):
        raise UserError("--resume continues from the run's own config.json; leave out --config")
    if not (Path(out) / CONFIG).is_file():
        raise UserError(f"nothing to resume in {out} (no run there); start without --resume")
    stored = read_settings(out)
    if stored.model != spec.name:
        raise UserError(f"{out} is a {stored.model} run; continue it with `retr-train {stored.model} --resume --out "
                        f"{out}`")
    return stored


def evaluate_hint(cfg: TrainConfig) -> str:
    """The ``retr-train eval`` command for a finished run, with the protocol(s) its test split's size fits."""
    num_images = len(read_manifest(cfg.manifest, splits=["test"]))
    fitting = protocols_for(num_images)
    if fitting:
        return " or ".join(f"retr-train eval {cfg.out} --protocol {p}" for p in fitting if p != "coco-1k-first")
    return (f"retr-train eval {cfg.out} --protocol {'|'.join(PROTOCOLS)} --allow-size-mismatch (the test split has "
            f"{num_images} images, no protocol's size)")


def _params_of(*decorators) -> list[click.Parameter]:
    """The options shared decorators add (``--no-verify``; ``--quiet`` and ``-v``: :func:`retr.common.cli.quiet_option`)
    as parameter objects."""
    def holder() -> None:
        """placeholder"""
    for decorator in reversed(decorators):
        holder = decorator(holder)
    return click.command()(holder).params
