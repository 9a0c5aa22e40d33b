"""Packaging and CLI conventions: every subpackage is installed, every command documents an example."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[1]


def discovered_packages() -> list[str]:
    """setup.py's package discovery (loaded without running setup())."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("retr_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.discovered_packages()


def test_package_discovery_finds_every_subpackage_under_the_retr_namespace():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "packages" not in config, "packages are discovered by setup.py, not listed"
    found = discovered_packages()
    assert {"retr", "retr.trainers.runs", "retr.trainers.data", "retr.extractors.butd",
            "retr.pipeline.commands"} <= set(found)
    # every folder under a mapped folder, and nothing else: the ones with an __init__.py, and the folders of data
    # files the package data names (which setuptools warns about when they are left out)
    inits = {".".join((package, *init.parent.relative_to(ROOT / folder).parts))
             for package, folder in config["package-dir"].items() for init in (ROOT / folder).rglob("__init__.py")}
    assert inits <= set(found)
    assert set(found) - inits == set(config["package-data"]), "a folder without __init__.py holds package data"
    assert all(p == "retr" or p.startswith("retr.") for p in found), "every package lives under retr"


def _commands(group: click.Group, prefix: tuple[str, ...] = ()):
    for name, command in sorted(group.commands.items()):
        yield prefix + (name,), command
        if isinstance(command, click.Group):
            yield from _commands(command, prefix + (name,))


def _all_commands():
    from retr.pipeline.commands import cli as pipeline_cli
    from retr.trainers.commands import cli as train_cli
    return ([("retr-pipeline", path, c) for path, c in _commands(pipeline_cli)]
            + [("retr-train", path, c) for path, c in _commands(train_cli)])


@pytest.mark.parametrize("program, path, command", _all_commands(),
                         ids=lambda v: " ".join(v) if isinstance(v, tuple) else str(v)[:0])
def test_every_command_has_help_with_an_example(program, path, command):
    text = command.help or ""
    assert "Example:" in text, f"{program} {' '.join(path)} --help needs an Example: block"
    example = text.split("Example:", 1)[1]
    assert program in example, f"the example of {program} {' '.join(path)} should show the command"


def test_console_scripts_run_and_report_errors_in_one_line(tmp_path):
    bin_dir = Path(sys.executable).parent
    for program in ("retr-pipeline", "retr-train"):
        result = subprocess.run([str(bin_dir / program), "--help"], capture_output=True, text=True)
        assert result.returncode == 0 and "Example:" in result.stdout
    result = subprocess.run([str(bin_dir / "retr-pipeline"), "manifest", "check", str(tmp_path / "none.jsonl")],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr == (f"error: MANIFEST {tmp_path / 'none.jsonl'} does not exist (expected a JSON Lines "
                             "manifest)\n")
    result = subprocess.run([str(bin_dir / "retr-pipeline"), "verify", "--no-such-flag", "x"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "error: No such option" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_resource_message_has_three_parts():
    from retr.common.errors import MissingResourceError
    error = MissingResourceError("stanza English models", ["/a", "/b"], "run X on a connected machine")
    assert str(error) == "stanza English models not found (looked in /a, /b); run X on a connected machine"
