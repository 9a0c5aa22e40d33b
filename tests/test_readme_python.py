"""The README's Python example runs as printed: saved in the clone and run there, as the README says, on a run made by
the demo's own commands (its dataset generator, its region extractor with its settings, SCAN), with fewer images and
one epoch so that it takes seconds; saved beside the clone instead, it fails, which is why the README says where.
The block is read out of README.md, so an edit that breaks it fails here."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DEMO = "demo-out"          # the Makefile's DEMO_DIR: the block's paths are the ones `make demo` writes


def readme_python() -> str:
    """The one ```python block of the README's "From Python" section."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("### From Python"):]
    section = section[:section.index("\n### ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the README's Python section holds one example"
    return blocks[0]


def test_the_python_block_uses_the_facade_only():
    imports = [line for line in readme_python().splitlines() if re.match(r"\s*(import|from) ", line)]
    assert imports == ["import retr"]


def test_the_readme_says_where_to_run_the_example():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("### From Python"):text.index("```python", text.index("### From Python"))]
    assert "save it\nin the clone" in section and "`.venv/bin/python example.py`" in section


def test_the_readme_python_example_runs_on_a_demo_run(tmp_path, run_cli):
    clone = tmp_path / "retr"             # as `git clone` names it; the demo's files and the example go in it
    clone.mkdir()
    synthetic, features = f"{DEMO}/synthetic", f"{DEMO}/synthetic/features"
    commands = [
        ("pipeline", "synth", "--out", synthetic, "--images", "16", "--seed", "0"),
        ("pipeline", "extract", "--manifest", f"{synthetic}/manifest.jsonl", "--image-root", synthetic,
         "--extractor", "butd-regions", "--weights", "random", "--short-side", "224", "--max-side", "224",
         "--post-nms-topk", "36", "--pooled-size", "7", "--out", features, "--quiet"),
        ("train", "scan", "--features", f"{features}/butd-regions.h5", "--manifest", f"{synthetic}/manifest.jsonl",
         "--out", f"{DEMO}/runs/scan", "--epochs", "1", "--batch-size", "16", "--embed-size", "32",
         "--sum-violation", "--device", "cpu", "--quiet"),
    ]
    for program, *args in commands:
        done = run_cli.console_script(f"retr-{program}", *args, cwd=clone)
        assert done.returncode == 0, done.stderr
    (clone / "example.py").write_text(readme_python(), encoding="utf-8")
    done = subprocess.run([sys.executable, "example.py"], cwd=clone, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    hits = [line.split() for line in lines[:-2]]
    # three image hits ranked 1, 2, 3 (the test split holds 2 images here: k is capped at the gallery)
    assert [int(h[0]) for h in hits] == list(range(1, len(hits) + 1)) and 1 <= len(hits) <= 3, lines
    assert all(re.fullmatch(r"synth_\d{5}", h[1]) and re.fullmatch(r"-?\d+\.\d{3}", h[2]) for h in hits), lines
    captions = eval(lines[-2])          # the printed list of the two best captions  # noqa: S307
    assert len(captions) == 2 and all(isinstance(c, str) and c for c in captions), lines
    assert re.fullmatch(r"R@1 \d+\.\d \(text → image\), rSum \d+\.\d; scores \(2, 10\)", lines[-1]), lines
    # saved in the folder that holds the clone, `import retr` finds the clone's folder (a namespace package)
    (tmp_path / "example.py").write_text(readme_python(), encoding="utf-8")
    beside = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True)
    assert beside.returncode != 0 and "module 'retr' has no attribute 'load_model'" in beside.stderr, beside.stderr
