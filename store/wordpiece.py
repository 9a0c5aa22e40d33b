"""BERT's WordPiece vocabulary and caption tokenisation (VSE∞'s BERT text encoder), in the form a run stores.

A caption becomes ``[CLS] pieces… [SEP]`` as the authors' ``process_caption`` makes it (woodfrog/vse_infty,
``master``): BERT's basic tokenizer (control characters dropped, CJK characters set apart, lower-cased and accents
stripped for an uncased vocabulary, split on whitespace and punctuation), then WordPiece on each word (greedy
longest match, ``##`` continuations; a word that cannot be cut, or of more than 100 characters, is ``[UNK]``).
The work is done by Hugging Face's ``tokenizers`` (the ``bert`` extra), whose ``BertNormalizer``,
``BertPreTokenizer`` and ``WordPiece`` are those steps; no special token is matched in the text, as their basic
tokenizer matches none (tests/test_golden_vse_infinity_bert.py holds the authors' own ids of tricky captions).

The vocabulary is stored as JSON (``vocab.json`` of a run or an export, a checkpoint's ``vocab``): the tokens in id
order and the tokenizer's settings, so a run tokenises offline exactly as it was trained. BERT's own ``vocab.txt``
(one token a line) is read by :meth:`WordPieceVocabulary.read_txt`.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from retr.common.errors import UserError
from retr.common.optional import require
from retr.common.progress import progress
from retr.common.textfiles import read_utf8
from retr.store.vocab import TokenLists, write_vocabulary_json

#: the ``format`` of the stored JSON
FORMAT = "wordpiece"
PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIALS = (PAD, UNK, CLS, SEP, MASK)
#: a continuation piece's prefix
CONTINUATION = "##"
#: BERT's basic tokenizer leaves a longer word whole, and WordPiece makes it ``[UNK]``
MAX_WORD_CHARS = 100
#: captions :meth:`WordPieceVocabulary.encode_all` hands the tokenizer at a time (one progress step each)
ENCODE_BLOCK = 16384


class WordPieceVocabulary:
    """WordPiece tokens ↔ ids and the tokenisation of captions into ``[CLS] … [SEP]`` ids (module docstring).

    ``tokens``: the vocabulary in id order (BERT's ``vocab.txt``); ``lowercase`` (uncased models), ``strip_accents``
    (None: as ``lowercase``) and ``chinese_chars`` are BERT's tokenizer settings; ``max_length``: the most ids a
    caption gets, ``[CLS]``/``[SEP]`` included (BERT's position table; longer captions keep their first pieces);
    ``source``: where the vocabulary came from (a Hub name or a folder), for messages."""

    def __init__(self, tokens: Sequence[str], lowercase: bool = True, strip_accents: bool | None = None,
                 chinese_chars: bool = True, max_length: int = 512, source: str = "", where: str = "vocabulary"):
        self.idx2word = [str(t) for t in tokens]
        self.word2idx = {t: i for i, t in enumerate(self.idx2word)}
        if len(self.word2idx) != len(self.idx2word):
            twice = next(t for i, t in enumerate(self.idx2word) if self.word2idx[t] != i)
            raise UserError(f"{where}: the WordPiece token {twice!r} is listed twice")
        absent = [t for t in SPECIALS if t not in self.word2idx]
        if absent:
            raise UserError(f"{where} is not a BERT WordPiece vocabulary: it has no {', '.join(absent)}")
        if int(max_length) < 3:
            raise UserError(f"{where}: max_length {max_length} leaves no room for a word between [CLS] and [SEP]")
        self.lowercase, self.strip_accents, self.chinese_chars = bool(lowercase), strip_accents, bool(chinese_chars)
        self.max_length, self.source = int(max_length), str(source)
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (self.word2idx[t] for t in SPECIALS)

    def __len__(self) -> int:
        return len(self.idx2word)

    def __contains__(self, token: str) -> bool:
        return token in self.word2idx

    def __eq__(self, other) -> bool:
        return isinstance(other, WordPieceVocabulary) and self.to_json() == other.to_json()

    def describe(self) -> str:
        """``the WordPiece vocabulary of bert-base-uncased (30522 tokens)``."""
        return f"the WordPiece vocabulary{f' of {self.source}' if self.source else ''} ({len(self)} tokens)"

    # -- tokenising ------------------------------------------------------------------------------------------
    @functools.cached_property
    def _tokenizer(self):
        """The ``tokenizers.Tokenizer`` of these settings (built on first use: the ``bert`` extra)."""
        tk = require("tokenizers", "bert", "VSE∞'s BERT text encoder: its WordPiece captions")
        tokenizer = tk.Tokenizer(tk.models.WordPiece(dict(self.word2idx), unk_token=UNK,
                                                     continuing_subword_prefix=CONTINUATION,
                                                     max_input_chars_per_word=MAX_WORD_CHARS))
        tokenizer.normalizer = tk.normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=self.chinese_chars,
                                                             strip_accents=self.strip_accents,
                                                             lowercase=self.lowercase)
        tokenizer.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
        return tokenizer

    def __getstate__(self) -> dict:          # DataLoader workers get the vocabulary; the tokenizer is rebuilt there
        state = dict(self.__dict__)
        state.pop("_tokenizer", None)
        return state

    def words(self, caption: str) -> list[str]:
        """BERT's basic tokens of ``caption`` (the words WordPiece then cuts)."""
        tokenizer = self._tokenizer
        return [w for w, _ in tokenizer.pre_tokenizer.pre_tokenize_str(tokenizer.normalizer.normalize_str(caption))]

    def _framed(self, pieces: Sequence[int]) -> list[int]:
        return [self.cls_id, *pieces[:self.max_length - 2], self.sep_id]

    def encode(self, caption: str) -> list[int]:
        """Ids ``[CLS] pieces… [SEP]`` of one caption (at most ``max_length``)."""
        return self._framed(self._tokenizer.encode(caption, add_special_tokens=False).ids)

    def encode_all(self, captions: Sequence[str], quiet: bool = True) -> TokenLists:
        """:meth:`encode` of every caption, as one :class:`~retr.store.vocab.TokenLists` (the tokenizer's batches run
        on every core), with a progress bar unless ``quiet``."""
        ids: list[np.ndarray] = []
        lengths: list[np.ndarray] = []
        starts = range(0, len(captions), ENCODE_BLOCK)
        for start in progress(starts, total=len(starts), desc="tokenise captions (WordPiece)", unit="block",
                              quiet=quiet):
            block = [self._framed(e.ids) for e in
                     self._tokenizer.encode_batch(list(captions[start:start + ENCODE_BLOCK]), add_special_tokens=False)]
            lengths.append(np.fromiter(map(len, block), dtype=np.int64, count=len(block)))
            ids.append(np.fromiter((i for piece in block for i in piece), dtype=np.int32))
        counts = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
        return TokenLists(np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32),
                          np.concatenate([[0], np.cumsum(counts)]))

    def decode(self, ids: Iterable[int]) -> list[str]:
        return [self.idx2word[int(i)] for i in ids]

    def unknown_words(self, caption: str) -> list[str]:
        """The words of ``caption`` that WordPiece cannot cut (read as ``[UNK]``)."""
        encoding = self._tokenizer.encode(caption, add_special_tokens=False)
        words = self.words(caption)
        unknown = {w for w, i in zip(encoding.word_ids, encoding.ids) if i == self.unk_id and w is not None}
        return [words[w] for w in sorted(unknown)]

    def continuation(self) -> np.ndarray:
        """``[V]`` bool: whether each token continues a word (``##…``), so a word is its first piece and those after."""
        return np.fromiter((t.startswith(CONTINUATION) for t in self.idx2word), dtype=bool, count=len(self))

    # -- files -----------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": FORMAT, "tokens": list(self.idx2word), "lowercase": self.lowercase,
                "strip_accents": self.strip_accents, "chinese_chars": self.chinese_chars,
                "max_length": self.max_length, "source": self.source}

    def save(self, path: str | os.PathLike) -> Path:
        return write_vocabulary_json(path, self.to_json())

    @classmethod
    def from_json(cls, data: dict, where: str = "vocabulary") -> "WordPieceVocabulary":
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if data.get("format") != FORMAT or not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise UserError(f"{where}: not a stored WordPiece vocabulary (needs 'format': 'wordpiece' and 'tokens')")
        strip = data.get("strip_accents")
        return cls(tokens, lowercase=bool(data.get("lowercase", True)), strip_accents=None if strip is None else bool(strip),
                   chinese_chars=bool(data.get("chinese_chars", True)), max_length=int(data.get("max_length", 512)),
                   source=str(data.get("source", "")), where=where)

    @classmethod
    def read_txt(cls, path: str | os.PathLike, lowercase: bool = True, strip_accents: bool | None = None,
                 chinese_chars: bool = True, max_length: int = 512, source: str = "") -> "WordPieceVocabulary":
        """BERT's ``vocab.txt`` (one token a line, ids in line order) with the tokenizer's settings."""
        text = read_utf8(Path(path), "a BERT vocab.txt")
        tokens = text.split("\n")
        if tokens and tokens[-1] == "":
            tokens.pop()
        return cls([t.rstrip("\r") for t in tokens], lowercase, strip_accents, chinese_chars, max_length,
                   source or str(path), where=str(path))
