"""Package discovery for the folders ``pyproject.toml`` maps into the one import package ``retr``
(``[tool.setuptools] package-dir``): every folder holding an ``__init__.py`` under a mapped folder is a
subpackage of its mapping (``trainers/runs`` → ``retr.trainers.runs``). setuptools' own discovery does not follow
such a mapping; everything else about the build is in ``pyproject.toml``."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def discovered_packages(root: Path = ROOT) -> list[str]:
    """Every ``retr`` package under the folders ``root/pyproject.toml`` maps, sorted."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    packages = set()
    for package, folder in mapping.items():
        for init in (root / folder).rglob("__init__.py"):
            packages.add(".".join([package, *init.parent.relative_to(root / folder).parts]))
    return sorted(packages)


if __name__ == "__main__":
    from setuptools import setup

    setup(packages=discovered_packages())
