"""The layer rule of docs/DESIGN.md ("Layout"): which retr package may import which, and no cycles; and the library
apart from the commands: click only in a command layer (``common/cli.py``, ``<package>/commands/``), which no library
module imports.

Every ``.py`` file of every package folder mapped in ``pyproject.toml`` is parsed with :mod:`ast` (nothing is
imported); every import of a ``retr`` module counts, wherever it is written — module top, inside a function, under
``if TYPE_CHECKING`` — as do ``from retr import x``, relative imports and ``importlib.import_module("retr.x")``.
"""
from __future__ import annotations

import ast
import functools
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: package → the other retr packages it may import (importing its own modules is always allowed)
ALLOWED: dict[str, frozenset[str]] = {
    "common": frozenset(),
    "store": frozenset({"common"}),
    "manifests": frozenset({"common", "store"}),
    "extractors": frozenset({"common", "store"}),
    "parsers": frozenset({"common", "store"}),
    "pipeline": frozenset({"common", "store", "manifests", "extractors", "parsers"}),
    "trainers": frozenset({"common", "store", "manifests", "extractors", "parsers"}),
}

#: trainers/ as a one-way stack (docs/DESIGN.md, "Layout"): a layer → the layers below it it may import. A
#: top-level module of trainers/ (``config``) is a layer of its own.
TRAINERS_ALLOWED: dict[str, frozenset[str]] = {
    "config": frozenset(),
    "data": frozenset({"config"}),
    "models": frozenset({"config", "data"}),
    "runs": frozenset({"config", "data", "models"}),
    "evaluation": frozenset({"config", "data", "models", "runs"}),
    "training": frozenset({"config", "data", "models", "runs", "evaluation"}),
    "reporting": frozenset({"config", "data", "models", "runs", "evaluation"}),
    "search": frozenset({"config", "data", "models", "runs", "evaluation", "reporting"}),
    "reproduction": frozenset({"config", "data", "models", "runs", "evaluation", "training"}),
    "commands": frozenset({"config", "data", "models", "runs", "evaluation", "training", "reporting", "search",
                           "reproduction"}),
}

Edge = tuple[str, str]   # (importing module, imported module), both dotted ``retr.…`` names


# ------------------------------------------------------------------------------------------------- checker

def package_folders(root: Path) -> dict[str, Path]:
    """``{"store": root/"store", …}`` from ``[tool.setuptools] package-dir`` of ``root/pyproject.toml``."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name.split(".", 1)[1]: root / folder for name, folder in mapping.items() if name.startswith("retr.")}


def module_name(package: str, folder: Path, path: Path) -> str:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["retr", package, *parts])


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every ``retr.…`` module that ``source`` (the text of ``module``) imports, at any depth."""
    found: set[str] = set()
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base == "retr" or not node.module:   # from retr import store, from . import x: names are modules
                found.update(f"{base}.{alias.name}" for alias in node.names)
            else:
                found.add(base)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    return {m for m in found if m.startswith("retr.")}


def import_edges(folders: dict[str, Path]) -> list[Edge]:
    """``(module, imported module)`` for every retr import in every package folder, sorted."""
    edges = set()
    for package, folder in folders.items():
        for path in sorted(folder.rglob("*.py")):
            module = module_name(package, folder, path)
            source = path.read_text(encoding="utf-8")
            edges.update((module, target) for target in imported_modules(source, module, path.name == "__init__.py"))
    return sorted(edges)


def package_of(module: str) -> str:
    return module.split(".")[1]


def violations(edges: list[Edge], allowed: dict[str, frozenset[str]]) -> list[Edge]:
    """The edges whose imported package is neither the importer's own nor one it may import."""
    return [(src, dst) for src, dst in edges
            if package_of(dst) != package_of(src) and package_of(dst) not in allowed.get(package_of(src), ())]


def cycles(edges) -> list[list[str]]:
    """Groups of nodes that reach each other along ``edges`` ``(src, dst)``, directly or through others (strongly
    connected, size ≥ 2); an edge from a node to itself is no loop."""
    graph: dict[str, set[str]] = {}
    for src, dst in edges:
        graph.setdefault(src, set())
        graph.setdefault(dst, set())
        if src != dst:
            graph[src].add(dst)

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reach = {p: reachable(p) for p in graph}
    groups = {frozenset(q for q in graph if q == p or (q in reach[p] and p in reach[q])) for p in graph}
    return sorted(sorted(g) for g in groups if len(g) > 1)


def package_cycles(edges: list[Edge]) -> list[list[str]]:
    """Groups of packages that import each other, directly or through others (strongly connected, size ≥ 2)."""
    return cycles((package_of(src), package_of(dst)) for src, dst in edges)


def trainers_layer(module: str) -> str | None:
    """The layer of trainers/ that ``module`` belongs to (its subfolder, or its top-level module), else None."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "trainers" else None


def trainers_edges(edges: list[Edge]) -> list[Edge]:
    """The edges between two modules of trainers/ as ``(layer, layer)`` with their module pairs kept, as
    ``retr.<layer>.…`` names so that :func:`violations` and :func:`package_cycles` read the layers."""
    out = []
    for src, dst in edges:
        a, b = trainers_layer(src), trainers_layer(dst)
        if a and b:
            out.append((f"retr.{a}.{src}", f"retr.{b}.{dst}"))
    return out


def _report(pairs: list[Edge]) -> str:
    return "\n".join(f"  {src} imports {dst}" for src, dst in pairs)


# ------------------------------------------------------------------------------------------------- the repo

def test_every_package_has_a_place_in_the_rule():
    assert set(package_folders(ROOT)) == set(ALLOWED), "add the new package to ALLOWED and to docs/DESIGN.md"


def test_packages_import_only_what_the_layer_rule_allows():
    edges = import_edges(package_folders(ROOT))
    assert len(edges) > 50, "the scan found almost no imports; is it looking at the right folders?"
    bad = violations(edges, ALLOWED)
    assert not bad, "imports against the layer rule (docs/DESIGN.md, Layout):\n" + _report(bad)


def test_no_import_cycle_between_packages():
    edges = import_edges(package_folders(ROOT))
    cycles = package_cycles(edges)
    example: dict[tuple[str, str], Edge] = {}   # one module pair per package pair inside a cycle
    for src, dst in edges:
        a, b = package_of(src), package_of(dst)
        if a != b and any(a in group and b in group for group in cycles):
            example.setdefault((a, b), (src, dst))
    assert not cycles, (f"packages importing each other: {cycles}\n"
                        + "\n".join(f"  {a} → {b}, e.g. {src} imports {dst}" for (a, b), (src, dst) in example.items()))


def test_the_rule_itself_has_no_cycle():
    for rule in (ALLOWED, TRAINERS_ALLOWED):
        edges = [(f"retr.{a}.m", f"retr.{b}.m") for a, targets in rule.items() for b in targets]
        assert package_cycles(edges) == []


def test_every_layer_of_trainers_has_a_place_in_the_stack():
    folder = package_folders(ROOT)["trainers"]
    layers = {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    layers |= {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    assert layers == set(TRAINERS_ALLOWED), "add the new layer to TRAINERS_ALLOWED and to docs/DESIGN.md"


def test_trainers_is_a_one_way_stack():
    """No layer of trainers/ imports one above it or beside it, and no two import each other: no exception."""
    edges = trainers_edges(import_edges(package_folders(ROOT)))
    assert len(edges) > 50, "the scan found almost no imports inside trainers/"
    bad = violations(edges, TRAINERS_ALLOWED)
    assert not bad, "imports against the trainers/ stack (docs/DESIGN.md, Layout):\n" + _report(
        [(src.split(".", 2)[2], dst.split(".", 2)[2]) for src, dst in bad])
    assert package_cycles(edges) == []


def test_the_stack_check_sees_a_model_importing_training(tmp_path):
    folders = _tree(tmp_path, {
        "trainers/__init__.py": "",
        "trainers/config.py": "",
        "trainers/models/__init__.py": "from retr.trainers.training.loop import train\n",
        "trainers/training/__init__.py": "",
        "trainers/training/loop.py": "from retr.trainers.models import x\nfrom retr.trainers import config\n",
    })
    edges = trainers_edges(import_edges(folders))
    assert violations(edges, TRAINERS_ALLOWED) == [("retr.models.retr.trainers.models",
                                                    "retr.training.retr.trainers.training.loop")]
    assert package_cycles(edges) == [["models", "training"]]


# ------------------------------------------------------------------------------------------------- module cycles
# Inside one layer modules may import each other, but not in a loop: a loop (``a`` needs ``b`` needs ``a``) hides
# which of them holds what, and works only as long as each import happens late enough.

def module_files(folders: dict[str, Path]) -> dict[str, Path]:
    """``{dotted module name: file}`` of every module of every package folder (a package is its ``__init__.py``)."""
    return {module_name(package, folder, path): path for package, folder in folders.items()
            for path in sorted(folder.rglob("*.py"))}


def module_edges(folders: dict[str, Path]) -> list[Edge]:
    """``(module, module it imports)`` between retr modules, wherever the import is written: ``from pkg import
    name`` is an import of the module ``pkg.name`` when there is one, else of ``pkg`` (its ``__init__.py``)."""
    modules = module_files(folders)
    edges = set()
    for module, path in modules.items():
        names = imported_names(path.read_text(encoding="utf-8"), module, path.name == "__init__.py")
        for target in names:
            if target not in modules or target == module:
                continue
            # ``from pkg import sub`` names both pkg and pkg.sub: only the submodule is imported from pkg's names
            if any(other.startswith(target + ".") and other in modules for other in names) and \
                    not _imports_package_names(path.read_text(encoding="utf-8"), module, target,
                                               path.name == "__init__.py", modules):
                continue
            edges.add((module, target))
    return sorted(edges)


def _imports_package_names(source: str, module: str, package: str, is_package: bool, modules: dict) -> bool:
    """Whether ``source`` imports from ``package`` a name that is not one of its submodules (so its
    ``__init__.py`` runs for that name) or imports ``package`` itself."""
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(alias.name == package for alias in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or node.level):
            base = (".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                    if node.level else node.module)
            if base == package and any(f"{base}.{alias.name}" not in modules for alias in node.names):
                return True
    return False


def module_cycles(edges: list[Edge]) -> list[list[str]]:
    """Groups of modules that import each other, directly or through others (strongly connected, size ≥ 2)."""
    return cycles(edges)


def test_no_import_loop_between_modules():
    """No two modules import each other, directly or through others, inside one layer or anywhere (an import
    inside a function counts: the loop is there, only hidden until that function runs)."""
    edges = module_edges(package_folders(ROOT))
    assert len(edges) > 100, "the scan found almost no imports between modules"
    cycles = module_cycles(edges)
    assert not cycles, "modules importing each other (move what both need into a module of its own):\n" + \
        "\n".join("  " + " ↔ ".join(group) for group in cycles)


def test_the_module_check_sees_loops_through_a_function_and_a_package(tmp_path):
    folders = _tree(tmp_path, {
        "common/__init__.py": "",
        "trainers/__init__.py": "",
        "trainers/runs/__init__.py": "",
        "trainers/runs/checkpoint.py": "def late():\n    from retr.trainers.runs.hub import local_run\n",
        "trainers/runs/hub.py": "from retr.trainers.runs import checkpoint as ckpt\n",
        "trainers/models/__init__.py": "from retr.trainers.models.registry import get_spec\n",
        "trainers/models/registry.py": ("import importlib\n"
                                        "def load():\n    importlib.import_module('retr.trainers.models')\n"),
        "trainers/models/scan.py": "from retr.trainers.models.registry import get_spec\n",
        "trainers/training/__init__.py": "",
        "trainers/training/loop.py": "from retr.trainers.models import scan\nfrom retr.trainers.runs import hub\n",
    })
    edges = module_edges(folders)
    assert ("retr.trainers.training.loop", "retr.trainers.models.scan") in edges        # the submodule …
    assert ("retr.trainers.training.loop", "retr.trainers.models") not in edges        # … not the package's names
    assert module_cycles(edges) == [["retr.trainers.models", "retr.trainers.models.registry"],
                                    ["retr.trainers.runs.checkpoint", "retr.trainers.runs.hub"]]


# ------------------------------------------------------------------------------------------------- the checker

def _tree(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    names = sorted({rel.split("/")[0] for rel in files})
    (root / "pyproject.toml").write_text("[tool.setuptools]\npackage-dir = { "
                                         + ", ".join(f'"retr.{n}" = "{n}"' for n in names) + " }\n")
    return package_folders(root)


def test_checker_finds_every_kind_of_import(tmp_path):
    folders = _tree(tmp_path, {
        "common/__init__.py": "",
        "common/util.py": "import os\n",
        "store/__init__.py": "",
        "store/files.py": ("from retr.common import util\n"
                           "def late():\n"
                           "    if True:\n"
                           "        from retr.pipeline.stage import run   # nested: still counts\n"),
        "pipeline/__init__.py": "from . import stage\n",
        "pipeline/stage.py": ("import retr.store.files as files\n"
                              "from retr import trainers\n"
                              "from .sub import helper\n"),
        "pipeline/sub/__init__.py": "",
        "pipeline/sub/helper.py": "from ..stage import run\n",
        "trainers/__init__.py": "",
        "trainers/training/loop.py": ("import importlib\n"
                             "class Loop:\n"
                             "    def go(self):\n"
                             "        return importlib.import_module('retr.pipeline.stage')\n"),
    })
    edges = import_edges(folders)
    assert ("retr.pipeline", "retr.pipeline.stage") in edges                      # from . import stage
    assert ("retr.pipeline.stage", "retr.pipeline.sub") in edges                  # from .sub import helper
    assert ("retr.pipeline.sub.helper", "retr.pipeline.stage") in edges           # from ..stage import run
    assert ("retr.store.files", "retr.common") in edges
    assert violations(edges, ALLOWED) == [
        ("retr.pipeline.stage", "retr.trainers"),
        ("retr.store.files", "retr.pipeline.stage"),
        ("retr.trainers.training.loop", "retr.pipeline.stage"),
    ]
    assert package_cycles(edges) == [["pipeline", "store", "trainers"]]


def test_checker_passes_a_clean_tree_and_finds_a_cycle_the_rule_would_allow(tmp_path):
    folders = _tree(tmp_path, {
        "common/__init__.py": "",
        "store/__init__.py": "from retr.common import x\n",
        "parsers/__init__.py": "from retr.store import y\n",
        "pipeline/__init__.py": "import retr.parsers\nimport retr.store\n",
    })
    edges = import_edges(folders)
    assert violations(edges, ALLOWED) == [] and package_cycles(edges) == []
    # a rule that let common import store would still be caught by the cycle check
    (tmp_path / "common/__init__.py").write_text("def f():\n    import retr.store\n")
    edges = import_edges(folders)
    loose = {**ALLOWED, "common": frozenset({"store"})}
    assert violations(edges, loose) == []
    assert package_cycles(edges) == [["common", "store"]]


@pytest.mark.parametrize("source, expected", [
    ("import retr.store.features, os", {"retr.store.features"}),
    ("from retr.store.features import FeatureSet", {"retr.store.features"}),
    ("from retr import store, common", {"retr.store", "retr.common"}),
    ("import numpy\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import retr.trainers", {"retr.trainers"}),
    ("__import__('retr.pipeline.cli')", {"retr.pipeline.cli"}),
    ("from .features import x", {"retr.store.features"}),
])
def test_imported_modules(source, expected):
    assert imported_modules(source, "retr.store.vocab") == expected


# ------------------------------------------------------------------------------------------------- the command layer
# The library apart from its commands (docs/DESIGN.md, Layout): click is imported only by a package's command layer
# — ``common/cli.py`` (the conventions both console scripts share) and ``<package>/commands/`` (every command, one
# module per command or group) — and no library module imports a command layer: the commands import the library,
# never the other way, so ``import retr.<package>.<module>`` never drags in click.

#: package → its command layer: paths inside the package folder (a module, or a folder and everything below it)
COMMAND_LAYER: dict[str, tuple[str, ...]] = {
    "common": ("cli.py",),
    "pipeline": ("commands",),
    "trainers": ("commands",),
}

#: Packages whose library is not checked (a package being split into library and commands would be listed here
#: while the split is under way; none is now).
NOT_CHECKED_YET: frozenset[str] = frozenset()


def in_command_layer(package: str, folder: Path, path: Path) -> bool:
    """Whether ``path`` (a file of ``package``'s ``folder``) belongs to the package's command layer."""
    rel = path.relative_to(folder)
    return any(rel == Path(layer) or Path(layer) in rel.parents for layer in COMMAND_LAYER.get(package, ()))


def command_layer_modules(folders: dict[str, Path]) -> set[str]:
    """The dotted names of every command layer (``retr.common.cli``, ``retr.pipeline.commands``, …)."""
    return {module_name(package, folder, folder / layer) if layer.endswith(".py")
            else ".".join(["retr", package, *Path(layer).parts])
            for package, folder in folders.items() for layer in COMMAND_LAYER.get(package, ())}


def click_imports(source: str) -> set[str]:
    """The ``click`` modules ``source`` imports, at any depth (``import click``, ``from click.testing import …``,
    ``importlib.import_module("click")``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    return {m for m in found if m == "click" or m.startswith("click.")}


def imported_names(source: str, module: str, is_package: bool = False) -> set[str]:
    """:func:`imported_modules` plus every ``package.name`` of ``from package import name`` (the name may be a
    submodule: ``from retr.pipeline import commands``)."""
    found = imported_modules(source, module, is_package)
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            base = (".".join(here[:len(here) - node.level + 1] + [node.module]) if node.level else node.module)
            found.update(f"{base}.{alias.name}" for alias in node.names if base.startswith("retr."))
    return found


def command_layer_violations(folders: dict[str, Path], skip: frozenset[str] = frozenset()) -> list[Edge]:
    """``(library module, what it imports)`` for every import of click or of a command layer by a module outside
    the command layers (packages in ``skip`` are not read), sorted."""
    layers = command_layer_modules(folders)
    bad = set()
    for package, folder in folders.items():
        if package in skip:
            continue
        for path in sorted(folder.rglob("*.py")):
            if in_command_layer(package, folder, path):
                continue
            module = module_name(package, folder, path)
            source = path.read_text(encoding="utf-8")
            bad.update((module, name) for name in click_imports(source))
            hits = {target for target in imported_names(source, module, path.name == "__init__.py")
                    if any(target == layer or target.startswith(layer + ".") for layer in layers)}
            # ``from .commands.extract import x`` names retr.pipeline.commands.extract(.x): report the module once
            bad.update((module, hit) for hit in hits if not any(hit.startswith(other + ".") for other in hits))
    return sorted(bad)


@functools.cache
def _repo_command_layer_violations() -> tuple[Edge, ...]:
    return tuple(command_layer_violations(package_folders(ROOT), skip=NOT_CHECKED_YET))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_library_modules_import_no_command_layer(package):
    folders = package_folders(ROOT)
    if package in NOT_CHECKED_YET:
        pytest.skip(f"{package}/ is not checked yet: its split into a library and {package}/commands/ is under way "
                    f"(remove {package!r} from NOT_CHECKED_YET in tests/test_layers.py once it is done)")
    for layer in COMMAND_LAYER.get(package, ()):
        assert (folders[package] / layer).exists(), f"{package}/{layer}, the command layer, is missing"
    bad = [(src, dst) for src, dst in _repo_command_layer_violations() if package_of(src) == package]
    home = ", ".join(f"{package}/{layer}" for layer in COMMAND_LAYER.get(package, ())) or "another package's commands"
    assert not bad, (f"library modules that import click or a command layer (command code belongs in {home}; "
                     "docs/DESIGN.md, Layout):\n" + _report(bad))


def test_command_layer_checker(tmp_path):
    folders = _tree(tmp_path, {
        "common/__init__.py": "",
        "common/cli.py": "import click\n",
        "common/util.py": "def f():\n    from click.testing import CliRunner\n",        # nested: still counts
        "store/__init__.py": "import clickhouse\n",                                       # not click
        "pipeline/__init__.py": "",
        "pipeline/commands/__init__.py": "import click\nfrom retr.pipeline import stage\n",
        "pipeline/commands/extract.py": "import click\nfrom retr.common.cli import run\n",
        "pipeline/stage.py": "from retr.pipeline import commands\n",
        "pipeline/verify.py": "from .commands.extract import x\n",
        "pipeline/report.py": "import importlib\nimportlib.import_module('click')\n",
        "pipeline/progress.py": "from retr.common import cli\n",
        "trainers/__init__.py": "",
        "trainers/loop.py": "import click\nimport retr.trainers.commands.train\n",
    })
    assert command_layer_modules(folders) == {"retr.common.cli", "retr.pipeline.commands", "retr.trainers.commands"}
    assert command_layer_violations(folders) == [
        ("retr.common.util", "click.testing"),
        ("retr.pipeline.progress", "retr.common.cli"),
        ("retr.pipeline.report", "click"),
        ("retr.pipeline.stage", "retr.pipeline.commands"),
        ("retr.pipeline.verify", "retr.pipeline.commands.extract"),
        ("retr.trainers.loop", "click"),
        ("retr.trainers.loop", "retr.trainers.commands.train"),
    ]
    assert [src for src, _ in command_layer_violations(folders, skip=frozenset({"trainers"}))
            if src.startswith("retr.trainers")] == []


# ------------------------------------------------------------------------------------------------- late imports
# An import belongs at the top of its module, where a reader sees what the module stands on. Written inside a
# function only where the top would cost something: an import that takes time the module's common uses never need
# (`# cost: torch` — e.g. `retr-pipeline --help` loads no torch), or a package retr does not require (`# optional:
# matplotlib, the report extra`); the import's comment says which.

LATE_REASONS = ("cost", "optional")


def late_imports(source: str) -> list[tuple[int, str]]:
    """``(line, the import's text)`` of every import written inside a function whose comment gives no reason
    (:data:`LATE_REASONS`: ``# cost: …`` or ``# optional: …`` on one of its lines)."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    text = lines[sub.lineno - 1:sub.end_lineno]
                    comments = [line.split("#", 1)[1].strip() for line in text if "#" in line]
                    if not any(c.split(":")[0].strip() in LATE_REASONS for c in comments):
                        found.append((sub.lineno, text[0].strip()))
    return sorted(set(found))


def test_imports_inside_functions_say_why():
    bad = [f"  {path.relative_to(ROOT)}:{line}: {text}" for folder in package_folders(ROOT).values()
           for path in sorted(folder.rglob("*.py")) for line, text in late_imports(path.read_text(encoding="utf-8"))]
    assert not bad, ("imports inside functions with no reason (move them to the top, or say `# cost: …` / "
                     "`# optional: …`):\n" + "\n".join(bad))


def test_the_late_import_check_reads_the_comment():
    source = ("def a():\n    import torch  # cost: torch\n"
              "def b():\n    import jinja2  # optional: the report extra\n"
              "def c():\n    from retr.store import features\n"
              "def d():\n    from retr.store.features import (FeatureSet,\n"
              "                                     KINDS)  # cost: h5py\n"
              "def e():\n    import numpy  # numpy\n")
    assert late_imports(source) == [(6, "from retr.store import features"), (11, "import numpy  # numpy")]


def test_the_pipeline_commands_load_no_torch():
    """The reason the pipeline's commands give for their late imports: `retr-pipeline --help` stays light."""
    import subprocess
    import sys

    code = "import sys; from retr.pipeline.commands import cli; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
