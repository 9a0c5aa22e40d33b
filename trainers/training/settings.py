"""A run's settings: defaults, preset, settings file and explicit values merged into a
:class:`~retr.trainers.config.TrainConfig` (precedence: docs/trainer.md), or a stored run's for ``--resume``."""
from __future__ import annotations

import dataclasses
from dataclasses import asdict
from pathlib import Path
from typing import Any

from retr.common.errors import UserError, with_flags
from retr.trainers.config import TrainConfig, read_settings_file, setting_fields
from retr.trainers.models.registry import DATA_SIZES, ModelSpec
from retr.trainers.runs.layout import CONFIG


#: keys of a run's config.json that are records of the run, not settings
RUN_RECORDS = ("retr_version", "feature_attrs", "vocab_size", "train_images", "val_images_used", "model",
               "model_args", "inputs", "data_identity", "environment", "paths_from_run")


def flag_of(field: dataclasses.Field) -> str:
    """The option spelling of a settings field (its metadata ``flag`` or ``--field-name``)."""
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def flag_names(spec: ModelSpec) -> dict[str, str]:
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
        if shortcut_name(flag) in explicit and values[shortcut_name(flag)]:
            given.update(overrides)
    from_file: dict = {}
    if values.get("config"):
        try:
            from_file = read_settings_file(values["config"])
        except UserError as exc:                       # each message starts with the file's path
            raise UserError(f"--config {exc}") from None
        except OSError as exc:
            raise UserError(f"--config {values['config']}: {exc.strerror or exc}") from None
        if from_file.get("model", spec.name) != spec.name:
            raise UserError(f"--config {values['config']} is a {from_file['model']} run, not {spec.name}")
        file_inputs = from_file.get("inputs") or {}
        _, moved = spec.upgrade({k: v for k, v in from_file.items() if k in model_names | {"trees", "concepts",
                                                                                          "labels"}}, file_inputs)
        from_file = {k: v for k, v in from_file.items()
                     if k not in RUN_RECORDS and k not in DATA_SIZES and k not in ("trees", "concepts", "labels")}
        from_file.update(moved)
        unknown = sorted(set(from_file) - train_names - model_names - input_names - data_size_names(spec))
        if unknown:
            raise UserError(f"--config {values['config']}: unknown setting(s) for {spec.name}: {', '.join(unknown)}")
        from_file = {k: v for k, v in from_file.items() if k not in data_size_names(spec)}
    preset_name = spec.preset_for(given.get("preset") or from_file.get("preset"), {**from_file, **given})
    preset_values = spec.resolve_preset(preset_name)
    from_file_inputs = {k: from_file.pop(k) for k in list(from_file) if k in input_names}
    merged = {**preset_values, **from_file, **given}
    from_file.update(from_file_inputs)
    for name in ("features", "manifest", "out"):
        if not merged.get(name):
            raise UserError(f"--{name} is required (or give it in --config)")
    flags = flag_names(spec)
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
    from retr.trainers.runs import checkpoint as ckpt

    if not (Path(out) / CONFIG).is_file():
        raise UserError(f"nothing to resume in {out} (no run there); start without --resume")
    saved = ckpt.upgrade_config(ckpt.read_config(out))
    if saved.get("model") != spec.name:
        raise UserError(f"{out} is a {saved.get('model')} run; continue it with `retr-train {saved.get('model')} "
                        f"--resume --out {out}`")
    from retr.trainers.runs.resume import config_differences

    train_names = {f.name for f in setting_fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in saved.items() if k in {f.name for f in dataclasses.fields(TrainConfig)}})
    flags = flag_names(spec)
    model_names = {f.name for f in setting_fields(spec.config_class)}
    given = {k: values[k] for k in explicit if k in model_names}
    for flag, (_, overrides) in spec.shortcuts.items():
        if shortcut_name(flag) in explicit and values[shortcut_name(flag)]:
            given.update(overrides)
    # the run's folder is where it is now, wherever it started; --features/--manifest: the loop checks the data
    changes: dict[str, Any] = {"out": out}
    for name in explicit & train_names - {"out"}:
        changes[name] = tuple(values[name]) if isinstance(getattr(cfg, name), tuple) else values[name]
    asked = dataclasses.replace(cfg, model_args={**cfg.model_args, **given}, **changes)
    differences = [f"{flags.get(d.name, d.name)} {d.given} (run: {d.stored})" for d in config_differences(asked, saved)]
    differences += [f"{flags.get(i.name, i.name)} {values[i.name]} (run: {cfg.inputs.get(i.name)})"
                    for i in spec.inputs if i.name in explicit and not _same_path(values[i.name], cfg.inputs.get(i.name))]
    if differences:
        raise UserError(f"{out} cannot change on resume: {'; '.join(differences)}; resume with the run's settings "
                        "(leave those options out) or choose another --out")
    return asked


def _same_path(a: str | None, b: str | None) -> bool:
    return bool(a) and bool(b) and Path(a).resolve() == Path(b).resolve()


def data_size_names(spec: ModelSpec) -> set[str]:
    """Constructor arguments that follow from the data (sizes), besides ``vocab_size``/``img_dim``."""
    import inspect

    params = inspect.signature(spec.model_class.__init__).parameters
    return {n for n, p in params.items() if n not in ("self", "config", "settings") and p.kind is p.POSITIONAL_OR_KEYWORD}


def shortcut_name(flag: str) -> str:
    return "shortcut_" + flag.lstrip("-").replace("-", "_")
