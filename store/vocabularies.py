"""A run's caption vocabulary, of either kind, read back from the JSON a run, an export or a checkpoint stores:
SCAN's word vocabulary (:class:`~retr.store.vocab.Vocabulary`, the ``{name}_vocab.json`` format) or BERT's WordPiece
vocabulary (:class:`~retr.store.wordpiece.WordPieceVocabulary`, ``"format": "wordpiece"``). Both give a caption's ids
(``encode``), the ids' tokens (``decode``), the words a caption has outside them (``unknown_words``), ``len`` and
``to_json``/``save``."""
from __future__ import annotations

import json
import os
from pathlib import Path

from retr.common.errors import UserError
from retr.store.vocab import Vocabulary
from retr.store.wordpiece import FORMAT as WORDPIECE, WordPieceVocabulary

CaptionVocabulary = Vocabulary | WordPieceVocabulary


def vocabulary_from_json(data: dict, where: str = "vocabulary") -> CaptionVocabulary:
    """The vocabulary stored as ``data`` (``where``: what it was read from, for messages)."""
    if isinstance(data, dict) and data.get("format") == WORDPIECE:
        return WordPieceVocabulary.from_json(data, where)
    return Vocabulary.from_json(data, where)


def load_vocabulary(path: str | os.PathLike) -> CaptionVocabulary:
    """The vocabulary stored in the JSON file ``path`` (one line when it is absent or no vocabulary)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"vocabulary {path} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not JSON ({exc})") from None
    return vocabulary_from_json(data, str(path))
