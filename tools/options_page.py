"""Write docs/options.md: every option of every ``retr-pipeline`` and ``retr-train`` command with its help, as
``COMMAND --help`` prints it, and — for the options a training command generates from a settings dataclass — the
field that defines it, so searching the repository for a flag finds where it comes from.

Run it after changing a command or a setting (``make options-page``); ``tests/test_options_page.py`` fails while the
page differs from what this writes or from the commands' ``--help``.
"""
from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path

from retr.common.cli import command_help_records
from retr.pipeline.commands import cli as pipeline
from retr.trainers.commands import cli as trainer
from retr.trainers.config import TrainConfig, shortcut_name
from retr.trainers.models import get_spec, list_models

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "options.md"

INTRO = """Every option of every command, with its help, as `COMMAND --help` prints it (defaults in brackets). Made from
the code by `tools/options_page.py` (`make options-page`); `tests/test_options_page.py` fails when this page differs
from the commands' `--help`.

The training commands (`retr-train MODEL`) generate most of their options from settings dataclasses, so the flag
itself is written nowhere in the code: the last column names the field that defines each (`SCANConfig.lambda_softmax`
is `--lambda-softmax`; its name, type, default, bounds and help are that field's). How a setting travels from its
option to the model: [trainer.md](trainer.md#adding-a-model-one-module-with-its-spec)."""


def _file(obj) -> str:
    return str(Path(inspect.getsourcefile(obj)).resolve().relative_to(ROOT))


def field_sources(model: str) -> dict[str, str]:
    """Parameter name → where the option ``retr-train MODEL`` generates for it is defined."""
    spec = get_spec(model)
    sources = {f.name: f"`TrainConfig.{f.name}` (`{_file(TrainConfig)}`)" for f in dataclasses.fields(TrainConfig)}
    config = spec.config_class
    sources.update({f.name: f"`{config.__name__}.{f.name}` (`{_file(config)}`)" for f in dataclasses.fields(config)})
    module = _file(spec.model_class)
    sources.update({i.name: f"the spec's `inputs` (`{module}`)" for i in spec.inputs})
    sources.update({shortcut_name(flag): f"the spec's `shortcuts` (`{module}`)" for flag in spec.shortcuts})
    return sources


def _cell(text: str) -> str:
    """``text`` in one Markdown table cell: on one line, its pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def page() -> str:
    lines = ["# Command options", "", INTRO, ""]
    models = set(list_models())
    for program, group in (("retr-pipeline", pipeline), ("retr-train", trainer)):
        for command, name, usage, records in command_help_records(group, program):
            model = name.split()[-1] if program == "retr-train" and name.split()[-1] in models else None
            lines += [f"## `{name}`", "", f"`{usage}`", ""]
            if model is None:
                lines += [f"Declared in `{_file(inspect.unwrap(command.callback))}`.", "",
                          "| option | what it does |", "| --- | --- |"]
                lines += [f"| `{flags}` | {_cell(text)} |" for _, flags, text in records]
            else:
                sources = field_sources(model)
                lines += ["| option | what it does | defined by |", "| --- | --- | --- |"]
                lines += [f"| `{flags}` | {_cell(text)} | {sources.get(param.name, '`trainers/commands/train.py`')} |"
                          for param, flags, text in records]
            lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    text = page()
    if sys.argv[1:] == ["--check"]:
        sys.exit(0 if PAGE.read_text(encoding="utf-8") == text else f"{PAGE} is stale: run make options-page")
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")
