"""trainers/config.py: one typed route from a setting's option to the code that uses it.

A model setting is made into its model's config dataclass once, by :func:`~retr.trainers.config.settings_from_options`,
inside the run's :class:`~retr.trainers.config.TrainConfig`; the model is built from that very object and reads
it where it uses the value. The route is recorded here, call by call, while ``retr-train scan --lambda-softmax``
trains (docs/trainer.md, "Adding a model", walks the same route by hand).
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from click.testing import CliRunner

import retr
from retr.trainers.commands import cli
from retr.trainers.config import Settings, TrainConfig, settings_from_stored, upgrade_stored
from retr.trainers.models import get_spec

#: the folder every retr module lies under (the frames of click, torch and generated code are not retr's)
ROOT = Path(retr.__file__).resolve().parents[1]
#: a value no preset or default has, so wherever it is found it came from the option
VALUE = 7.25


def _holds(value, name: str) -> bool:
    """Whether ``value``, bound to the parameter ``name``, carries the setting: it is the value itself, a mapping
    holding it, or a settings dataclass holding it (the model's config, or the run's TrainConfig with the model's
    config inside). A model holding it in ``self.config`` is not a carrier: it is where the setting is used."""
    if name == "lambda_softmax" and isinstance(value, float) and value == VALUE:
        return True
    if isinstance(value, Mapping):
        return value.get("lambda_softmax") == VALUE
    if isinstance(value, Settings):
        inner = value.model_config if isinstance(value, TrainConfig) else value
        return getattr(inner, "lambda_softmax", None) == VALUE
    return False


def _arguments(frame) -> dict:
    """The arguments a frame was called with (its first locals) and, for a closure, the names it takes from the
    function around it; ``self`` left out."""
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)
    names = [*code.co_varnames[:count], *code.co_freevars]
    return {n: frame.f_locals[n] for n in names if n in frame.f_locals and n != "self"}


def _carries(frame) -> bool:
    return any(_holds(v, n) for n, v in _arguments(frame).items())


def _where(frame) -> tuple[str, str] | None:
    """``(file relative to the repository, function)`` of a retr frame, None for any other frame."""
    path = Path(frame.f_code.co_filename)
    if not path.is_absolute() or ROOT not in path.resolve().parents:
        return None
    return str(path.resolve().relative_to(ROOT)), frame.f_code.co_name


def _leg(frame, include_reader: bool = False) -> list[tuple[str, str]]:
    """The retr frames from the outermost one that still carries the setting in its arguments down to ``frame``
    (which is part of the leg whatever it holds); with ``include_reader`` the first frame outward that does not
    carry it is kept too — the model's method that reads it from ``self.config``. Generated code (a dataclass's
    ``__init__``) is passed through."""
    leg = []
    current = frame
    while current is not None:
        where = _where(current)
        if current is not frame and where is not None and not _carries(current):
            if include_reader and "self" in current.f_locals and \
                    getattr(getattr(current.f_locals["self"], "config", None), "lambda_softmax", None) == VALUE:
                leg.append(where)
            break
        if where is not None:
            leg.append(where)
        current = current.f_back
    return leg[::-1]


def _from_the_command(leg: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``leg`` from the training command's callback on: click parses the option and hands its value, through the
    command layer's error wording (``common/cli.py``), to the callback untouched — where the command receives it
    is where the route starts."""
    starts = [n for n, (file, function) in enumerate(leg)
              if file == "trainers/commands/train.py" and function == "callback"]
    return leg[starts[0]:] if starts else leg


def _stays(route: list[tuple[str, str]]) -> list[str]:
    """The files of ``route`` with consecutive frames in one file counted once: where the setting stays."""
    stays: list[str] = []
    for file, _ in route:
        if not stays or stays[-1] != file:
            stays.append(file)
    return stays


def test_a_model_setting_goes_from_its_option_to_its_use_in_a_few_stays(synthetic_data, tmp_path):
    """``--lambda-softmax`` → the merge (SCANConfig made once, validated once) → the command hands the run's
    TrainConfig to the loop → the loop builds SCAN from that very config object → SCAN reads
    ``self.config.lambda_softmax`` where its attention uses it: at most 6 stays in at most 4 files, no copy of the
    config on the way (no ``asdict`` round trip)."""
    manifest, features = synthetic_data(images=40)
    made: list = []                            # (SCANConfig made, the leg that made it)
    built: list = []                           # (the config SCAN was built from, the leg that built it)
    used: list = []                            # the leg from SCAN's method to the multiplication

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code.co_name == "__post_init__" and isinstance(frame.f_locals.get("self"), Settings) and \
                getattr(frame.f_locals["self"], "lambda_softmax", None) == VALUE:
            made.append((frame.f_locals["self"], _leg(frame)))
        elif code.co_name == "__init__" and type(frame.f_locals.get("self")).__name__ == "SCAN" and \
                _holds(frame.f_locals.get("config"), "config"):
            built.append((frame.f_locals["config"], _leg(frame)))
        elif code.co_name == "_attention" and frame.f_locals.get("lambda_softmax") == VALUE and not used:
            used.append(_leg(frame, include_reader=True))
            sys.setprofile(None)               # the route ends at the first use: the rest of the run unwatched

    args = ["scan", "--features", str(features), "--manifest", str(manifest), "--out", str(tmp_path / "run"),
            "--train-split", "train", "--val-images", "8", "--epochs", "1", "--batch-size", "16",
            "--embed-size", "8", "--word-dim", "8", "--lambda-softmax", str(VALUE), "--device", "cpu", "--quiet",
            "--no-verify"]
    sys.setprofile(profile)
    try:
        result = CliRunner().invoke(cli, args)
    finally:
        sys.setprofile(None)
    assert result.exit_code == 0, result.output

    assert len(made) == 1, "SCANConfig is made (and validated) once"
    assert len(built) == 1 and built[0][0] is made[0][0], "SCAN is built from the very object the merge made"
    assert used, "the attention never ran with the option's value"
    route = _from_the_command(made[0][1]) + _from_the_command(built[0][1]) + used[0]
    stays = _stays(route)
    assert stays == ["trainers/commands/train.py", "trainers/config.py", "trainers/commands/train.py",
                     "trainers/training/loop.py", "trainers/models/scan.py"], route
    assert len(stays) <= 6 and len(set(stays)) <= 4
    functions = [function for _, function in route]
    assert functions[:2] == ["callback", "settings_from_options"] and functions[-1] == "_attention", route
    assert {"build_model", "__init__", "_cross_attention"} <= set(functions), route
    assert "asdict" not in functions


def test_a_stored_run_reads_back_as_the_settings_it_was_written_from():
    """``config.json``'s layout (model settings and data sizes together as ``model_args``) read back gives the same
    settings, the model's config as its dataclass again."""
    spec = get_spec("scan")
    cfg = TrainConfig(model="scan", model_config=spec.config_class(lambda_softmax=VALUE, agg="avg"),
                      sizes={"vocab_size": 11, "img_dim": 16}, features="f.h5", manifest="m.jsonl", out="runs/x",
                      train_splits=("train",), log=("tensorboard",))
    stored = cfg.as_stored()
    assert "model_config" not in stored and "sizes" not in stored
    assert stored["model_args"]["lambda_softmax"] == VALUE and stored["model_args"]["vocab_size"] == 11
    assert settings_from_stored(spec, stored) == cfg
    assert upgrade_stored(spec, upgrade_stored(spec, stored)) == upgrade_stored(spec, stored)
