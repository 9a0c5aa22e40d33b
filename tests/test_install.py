"""Installing retr: ``pip install .`` (no extra, no make) gives working commands; extras hold what only some
users need; a wheel ships every subpackage.

* The extras of ``pyproject.toml`` and :mod:`retr.common.optional` agree, and no module imports an extra's
  package except through :func:`retr.common.optional.require` (one way, always lazy).
* Without the extras' packages — blocked in a subprocess by a meta-path finder that ``PYTHONPATH`` installs as
  ``sitecustomize`` — ``import retr``, both commands' and every subcommand's ``--help`` work, and whatever needs
  an extra stops with one line naming it.
* A wheel built from a copy of the sources and installed with ``pip install --target`` (no editable finder:
  dependencies come from this venv) imports from another folder, with its console scripts: the package-dir
  mapping (``api/`` is ``retr``) holds outside editable mode and every subpackage ships, with its package data
  (the search page's files).
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from retr.common.optional import DISTRIBUTIONS

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
BIN = Path(sys.executable).parent

#: module a fresh ``pip install .`` lacks → the extra that brings it (huggingface_hub and safetensors come with timm)
BLOCKED = {"stanza": "pipeline", "cv2": "pipeline", "timm": "pipeline", "huggingface_hub": "hub",
           "matplotlib": "report", "faiss": "search", "tensorboard": "tensorboard",
           "open_clip": "clip", "flask": "serve", "waitress": "serve", "jinja2": "report", "wandb": "wandb",
           "eccv_caption": "eccv", "transformers": "bert", "tokenizers": "bert"}

BLOCKER = f'''
import sys

BLOCKED = {sorted(BLOCKED)!r}


class BlockExtras:
    """Packages of retr's extras are "not installed" here."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, BlockExtras())
'''


def _distribution(requirement: str) -> str:
    return re.split(r"[\s;\[<>=!~]", requirement, maxsplit=1)[0].lower()


def _import_name(distribution: str) -> str:
    return {v: k for k, v in DISTRIBUTIONS.items()}.get(distribution, distribution.replace("-", "_"))


# ------------------------------------------------------------------------------------------------- the tables

def test_extras_split_what_only_some_users_need():
    project = PYPROJECT["project"]
    extras = project["optional-dependencies"]
    assert set(extras) == {"bert", "clip", "eccv", "hub", "pipeline", "report", "search", "serve", "tensorboard",
                           "wandb", "all", "dev"}
    parts = sorted(set(extras) - {"all", "dev"})
    assert extras["all"] == [f"retr[{','.join(parts)}]"], "all = every extra"
    assert "retr[all]" in extras["dev"] and {"pytest", "pytest-randomly"} <= set(extras["dev"])
    core = {_distribution(r) for r in project["dependencies"]}
    assert core == {"torch", "torchvision", "h5py", "numpy", "pillow", "click", "tqdm", "nltk", "pyyaml",
                    "tabulate", "conllu", "safetensors"}
    for extra in parts:
        for requirement in extras[extra]:
            distribution = _distribution(requirement)
            assert distribution not in core
            assert BLOCKED.get(_import_name(distribution)) == extra, \
                f"{distribution} of [{extra}]: add its module to BLOCKED so the no-extras test covers it"
    assert "-e \".[dev]\"" in (ROOT / "Makefile").read_text(), "make setup installs everything (the dev extra)"


def test_extras_are_imported_only_through_require():
    folders = [ROOT / folder for folder in PYPROJECT["tool"]["setuptools"]["package-dir"].values()]
    found = []
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                else:
                    continue
                if any(n.split(".")[0] in BLOCKED or n.startswith("torch.utils.tensorboard") for n in names):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == [], "import these through retr.common.optional.require (lazy, one-line error)"


# ------------------------------------------------------------------------------------------- without extras

def _blocked_env(tmp_path: Path, *front: Path) -> dict[str, str]:
    blocker = tmp_path / "blocker"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (*front, blocker))
    return env


WITHOUT_EXTRAS = r'''
import json, sys
import click
from click.testing import CliRunner

import retr
from retr.pipeline.commands import cli as pipeline_cli
from retr.trainers.commands import cli as train_cli

def walk(group, prefix=()):
    for name, command in sorted(group.commands.items()):
        yield prefix + (name,)
        if isinstance(command, click.Group):
            yield from walk(command, prefix + (name,))

helped = []
for group in (pipeline_cli, train_cli):
    for path in walk(group):
        result = CliRunner().invoke(group, [*path, "--help"])
        assert result.exit_code == 0 and "Example:" in result.output, (path, result.output)
        helped.append(" ".join(path))

import torch
from retr.common.optional import MissingExtraError
from retr.extractors import timm_weights
from retr.extractors.base import build_extractor
from retr.parsers import backends
from retr.trainers.reporting import draw
from retr.trainers.search.retrieval import InnerProductIndex
from retr.trainers.search import serve_app
from retr.trainers.runs.run_log import summary_writer
from retr.trainers.evaluation.coco_extended import load_annotations
from retr.trainers.models import create_model
from retr.store.wordpiece import WordPieceVocabulary

calls = {
    "report: draw.pyplot": lambda: draw.pyplot(),
    "report: draw.heat_colours": lambda: draw.heat_colours(torch.zeros(2, 2).numpy()),
    "search: use_faiss=True": lambda: InnerProductIndex(torch.zeros(4, 3), use_faiss=True),
    "serve: retr-train serve": lambda: serve_app.server_modules(),
    "tensorboard: --log tensorboard": lambda: summary_writer(("tensorboard",)),
    "pipeline: butd-regions": lambda: build_extractor("butd-regions", weights="random"),
    "clip: clip-vit-b-32": lambda: build_extractor("clip-vit-b-32", weights="random"),
    "pipeline: timm": lambda: timm_weights._timm(),
    "pipeline: hub cache": lambda: timm_weights.cached_hub_file("timm/inception_resnet_v2.tf_in1k"),
    "pipeline: stanza models": lambda: backends.fetch_parser_models(sys.argv[1]),
    "eccv: eval --extended": lambda: load_annotations(),
    "bert: --text-encoder bert": lambda: create_model("vse-infinity", vocab_size=5, text_encoder="bert",
                                                      bert_config={"vocab_size": 5}),
    "bert: WordPiece captions": lambda: WordPieceVocabulary(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]).encode("a"),
}
messages = {}
for name, call in calls.items():
    try:
        call()
        messages[name] = None
    except MissingExtraError as exc:
        messages[name] = str(exc)
fallback = InnerProductIndex(torch.zeros(4, 3)).backend
print(json.dumps({"helped": helped, "messages": messages, "fallback": fallback, "version": retr.__version__}))
'''


@pytest.mark.slow
def test_commands_work_without_extras_and_name_the_missing_one(tmp_path):
    env = _blocked_env(tmp_path)
    done = subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS, str(tmp_path / "nothing")], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report["helped"]) > 20 and {"extract", "parse-trees", "show", "plot", "search"} <= {
        h.split()[0] for h in report["helped"]}
    assert report["fallback"] == "matmul", "search without faiss uses matrix products"
    assert not (tmp_path / "nothing").exists(), "a missing extra stops before anything is written"
    for name, message in report["messages"].items():
        extra = name.split(":")[0]
        assert message is not None, f"{name} ran without its extra"
        assert "\n" not in message and re.fullmatch(
            rf"\S+ is not installed \(needed by [^)]+\): pip install 'retr\[{extra}\]' \(or make setup\)",
            message), message

    for program in ("retr-train", "retr-pipeline"):
        result = subprocess.run([str(BIN / program), "--help"], capture_output=True, text=True, env=env,
                                cwd=tmp_path, timeout=60)
        assert result.returncode == 0 and "Example:" in result.stdout, result.stderr
    (tmp_path / "run").mkdir()                  # a run's log: the path is right, the extra is what is missing
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    result = subprocess.run([str(BIN / "retr-train"), "plot", str(tmp_path / "run")], capture_output=True,
                            text=True, env=env, cwd=tmp_path, timeout=60)
    assert result.returncode == 1
    assert result.stderr == ("error: matplotlib is not installed (needed by the report's drawings): "
                             "pip install 'retr[report]' (or make setup)\n")


@pytest.mark.slow
def test_conllu_commands_run_without_the_pipeline_extra(tmp_path):
    """Parses made elsewhere need no NLP stack: with stanza (and every other extra) blocked, ``synth`` writes the
    synthetic CoNLL-U and ``parse-trees``, ``show-tree`` and ``build-concepts`` read it; their trees equal a run
    with everything installed, and only parsing raw captions stops, naming the ``pipeline`` extra."""
    env = _blocked_env(tmp_path)
    pipeline = str(BIN / "retr-pipeline")
    data = tmp_path / "synthetic"

    def run(*args):
        return subprocess.run([pipeline, *map(str, args)], capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=180)

    done = run("synth", "--out", data, "--images", "24", "--seed", "3", "--quiet")
    assert done.returncode == 0, done.stderr
    manifest, conllu = data / "manifest.jsonl", data / "captions.conllu"
    done = run("parse-trees", "--manifest", manifest, "--conllu", conllu, "--out", tmp_path / "trees.h5", "--quiet")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("wrote 120 trees for 120 captions") and "(0 failures" in done.stdout, done.stdout
    done = run("show-tree", "--key", "synth_00000#0", "--conllu", conllu)
    assert done.returncode == 0 and done.stdout.splitlines()[1].startswith("tree     ("), done.stderr
    assert "parse    (ROOT" in done.stdout
    done = run("build-concepts", "--manifest", manifest, "--conllu", conllu, "--out", tmp_path / "concepts.h5",
               "--nouns", "5", "--adjectives", "6", "--verbs", "3")
    assert done.returncode == 0, done.stderr
    assert "POS from conllu" in done.stdout, done.stdout
    env.pop("STANZA_RESOURCES_DIR", None)   # stanza's own default folder: found through stanza, which is missing
    done = run("parse-trees", "--manifest", manifest, "--out", tmp_path / "raw.h5", "--quiet")
    assert (done.returncode, done.stderr) == (1, "error: stanza is not installed (needed by the caption parser): "
                                                 "pip install 'retr[pipeline]' (or make setup)\n")

    from retr.parsers.backends import ConlluBackend
    from retr.pipeline.parse_trees import run_parse_trees
    from retr.store.concepts import ConceptSet
    from retr.store.trees import TreeSet

    run_parse_trees(manifest, tmp_path / "here.h5", ConlluBackend(conllu))
    blocked, here = TreeSet(tmp_path / "trees.h5"), TreeSet(tmp_path / "here.h5")
    assert blocked.keys == here.keys and blocked.text == here.text and np.array_equal(blocked.nodes, here.nodes)
    concepts = ConceptSet(tmp_path / "concepts.h5")
    assert concepts.attrs["pos_source"] == "conllu" and json.loads(concepts.attrs["actual"]) == {
        "NOUN": 5, "ADJ": 6, "VERB": 3}


# ------------------------------------------------------------------------------------------------ the wheel

@pytest.mark.slow
def test_wheel_installs_every_subpackage_outside_editable_mode(tmp_path):
    setuptools = PYPROJECT["tool"]["setuptools"]
    source = tmp_path / "source"            # a copy: building never writes build/ or egg-info into the checkout
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    for folder in setuptools["package-dir"].values():
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-v", "-w",
                            str(tmp_path / "dist"), str(source)], check=True, capture_output=True, text=True,
                           timeout=180)
    # every folder the wheel holds is a package setuptools was told of: none of its "absent from the `packages`
    # configuration" warnings (35 lines each, which `make setup` printed for web/ and templates/)
    assert "absent from the `packages` configuration" not in built.stdout + built.stderr
    wheel, = (tmp_path / "dist").glob("retr-*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=180)

    version = PYPROJECT["project"]["version"]
    assert {p.name for p in site.iterdir()} == {"retr", "bin", f"retr-{version}.dist-info"}, \
        "one import package, retr: nothing generic such as pipeline lands in site-packages"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = _blocked_env(tmp_path, site)       # the wheel's retr first, and no extras: what `pip install .` gives
    from test_packaging import discovered_packages

    packages = discovered_packages()
    # each package's folder: its __init__.py's, or a data folder's own (a namespace package: no __file__)
    code = ("import importlib, json, os, retr, retr.trainers.commands, retr.pipeline.commands\n"
            f"modules = {{p: importlib.import_module(p) for p in {packages!r}}}\n"
            "files = {p: os.path.dirname(m.__file__) if m.__file__ else list(m.__path__)[0]\n"
            "         for p, m in modules.items()}\n"
            "print(json.dumps({'version': retr.__version__, 'files': files}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=elsewhere,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["version"] == version
    for package, folder in report["files"].items():
        assert Path(folder).is_relative_to(site), f"{package} came from {folder}, not the wheel"
        assert Path(folder) == site.joinpath(*package.split(".")), package
    for package, files in setuptools.get("package-data", {}).items():      # files besides modules ship too
        folder = site.joinpath(*package.split("."))
        for pattern in files:
            source = ROOT / setuptools["package-dir"][".".join(package.split(".")[:2])] / Path(*package.split(".")[2:])
            wanted = {p.relative_to(source) for p in source.glob(pattern) if p.is_file()}
            assert wanted and {p.relative_to(folder) for p in folder.glob(pattern)} == wanted, (package, pattern)

    for program, target in PYPROJECT["project"]["scripts"].items():
        assert target.split(":")[0] in report["files"], f"{program}'s module {target} is no listed package"
        result = subprocess.run([str(site / "bin" / program), "--help"], capture_output=True, text=True, env=env,
                                cwd=elsewhere, timeout=60)
        assert result.returncode == 0 and "Example:" in result.stdout, result.stderr
