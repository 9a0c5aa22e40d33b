"""store/vocab.py: the tokenizer's plain-caption path equals NLTK's, and one tokenising pass gives the vocabulary
and the encoded captions the per-caption methods give."""
from __future__ import annotations

import random

import numpy as np
import pytest

from retr.store import vocab as vocab_module
from retr.store.vocab import (END_ID, START_ID, TokenizedCaptions, TokenLists, Vocabulary, _plain_tokens,
                              concat_ranges, tokenize)

#: pieces of random captions: the plain alphabet, and every case the plain path must hand to NLTK (a comma
#: before a digit or a comma, a double dash, several periods, a period inside, contraction words, quotes,
#: apostrophes, brackets and other punctuation)
PIECES = (list("ab0 ,.-'n") + ["cannot", "gonna", " wanna ", "gimme", "gotta", "lemme", "3,000", "..", "--", "x",
                                "'s", "'", '"', "(", ")", "?", "!", ";", ":", "é", "\t", "dog's", "n't", "'ll",
                                "'re", "'ve", "'m", "'d", "'t", "s'", "'tis", "can't", " 'em", "d'ye", "more'n"])


def test_plain_path_gives_nltks_tokens_on_random_captions():
    nltk = vocab_module._tokenizer()
    rng = random.Random(7)
    plain = 0
    for _ in range(60_000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 14)))
        fast = _plain_tokens(text)
        if fast is not None:
            plain += 1
            assert fast == nltk.tokenize(text), repr(text)
        assert tokenize(text) == nltk.tokenize(text.lower()), repr(text)
    assert plain > 5_000          # the plain path was exercised, not only the fallback


@pytest.mark.parametrize("caption, plain", [
    ("A man riding a wave on top of a surfboard.", True),
    ("two dogs, a cat and 3 birds in a t-shirt .  ", True),
    ("a dog,", True),
    (".", True),
    ("", True),
    ("A woman's hand holding a cell phone.", True),       # a clitic: 's is a token of its own
    ("the dog doesn't want its owners' ball", False),      # an apostrophe ending a word: NLTK's rules
    ("a crowd of 3,000 people", False),                    # NLTK keeps 3,000 whole
    ("a man who cannot swim", False),                      # NLTK splits can not
    ("st. louis at night", False),                         # a period inside
    ("what is this?", False),
])
def test_which_captions_take_the_plain_path(caption, plain):
    assert (_plain_tokens(caption.lower()) is not None) == plain
    assert tokenize(caption) == vocab_module._tokenizer().tokenize(caption.lower())


CAPTIONS = ["A dog runs on the grass.", "a dog sits", "A cat's toy, a red ball.", "two dogs run", "a dog runs",
            "the cat sits on a mat", "A dog and a cat.", "cats cannot fly", "a dog", "the grass"]


def test_one_pass_vocabulary_equals_counting_every_caption():
    tokenized = TokenizedCaptions.of(CAPTIONS, quiet=True)
    expected_words = [w for w, n in _counts(CAPTIONS).items() if n >= 2]
    assert Vocabulary.build(CAPTIONS, threshold=2).idx2word[4:] == expected_words
    assert tokenized.vocabulary(threshold=2).idx2word[4:] == expected_words
    # a subset's vocabulary: counts and first-appearance order over those captions only
    subset = np.array([7, 2, 5])
    sub_captions = [CAPTIONS[i] for i in subset]
    assert tokenized.vocabulary(subset, 1).idx2word[4:] == list(_counts(sub_captions))


def _counts(captions):
    counts: dict[str, int] = {}
    for caption in captions:
        for word in tokenize(caption):
            counts[word] = counts.get(word, 0) + 1
    return counts


def test_one_pass_encoding_equals_encoding_each_caption():
    vocab = Vocabulary.build(CAPTIONS, threshold=2)
    tokenized = TokenizedCaptions.of(CAPTIONS, quiet=True)
    encoded = tokenized.encode(vocab)
    assert [encoded[m] for m in range(len(CAPTIONS))] == [vocab.encode(c) for c in CAPTIONS]
    chosen = np.array([4, 0, 9])
    assert tokenized.encode(vocab, chosen)[:] == [vocab.encode(CAPTIONS[m]) for m in chosen]
    assert all(t[0] == START_ID and t[-1] == END_ID for t in encoded)


def test_each_caption_is_tokenised_once(monkeypatch):
    calls = []
    real = vocab_module.tokenize
    monkeypatch.setattr(vocab_module, "tokenize", lambda caption: calls.append(caption) or real(caption))
    tokenized = TokenizedCaptions.of(CAPTIONS, quiet=True)
    vocab = tokenized.vocabulary(threshold=2)
    tokenized.encode(vocab)
    tokenized.encode(vocab, np.array([1, 2]))
    assert calls == CAPTIONS


def test_token_lists_index_and_subset():
    lists = TokenLists(np.array([5, 6, 7, 8, 9], dtype=np.int32), np.array([0, 2, 2, 5]))
    assert len(lists) == 3 and lists[0] == [5, 6] and lists[1] == [] and lists[2] == [7, 8, 9]
    assert list(lists.lengths()) == [2, 0, 3]
    assert lists.subset(np.array([2, 0]))[:] == [[7, 8, 9], [5, 6]]
    assert list(concat_ranges(np.array([3, 10]), np.array([2, 3]))) == [3, 4, 10, 11, 12]
    assert concat_ranges(np.array([], dtype=np.int64), np.array([], dtype=np.int64)).size == 0
