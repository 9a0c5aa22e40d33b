"""The CoNLL-U row: one word of a dependency-parsed sentence (https://universaldependencies.org/format.html).

CoNLL-U files are handed between stages (the synthetic dataset's gold ``captions.conllu``, parses made
elsewhere) and read by ``parse-trees`` and ``build-concepts``. The synthetic generator writes rows of this type
(:mod:`retr.manifests.synthetic`) and the referral-tree rules read parsed words as rows of this type
(:class:`retr.parsers.referral_tree.DependencySentence`); reading a file is left to stanza's CoNLL-U reader. Sentences converted from another label scheme
(:mod:`retr.parsers.schemes`) are lists of these rows.
"""
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
