"""The docs name only files that exist: every repository path in README.md and docs/*.md (in backticks or a
link) is a file or folder of the checkout."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: the repository's own top-level folders: a path starting with one of them is a claim about this checkout
TOP = ("common", "store", "manifests", "pipeline", "extractors", "parsers", "trainers", "tests", "docs", "bench",
       "tools")
PATH = re.compile(r"(?:`|\]\()((?:%s)/[\w./-]+?)(?:::[\w\[\]-]+)?(?:#[\w-]+)?(?:`|\))" % "|".join(TOP))


def named_paths(doc: Path) -> list[str]:
    text = doc.read_text(encoding="utf-8")
    found = []
    for match in PATH.finditer(text):
        path = match.group(1).rstrip(".")
        if any(ch in path for ch in "*{}<>") or path.endswith("/..."):
            continue                                   # patterns and placeholders, not files
        found.append(path)
    return found


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_path_the_docs_name_exists(doc):
    def exists(path: str) -> bool:
        module, dot, name = path.rpartition(".")          # common/locks.exclusive_lock: a module's function
        return ((ROOT / path).exists() or (doc.parent / path).exists()
                or bool(dot) and not name.isdigit() and (ROOT / f"{module}.py").is_file())
    missing = sorted({p for p in named_paths(doc) if not exists(p)})
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {', '.join(missing)}"


def test_the_path_finder_finds_paths():
    assert named_paths(ROOT / "docs" / "parity.md")   # the parity doc names tools/golden/ and tests/
