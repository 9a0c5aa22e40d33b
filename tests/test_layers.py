"""The layer rule of docs/DESIGN.md ("Layout"): which retr package may import which, and no cycles.

Every ``.py`` file of every package folder mapped in ``pyproject.toml`` is parsed with :mod:`ast` (nothing is
imported); every import of a ``retr`` module counts, wherever it is written — module top, inside a function, under
``if TYPE_CHECKING`` — as do ``from retr import x``, relative imports and ``importlib.import_module("retr.x")``.
"""
from __future__ import annotations

import ast
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


def package_cycles(edges: list[Edge]) -> list[list[str]]:
    """Groups of packages that import each other, directly or through others (strongly connected, size ≥ 2)."""
    graph: dict[str, set[str]] = {}
    for src, dst in edges:
        a, b = package_of(src), package_of(dst)
        graph.setdefault(a, set())
        graph.setdefault(b, set())
        if a != b:
            graph[a].add(b)

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
    edges = [(f"retr.{a}.m", f"retr.{b}.m") for a, targets in ALLOWED.items() for b in targets]
    assert package_cycles(edges) == []


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
