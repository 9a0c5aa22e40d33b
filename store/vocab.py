"""Caption vocabulary and tokenisation (SCAN's scheme and file format; needs no downloaded data).

Tokens, thresholds and ids: docs/trainer.md ("Training options in detail", Vocabulary)."""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from collections.abc import Sequence
from typing import Iterable

import numpy as np

from retr.common.atomic import atomic_text
from retr.common.errors import UserError
from retr.common.progress import progress

PAD, START, END, UNK = "<pad>", "<start>", "<end>", "<unk>"
SPECIALS = (PAD, START, END, UNK)
PAD_ID, START_ID, END_ID, UNK_ID = 0, 1, 2, 3
DEFAULT_THRESHOLD = 4

#: Closed-class English words (determiners, pronouns, prepositions, conjunctions, auxiliaries, numerals, a few
#: adverbs), as the tokenizer writes them: the words a content-word list leaves out (no POS tagger and no NLTK
#: stopword data are assumed). Used by ``build-concepts``' frequency fallback
#: (:func:`retr.pipeline.concepts.fallback_words`) and JGCAR's caption-concept labels
#: (:func:`retr.trainers.models.side_inputs.caption_concepts`, which skips a few more words, see there).
FUNCTION_WORDS = frozenset("""
a an the this that these those there here some any each every no all both either neither another other such
i me my mine we us our ours you your yours he him his she her hers it its they them their theirs one ones
who whom whose which what where when why how that's it's there's
of in on at by for from to with without into onto over under above below near behind beside besides between
among around through across along against toward towards up down out off about after before during until upon
within inside outside beneath underneath next than via per like
and or but nor so yet as if while because though although whether
is are was were be been being am 's do does did done have has had having will would can could shall should
may might must not n't
one two three four five six seven eight nine ten several many much more most few less
very too also just only then now again still even
""".split())


@functools.cache
def _tokenizer():
    from nltk.tokenize.destructive import NLTKWordTokenizer  # cost: nltk takes ~0.5 s, imported on first use

    return NLTKWordTokenizer()


#: captions :func:`tokenize` splits itself: ASCII lower-case letters, digits, spaces, hyphens, commas and
#: apostrophes, and at most one period, the last character before trailing spaces. On these NLTK's rules reduce
#: to: commas are tokens, the final period is a token, a word's clitic is a token of its own (``dog's`` → ``dog
#: 's``, ``don't`` → ``do n't``), the rest splits on spaces …
_PLAIN = re.compile(r"[a-z0-9 ,'\-]*\.? *")
#: … where every apostrophe is such a clitic's: ``'s 'm 'd 'll 're 've`` or ``n't`` after a word character or a
#: hyphen, ending the word (before a space, a comma, the period or the end) …
_CLITIC = re.compile(r"(?:(?<=[a-z0-9\-])'(?:s|m|d|ll|re|ve)|(?<=[a-z0-9\-]n)'t)(?=[ ,.]|$)")
#: … and none of these occurs, which go to NLTK: a double dash, two commas in a row (NLTK splits a run of
#: commas its own way), the words NLTK's contraction rules split (``cannot`` → ``can not``, ``gonna`` → ``gon
#: na`` …: anywhere in the caption, since a clitic split off first can make a word of them) …
_NOT_PLAIN = ("--", ",,", "cannot", "gimme", "gonna", "gotta", "lemme", "wanna")
#: … or a comma before a digit (NLTK keeps ``3,000`` whole)
_COMMA_DIGIT = re.compile(r",[0-9]")


def _split_clitic(word: str) -> list[str]:
    """``dog's`` → ``[dog, 's]``, ``don't`` → ``[do, n't]`` (a word :data:`_CLITIC` vouched for)."""
    at = word.find("'")
    if at < 0:
        return [word]
    at = at - 1 if word.endswith("n't") else at
    return [word[:at], word[at:]]


def _plain_tokens(text: str) -> list[str] | None:
    """NLTK's tokens of a lower-cased caption of :data:`_PLAIN`'s form, computed without its ~40 regular
    expressions (the same tokens: tests/test_vocab.py checks them against NLTK); None for any other caption."""
    if _PLAIN.fullmatch(text) is None:
        return None
    if any(part in text for part in _NOT_PLAIN) or ("," in text and _COMMA_DIGIT.search(text)):
        return None
    apostrophes = text.count("'")
    if apostrophes and len(_CLITIC.findall(text)) != apostrophes:
        return None
    body = text.rstrip(" ")
    final = []
    if body.endswith("."):
        body, final = body[:-1], ["."]
    words = body.replace(",", " , ").split()
    if apostrophes:
        words = [part for word in words for part in _split_clitic(word)]
    return words + final


def tokenize(caption: str) -> list[str]:
    """Lower-cased word tokens of one caption (no ``<start>``/``<end>``): NLTK's ``NLTKWordTokenizer``, which
    plain captions (most of COCO's and Flickr30K's) skip for the same tokens computed directly, ~50× faster."""
    text = caption.lower()
    plain = _plain_tokens(text)
    return plain if plain is not None else _tokenizer().tokenize(text)


class Vocabulary:
    """Word ↔ id mapping; ``encode`` turns a caption into ids with ``<start>``/``<end>``."""

    def __init__(self, words: Iterable[str] = ()):
        self.word2idx: dict[str, int] = {}
        self.idx2word: list[str] = []
        for word in (*SPECIALS, *words):
            self.add(word)

    def add(self, word: str) -> int:
        if word not in self.word2idx:
            self.word2idx[word] = len(self.idx2word)
            self.idx2word.append(word)
        return self.word2idx[word]

    def __len__(self) -> int:
        return len(self.idx2word)

    def __contains__(self, word: str) -> bool:
        return word in self.word2idx

    def __call__(self, word: str) -> int:
        return self.word2idx.get(word, UNK_ID)

    def encode(self, caption: str) -> list[int]:
        """Ids ``[<start>, w1 … wn, <end>]`` of a caption (unknown words → ``<unk>``)."""
        return [START_ID, *(self(w) for w in tokenize(caption)), END_ID]

    def decode(self, ids: Iterable[int]) -> list[str]:
        return [self.idx2word[int(i)] for i in ids]

    def unknown_words(self, caption: str) -> list[str]:
        """The words of ``caption`` outside the vocabulary (read as ``<unk>``)."""
        return [w for w in tokenize(caption) if w not in self]

    @classmethod
    def build(cls, captions: Iterable[str], threshold: int = DEFAULT_THRESHOLD) -> "Vocabulary":
        """Vocabulary of the words occurring at least ``threshold`` times (first-appearance order)."""
        return TokenizedCaptions.of(captions, quiet=True).vocabulary(threshold=threshold)

    # -- files (SCAN's format) ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"word2idx": dict(self.word2idx), "idx2word": {str(i): w for i, w in enumerate(self.idx2word)},
                "idx": len(self.idx2word)}

    def save(self, path: str | os.PathLike) -> Path:
        return write_vocabulary_json(path, self.to_json())

    @classmethod
    def from_json(cls, data: dict, where: str = "vocabulary") -> "Vocabulary":
        try:
            idx2word = {int(k): str(v) for k, v in data["idx2word"].items()}
        except (KeyError, AttributeError, ValueError, TypeError):
            raise UserError(f"{where}: not a SCAN vocabulary (needs 'idx2word': {{\"0\": \"<pad>\", …}})") from None
        if sorted(idx2word) != list(range(len(idx2word))):
            raise UserError(f"{where}: idx2word ids are not 0..{len(idx2word) - 1}")
        words = [idx2word[i] for i in range(len(idx2word))]
        if tuple(words[:4]) != SPECIALS:
            raise UserError(f"{where}: ids 0-3 must be {' '.join(SPECIALS)}, found {' '.join(words[:4])}")
        vocab = cls(words[4:])
        if len(vocab) != len(words):
            raise UserError(f"{where}: idx2word lists a word twice")
        word2idx = data.get("word2idx")
        if isinstance(word2idx, dict) and any(vocab.word2idx.get(w) != int(i) for w, i in word2idx.items()):
            raise UserError(f"{where}: word2idx and idx2word disagree")
        return vocab

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Vocabulary":
        return cls.from_json(read_vocabulary_json(path), str(path))


# -- captions tokenised once --------------------------------------------------------------------------------
def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])`` without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    return np.repeat(np.asarray(starts, dtype=np.int64) - ends + lengths, lengths) + np.arange(total)


class TokenLists(Sequence):
    """Many captions' token ids in one flat array: item ``m`` is caption ``m``'s ids as a list (``ids`` ``[T]``
    int32, ``offsets`` ``[M + 1]``: caption ``m`` is ``ids[offsets[m]:offsets[m + 1]]``). A list of lists holds a
    Python object per id; COCO's 566,435 training captions take ~40 MB here instead of ~250 MB."""

    def __init__(self, ids: np.ndarray, offsets: np.ndarray):
        self.ids, self.offsets = np.asarray(ids, dtype=np.int32), np.asarray(offsets, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, m):
        if isinstance(m, slice):
            return [self[i] for i in range(*m.indices(len(self)))]
        return self.ids[self.offsets[m]:self.offsets[m + 1]].tolist()

    def lengths(self) -> np.ndarray:
        """``[M]`` each caption's number of ids."""
        return np.diff(self.offsets)

    def subset(self, captions: np.ndarray) -> "TokenLists":
        """The lists of ``captions`` (indices, in that order)."""
        captions = np.asarray(captions, dtype=np.int64)
        lengths = self.offsets[captions + 1] - self.offsets[captions]
        return TokenLists(self.ids[concat_ranges(self.offsets[captions], lengths)],
                          np.concatenate([[0], np.cumsum(lengths)]))


#: captions whose words :meth:`TokenizedCaptions.of` numbers together
TOKENISE_BLOCK = 16384


class TokenizedCaptions:
    """Every caption's word tokens, tokenised once: ``words`` the distinct words in order of first appearance,
    ``tokens`` their ids per caption. The vocabulary (:meth:`vocabulary`) and the encoded captions
    (:meth:`encode`) both come from it, so a training start tokenises each caption once."""

    def __init__(self, words: list[str], tokens: TokenLists):
        self.words, self.tokens = words, tokens

    @classmethod
    def of(cls, captions: Iterable[str], total: int | None = None, quiet: bool = False) -> "TokenizedCaptions":
        """Tokenise ``captions`` (:func:`tokenize`), with a progress bar (``total``: their number, if known).

        Words get their ids a block of :data:`TOKENISE_BLOCK` captions at a time (one dictionary look-up per word
        in C, not a Python call), so the pass costs little more than the tokenizer itself."""
        index: dict[str, int] = {}
        ids: list[np.ndarray] = []
        lengths: list[int] = []
        words: list[str] = []

        def flush() -> None:
            for word in dict.fromkeys(words):                  # new words in order of first appearance
                index.setdefault(word, len(index))
            ids.append(np.fromiter(map(index.__getitem__, words), dtype=np.int32, count=len(words)))
            words.clear()

        for n, caption in enumerate(progress(captions, total=total, desc="tokenise captions", unit="caption",
                                             quiet=quiet), start=1):
            tokens = tokenize(caption)
            words.extend(tokens)
            lengths.append(len(tokens))
            if n % TOKENISE_BLOCK == 0:
                flush()
        flush()
        offsets = np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))])
        return cls(list(index), TokenLists(np.concatenate(ids), offsets))

    def __len__(self) -> int:
        return len(self.tokens)

    def vocabulary(self, captions: np.ndarray | None = None, threshold: int = DEFAULT_THRESHOLD) -> Vocabulary:
        """The :class:`Vocabulary` of ``captions`` (indices; default: all), as :meth:`Vocabulary.build` makes it
        from their texts: the words seen at least ``threshold`` times there, in order of first appearance there."""
        tokens = self.tokens if captions is None else self.tokens.subset(captions)
        counts = np.bincount(tokens.ids, minlength=len(self.words))
        seen, first = np.unique(tokens.ids, return_index=True)
        order = seen[np.argsort(first, kind="stable")]
        return Vocabulary(self.words[w] for w in order
                          if counts[w] >= threshold and self.words[w] not in SPECIALS)

    def encode(self, vocab: Vocabulary, captions: np.ndarray | None = None) -> TokenLists:
        """``[<start>, w1 … wn, <end>]`` ids of ``captions`` (indices; default: all) in ``vocab``, as
        :meth:`Vocabulary.encode` gives them (unknown words → ``<unk>``)."""
        captions = np.arange(len(self)) if captions is None else np.asarray(captions, dtype=np.int64)
        in_vocab = np.fromiter((vocab(word) for word in self.words), dtype=np.int32, count=len(self.words))
        words = self.tokens.subset(captions)
        lengths = words.lengths() + 2
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        ids = np.empty(int(offsets[-1]), dtype=np.int32)
        ids[offsets[:-1]] = START_ID
        ids[offsets[1:] - 1] = END_ID
        ids[concat_ranges(offsets[:-1] + 1, lengths - 2)] = in_vocab[words.ids]
        return TokenLists(ids, offsets)


def read_vocabulary_json(path: str | os.PathLike) -> object:
    """The JSON a vocabulary file ``path`` holds (one line when it is absent or not JSON)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"vocabulary {path} does not exist")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not JSON ({exc})") from None


def write_vocabulary_json(path: str | os.PathLike, data: dict) -> Path:
    """Write a vocabulary's JSON ``data`` to ``path`` (atomically) and return the path."""
    with atomic_text(path) as handle:
        handle.write(json.dumps(data, ensure_ascii=False))
    return Path(path)
