"""The Visual Genome vocabularies of the detector: 1,600 objects and 400 attributes.

Files as the original release ships them (``objects_vocab.txt``, ``attributes_vocab.txt``): one class per line,
synonyms separated by commas (``"man,men"``). Line ``i`` is class ``i`` of the 0-based ids the feature set stores
(``object_ids``/``attr_ids``), i.e. network class ``i + 1`` (0 is background / no attribute)."""
from __future__ import annotations

from pathlib import Path

from retr.common.errors import MissingResourceError, UserError

NUM_OBJECTS = 1600
NUM_ATTRIBUTES = 400
VOCAB_HOW = ("the files are data/genome/1600-400-20/objects_vocab.txt and attributes_vocab.txt of "
             "peteanderson80/bottom-up-attention (also evaluation/*_vocab.txt in MILVLG/bottom-up-attention.pytorch)")


def read_vocab(path: str | Path, expected: int, what: str) -> list[str]:
    """The lines (synonym lists, stripped) of a vocabulary file; exactly ``expected`` non-empty lines."""
    path = Path(path)
    if not path.is_file():
        raise MissingResourceError(f"{what} vocabulary {path.name}", str(path.resolve().parent), VOCAB_HOW)
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    if len(lines) != expected or not all(lines):
        raise UserError(f"{path}: expected {expected} non-empty lines of {what} names, found {len(lines)}"
                        + ("" if all(lines) else " (some empty)"))
    return lines
