"""CoNLL-U (https://universaldependencies.org/format.html): the row, the sentence, and retr's one reader of it.

Written by the synthetic generator (:class:`ConlluRow`), read by the tree rules, the scheme conversion and the
concept vocabulary. The reader is the ``conllu`` package (a base dependency, pure Python): blank-line separated
sentences, ``# key = value`` comments (``sent_id``, ``text``, ``constituency`` kept), word lines of 10
tab-separated columns (``conllu`` also splits at two or more spaces; a line that then has more than 10 columns is
an error, never shifted); multiword-token lines (``1-2``) and empty nodes (``1.1``) are skipped. A sentence comes
out as a :class:`ConlluSentence` of :class:`ConlluRow` words; a malformed one raises :class:`ConlluError` with
a one-line reason. :func:`index_conllu` finds every sentence's byte offset in one pass over a file, so a large
file is read a block at a time (:func:`read_block`)."""
from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterator, Sequence, TextIO

import conllu
from conllu.exceptions import ParseException
from conllu.parser import parse_id_value

#: the 10 columns of a word line, in order (``conllu``'s names)
COLUMNS = ("id", "form", "lemma", "upos", "xpos", "feats", "head", "deprel", "deps", "misc")
#: an 11th column name: a line with more than 10 columns fills it (``conllu`` drops extra columns otherwise)
_EXTRA = "_more"
_FIELDS = COLUMNS + (_EXTRA,)
_COLUMN_SET = frozenset(COLUMNS)


def _raw(line: list[str], i: int) -> str:
    return line[i]


def _word_id(line: list[str], i: int):
    return parse_id_value(line[i])


#: every column kept as written, but the id (``conllu`` reads ``1``, ``1-2`` and ``1.1``): retr reads the few
#: columns it needs itself, faster than parsing FEATS, DEPS and MISC into dictionaries it never uses
_PARSERS = {name: _raw for name in _FIELDS}
_PARSERS["id"] = _word_id


class ConlluError(ValueError):
    """Text that is not CoNLL-U; the message is the one-line reason."""


@dataclass(frozen=True)
class ConlluRow:
    """The first eight columns of one CoNLL-U word line, as written, ``"_"`` for an empty one (but ``form``,
    kept as it is); ``id`` and ``head`` are 1-based (``head`` 0 for the root, −1 for ``_``). ``DEPS`` and ``MISC``
    are not kept (written as ``_``)."""

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
        """The form, under stanza's name for it."""
        return self.form

    def line(self) -> str:
        """The row as a tab-separated CoNLL-U line (10 columns, no newline; a head of −1 is ``_``)."""
        return "\t".join([str(self.id), self.form, self.lemma, self.upos, self.xpos, self.feats,
                          str(self.head) if self.head >= 0 else "_", self.deprel, "_", "_"])


@dataclass(frozen=True)
class ConlluSentence:
    """One parsed sentence: its words in order and the comments retr reads (``None`` when absent). The input of
    the tree rules and the scheme conversion, whether read from CoNLL-U or converted from stanza's output."""

    words: tuple[ConlluRow, ...]
    sent_id: str | None = None
    text: str | None = None
    #: the constituency parse, bracketed (shown by ``show-tree``; no tree rule reads it)
    constituency: str | None = None

    def conllu(self) -> str:
        """The sentence as a CoNLL-U block (comments ``sent_id``, ``text``, ``constituency``; ends with a blank
        line)."""
        head = [f"# sent_id = {self.sent_id}"] if self.sent_id else []
        head += [f"# text = {self.text}"] if self.text else []
        head += [f"# constituency = {self.constituency}"] if self.constituency else []
        return "\n".join(head + [w.line() for w in self.words]) + "\n\n"


def _column(value: str) -> str:
    return value if value else "_"


def _sentence(tokens: conllu.TokenList) -> ConlluSentence:
    words = []
    for token in tokens:
        if _EXTRA in token or not token.keys() >= _COLUMN_SET:  # extra names of CoNLL-U Plus columns are fine
            line = " ".join(str(v) for v in token.values())[:80]
            if _EXTRA not in token and len(token) >= len(COLUMNS):
                raise ConlluError(f"a '# global.columns' comment names the columns {' '.join(token)[:80]!r}, "
                                  f"not CoNLL-U's ID FORM LEMMA UPOS XPOS FEATS HEAD DEPREL DEPS MISC")
            found = "more than 10" if _EXTRA in token else str(len(token))
            raise ConlluError(f"a line of {found} columns (CoNLL-U has 10): {line!r}")
        wid = token["id"]
        if wid is None:
            raise ConlluError(f"a word line without an id (word {token['form']!r})")
        if not isinstance(wid, int):  # 1-2 (a multiword token) or 1.1 (an empty node): not a word of the tree
            continue
        head = token["head"]
        try:
            head = -1 if head == "_" else int(head)
        except ValueError:
            raise ConlluError(f"word {wid} {token['form']!r} has head {head!r}, not a word id") from None
        words.append(ConlluRow(wid, token["form"], _column(token["lemma"]), _column(token["upos"]),
                               _column(token["xpos"]), _column(token["feats"]), head, _column(token["deprel"])))
    meta = tokens.metadata
    return ConlluSentence(tuple(words), meta.get("sent_id"), meta.get("text"), meta.get("constituency"))


def _sentences(handle: TextIO, numbered: bool = False) -> Iterator[ConlluSentence]:
    """The sentences of an open text file, in order (blocks of comments only are skipped); ``numbered``: an
    error names the sentence."""
    sentences = conllu.parse_incr(handle, fields=_FIELDS, field_parsers=_PARSERS)
    number = 0
    while True:
        try:
            tokens = next(sentences)
            if not len(tokens):
                continue
            number += 1
            sentence = _sentence(tokens)
        except StopIteration:
            return
        except (ParseException, ConlluError) as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise ConlluError(f"sentence {number + (not isinstance(exc, ConlluError))}: {reason}" if numbered
                              else reason) from None
        yield sentence


def parse_conllu(text: str) -> list[ConlluSentence]:
    """Every sentence of a CoNLL-U text; :class:`ConlluError` (one line) for the first malformed one."""
    return list(_sentences(io.StringIO(text)))


def read_conllu(path: str | os.PathLike) -> Iterator[ConlluSentence]:
    """The sentences of a CoNLL-U file, one at a time (UTF-8; bytes that are not are replaced). A malformed
    sentence raises :class:`ConlluError` naming its number; a missing file ``FileNotFoundError``."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        yield from _sentences(handle, numbered=True)


# ---------------------------------------------------------------------------------------- blocks at byte offsets

@dataclass(frozen=True)
class ConlluBlock:
    """Where one sentence lies in a file (``offset`` and ``length`` in bytes, comments included) and its
    ``sent_id`` and ``text`` comments (``None`` when absent)."""

    offset: int
    length: int
    sent_id: str | None
    text: str | None


#: one sentence's word lines as ``(id, upos, head, deprel)`` strings, CoNLL-U columns 1, 4, 7 and 8
RowColumns = Sequence[tuple[str, str, str, str]]


def _comment(line: str) -> tuple[str, str] | None:
    """``# key = value`` → ``(key, value)``, both stripped; ``None`` for a comment without ``=``."""
    key, sep, value = line[1:].partition("=")
    return (key.strip(), value.strip()) if sep else None


def index_conllu(path: str | os.PathLike, rows: Callable[[RowColumns], None] | None = None) -> list[ConlluBlock]:
    """Every sentence of a CoNLL-U file as a :class:`ConlluBlock`, in one pass that reads no word line beyond
    splitting it; ``rows``, when given, is called with each sentence's word lines (multiword tokens and empty
    nodes left out) — how the scheme detection counts labels in the same pass."""
    blocks: list[ConlluBlock] = []
    start, sent_id, text, has_rows, found = None, None, None, False, []
    offset = 0
    with open(path, "rb") as handle:
        for raw in handle:
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if not line.strip():
                if start is not None and has_rows:
                    blocks.append(ConlluBlock(start, offset - start, sent_id, text))
                    if rows is not None:
                        rows(found)
                start, sent_id, text, has_rows, found = None, None, None, False, []
            else:
                if start is None:
                    start = offset
                if line.startswith("#"):
                    pair = _comment(line)
                    if pair is not None and pair[0] == "sent_id":
                        sent_id = pair[1]
                    elif pair is not None and pair[0] == "text":
                        text = pair[1]
                else:
                    has_rows = True
                    if rows is not None:
                        cols = line.split("\t", 8)
                        if len(cols) > 7 and cols[0].isdigit():  # not a range (1-2) or empty node (1.1)
                            found.append((cols[0], cols[3], cols[6], cols[7]))
            offset += len(raw)
    if start is not None and has_rows:
        blocks.append(ConlluBlock(start, offset - start, sent_id, text))
        if rows is not None:
            rows(found)
    return blocks


def read_block(handle: BinaryIO, block: ConlluBlock) -> str:
    """The text of ``block`` from a file opened in binary mode, ending with one blank line."""
    handle.seek(block.offset)
    return handle.read(block.length).decode("utf-8", errors="replace").rstrip("\n") + "\n\n"
