"""BERT's WordPiece vocabulary as a run stores it (``store/wordpiece.py``): the stored JSON read back to the same
tokenisation, BERT's ``vocab.txt`` read, captions cut to BERT's positions, the words it cannot cut, and a file that
is no WordPiece vocabulary refused in one line. The tokenisation itself against the authors' ``process_caption``:
``tests/test_golden_vse_infinity_bert.py``."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers", reason="the bert extra is not installed: pip install 'retr[bert]'")

from retr.common.errors import UserError  # noqa: E402
from retr.store.vocabularies import load_vocabulary  # noqa: E402
from retr.store.wordpiece import WordPieceVocabulary  # noqa: E402

TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "a", "red", "ball", "sk", "##ate", "##board"]


def test_stored_json_reads_back_to_the_same_tokenisation(tmp_path):
    vocab = WordPieceVocabulary(TOKENS, max_length=16, source="tiny")
    path = vocab.save(tmp_path / "vocab.json")
    back = load_vocabulary(path)
    assert isinstance(back, WordPieceVocabulary) and back == vocab
    caption = "A red Skateboard."
    assert back.encode(caption) == vocab.encode(caption) == [2, 6, 7, 9, 10, 11, 5, 3]
    assert back.decode(back.encode(caption)) == ["[CLS]", "a", "red", "sk", "##ate", "##board", ".", "[SEP]"]
    assert vocab.continuation().tolist() == [t.startswith("##") for t in TOKENS]


def test_vocab_txt_and_the_words_it_cannot_cut(tmp_path):
    (tmp_path / "vocab.txt").write_text("".join(t + "\n" for t in TOKENS), encoding="utf-8")
    vocab = WordPieceVocabulary.read_txt(tmp_path / "vocab.txt", max_length=16)
    assert vocab.idx2word == TOKENS and vocab.mask_id == 4 and vocab.pad_id == 0
    assert vocab.unknown_words("a red zebra on a skateboard, a Zebra") == ["zebra", "on", ",", "zebra"]
    assert vocab.encode("zebra") == [2, 1, 3]


def test_a_long_caption_keeps_its_first_pieces_and_sep():
    vocab = WordPieceVocabulary(TOKENS, max_length=5)
    assert vocab.encode("a red ball a red") == [2, 6, 7, 8, 3]
    lists = vocab.encode_all(["a red ball a red", "ball"])
    assert [list(map(int, lists[i])) for i in range(2)] == [[2, 6, 7, 8, 3], [2, 8, 3]]


@pytest.mark.parametrize("tokens, data, expected", [
    (["[PAD]", "[UNK]", "a"], None, "is not a BERT WordPiece vocabulary: it has no [CLS], [SEP], [MASK]"),
    ([*TOKENS, "red"], None, "the WordPiece token 'red' is listed twice"),
    (None, {"format": "wordpiece", "tokens": "abc"}, "not a stored WordPiece vocabulary"),
])
def test_a_file_that_is_no_wordpiece_vocabulary_is_one_line(tmp_path, tokens, data, expected):
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps(data if data is not None else {"format": "wordpiece", "tokens": tokens}))
    with pytest.raises(UserError) as info:
        load_vocabulary(path)
    assert expected in str(info.value) and "\n" not in str(info.value)
