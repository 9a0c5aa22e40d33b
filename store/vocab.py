"""Caption vocabulary and tokenisation (SCAN's scheme and file format; needs no downloaded data).

Tokens, thresholds and ids: docs/trainer.md ("Training options in detail", Vocabulary)."""
from __future__ import annotations

import functools
import json
import os
from collections import Counter
from pathlib import Path
from typing import Iterable

from retr.common.atomic import atomic_text
from retr.common.errors import UserError

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
    from nltk.tokenize.destructive import NLTKWordTokenizer  # imported on first use: nltk takes ~0.5 s

    return NLTKWordTokenizer()


def tokenize(caption: str) -> list[str]:
    """Lower-cased word tokens of one caption (no ``<start>``/``<end>``)."""
    return _tokenizer().tokenize(caption.lower())


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

    @classmethod
    def build(cls, captions: Iterable[str], threshold: int = DEFAULT_THRESHOLD) -> "Vocabulary":
        """Vocabulary of the words occurring at least ``threshold`` times (first-appearance order)."""
        counts: Counter[str] = Counter()
        for caption in captions:
            counts.update(tokenize(caption))
        return cls(word for word, n in counts.items() if n >= threshold and word not in SPECIALS)

    # -- files (SCAN's format) ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"word2idx": dict(self.word2idx), "idx2word": {str(i): w for i, w in enumerate(self.idx2word)},
                "idx": len(self.idx2word)}

    def save(self, path: str | os.PathLike) -> Path:
        with atomic_text(path) as handle:
            handle.write(json.dumps(self.to_json(), ensure_ascii=False))
        return Path(path)

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
        path = Path(path)
        if not path.is_file():
            raise UserError(f"vocabulary {path} does not exist")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{path} is not JSON ({exc})") from None
        return cls.from_json(data, str(path))
