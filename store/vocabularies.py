"""A run's caption vocabulary, of either kind, read back from the JSON a run, an export or a checkpoint stores:
SCAN's word vocabulary (:class:`~retr.store.vocab.Vocabulary`, the ``{name}_vocab.json`` format) or BERT's WordPiece
vocabulary (:class:`~retr.store.wordpiece.WordPieceVocabulary`, ``"format": "wordpiece"``). Both give a caption's ids
(``encode``), the ids' tokens (``decode``), the words a caption has outside them (``unknown_words``), ``len`` and
``to_json``/``save``."""
from __future__ import annotations

import os

from retr.store.vocab import Vocabulary, read_vocabulary_json
from retr.store.wordpiece import FORMAT as WORDPIECE, WordPieceVocabulary

CaptionVocabulary = Vocabulary | WordPieceVocabulary


def vocabulary_from_json(data: dict, where: str = "vocabulary") -> CaptionVocabulary:
    """The vocabulary stored as ``data`` (``where``: what it was read from, for messages)."""
    if isinstance(data, dict) and data.get("format") == WORDPIECE:
        return WordPieceVocabulary.from_json(data, where)
    return Vocabulary.from_json(data, where)


def load_vocabulary(path: str | os.PathLike) -> CaptionVocabulary:
    """The vocabulary stored in the JSON file ``path`` (one line when it is absent or no vocabulary)."""
    return vocabulary_from_json(read_vocabulary_json(path), str(path))
