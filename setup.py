"""Package discovery for the folders ``pyproject.toml`` maps into the one import package ``retr``
(``[tool.setuptools] package-dir``): every folder under a mapped folder is a subpackage of its mapping
(``trainers/runs`` → ``retr.trainers.runs``) — one with an ``__init__.py`` a regular package, one without (the
search page's ``web/``, the report's ``templates/``) a package of data files that ``package-data`` names, which
Python can import as a namespace package and so setuptools must be told of. setuptools' own discovery does not
follow such a mapping; everything else about the build is in ``pyproject.toml``."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent


#: folders that are no package: Python's bytecode caches
SKIPPED = ("__pycache__",)


def discovered_packages(root: Path = ROOT) -> list[str]:
    """Every ``retr`` package under the folders ``root/pyproject.toml`` maps (each folder there: see above),
    sorted."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    packages = set()
    for package, folder in mapping.items():
        base = root / folder
        for path in [base, *base.rglob("*")]:
            parts = path.relative_to(base).parts
            if path.is_dir() and not any(part in SKIPPED or part.startswith(".") for part in parts):
                packages.add(".".join([package, *parts]))
    return sorted(packages)


if __name__ == "__main__":
    from setuptools import setup

    setup(packages=discovered_packages())
