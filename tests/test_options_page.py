"""docs/options.md: every command's options with their help, made by ``tools/options_page.py``, kept equal to what
the code makes and to each command's ``--help`` (so a generated flag such as ``--lambda-softmax`` is found by
searching the repository, with the field that defines it)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from click.testing import CliRunner

from retr.common.cli import command_help_records
from retr.pipeline.commands import cli as pipeline
from retr.trainers.commands import cli as trainer

ROOT = Path(__file__).resolve().parents[1]
GROUPS = {"retr-pipeline": pipeline, "retr-train": trainer}
COMMANDS = [(program, command_line) for program, group in GROUPS.items()
            for _, command_line, _, _ in command_help_records(group, program)]


def _tool():
    spec = importlib.util.spec_from_file_location("options_page", ROOT / "tools" / "options_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_is_what_the_tool_makes_now():
    page = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")
    assert page == _tool().page(), "docs/options.md is stale: run `make options-page`"


def test_a_generated_flag_is_found_with_the_field_that_defines_it():
    page = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")
    row = next(line for line in page.splitlines() if line.startswith("| `--lambda-softmax"))
    assert "`SCANConfig.lambda_softmax` (`trainers/models/scan.py`)" in row
    assert len(COMMANDS) > 40 and ("retr-train", "retr-train scan") in COMMANDS


@pytest.mark.parametrize("program, command_line", COMMANDS, ids=[c for _, c in COMMANDS])
def test_each_command_row_is_what_its_help_prints(program, command_line):
    """The options the page lists for a command, in order with their help, are exactly those its ``--help`` prints
    (the two compared with their whitespace collapsed: ``--help`` wraps and aligns)."""
    page = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")
    section = page.split(f"## `{command_line}`\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split(" | ")[:2] for line in section.splitlines() if line.startswith("| `")]
    listed = " ".join(f"{flags.strip(' `')} {text.strip()}".strip().replace("\\|", "|") for flags, text in rows)
    result = CliRunner().invoke(GROUPS[program], [*command_line.split()[1:], "--help"], terminal_width=10_000,
                                max_content_width=10_000)
    assert result.exit_code == 0, result.output
    printed = " ".join(result.output.split("\nOptions:\n", 1)[1].split())
    assert listed == printed, command_line
