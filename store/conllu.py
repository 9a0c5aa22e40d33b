"""The CoNLL-U row: one word of a dependency-parsed sentence (https://universaldependencies.org/format.html).

Written by the synthetic generator, read by the tree rules and the scheme conversion; files are read with stanza's
CoNLL-U reader."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConlluRow:
    """The first eight columns of one CoNLL-U word line; ``id`` and ``head`` are 1-based (``head`` 0 for the
    root). ``DEPS`` and ``MISC`` are not kept (written as ``_``)."""

    id: int
    form: str
    lemma: str
    upos: str
    xpos: str
    feats: str
    head: int
    deprel: str

    @property
    def text(self) -> str:
        """The form, under stanza's name for it (so a row can stand for a stanza ``Word``)."""
        return self.form

    def line(self) -> str:
        """The row as a tab-separated CoNLL-U line (10 columns, no newline)."""
        return "\t".join([str(self.id), self.form, self.lemma, self.upos, self.xpos, self.feats,
                          str(self.head), self.deprel, "_", "_"])
