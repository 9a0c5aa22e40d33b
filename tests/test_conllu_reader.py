"""retr's CoNLL-U reader (store/conllu.py): the columns and comments the tree rules, the scheme conversion and the
concepts read; multiword tokens and empty nodes skipped; blocks found at byte offsets; malformed text refused in
one line; and, where stanza is installed, the very sentences (so the very trees) stanza's own reader gave on every
test file and on the synthetic set."""
from __future__ import annotations

from pathlib import Path

import pytest

from retr.common.errors import UserError
from retr.manifests.synthetic import generate_synthetic
from retr.parsers.backends import ConlluBackend, sentence_from_stanza
from retr.parsers.referral_tree import TreeRules, build_tree
from retr.parsers.schemes import SCHEMES, SchemeConverter, detect_scheme
from retr.store.conllu import (ConlluBlock, ConlluError, ConlluRow, ConlluSentence, index_conllu, parse_conllu,
                               read_block, read_conllu)

DATA = Path(__file__).parent / "data"
FIXTURES = sorted(DATA.glob("**/*.conllu"))

#: a multiword token (2-3), an empty node (3.1), an empty lemma column, a head of "_", comments of every form
TEXT = ("# newdoc id = d1\n"
        "#sent_id=a#0\n"
        "# text = Don't sit = stand\n"
        "# constituency = (ROOT (S (VP (VB Do) (RB n't) (VP (VB sit)))))\n"
        "# note = not read\n"
        "1\tDo\tdo\tAUX\tVB\tMood=Imp|VerbForm=Fin\t4\taux\t_\tSpaceAfter=No\n"
        "2-3\tn't sit\t_\t_\t_\t_\t_\t_\t_\t_\n"
        "2\tn't\t\tPART\tRB\t_\t4\tadvmod\t_\t_\n"
        "3\tsit\tsit\tVERB\tVB\t_\t_\tdep\t_\t_\n"
        "3.1\tsits\tsit\tVERB\t_\t_\t_\t_\t4:conj\t_\n"
        "4\tstand\tstand\tVERB\tVB\tVerbForm=Inf\t0\troot\t_\t_\n"
        "\n"
        "# a block of comments only\n"
        "\n"
        "# sent_id = b#0\n"
        "1\tdogs\t_\t_\t_\t_\t0\t_\t_\t_\n")


def test_reader_keeps_the_columns_and_comments_retr_reads():
    first, second = parse_conllu(TEXT)
    assert first == ConlluSentence(
        (ConlluRow(1, "Do", "do", "AUX", "VB", "Mood=Imp|VerbForm=Fin", 4, "aux"),
         ConlluRow(2, "n't", "_", "PART", "RB", "_", 4, "advmod"),
         ConlluRow(3, "sit", "sit", "VERB", "VB", "_", -1, "dep"),
         ConlluRow(4, "stand", "stand", "VERB", "VB", "VerbForm=Inf", 0, "root")),
        sent_id="a#0", text="Don't sit = stand", constituency="(ROOT (S (VP (VB Do) (RB n't) (VP (VB sit)))))")
    assert second == ConlluSentence((ConlluRow(1, "dogs", "_", "_", "_", "_", 0, "_"),), sent_id="b#0")
    assert [s.sent_id for s in parse_conllu(TEXT.replace("\n", "\r\n"))] == ["a#0", "b#0"]


def test_a_sentence_written_back_reads_the_same():
    for path in FIXTURES:
        for sentence in read_conllu(path):
            assert parse_conllu(sentence.conllu()) == [sentence], path
    assert ConlluRow(2, "n't", "_", "PART", "RB", "_", -1, "advmod").line() == "2\tn't\t_\tPART\tRB\t_\t_\tadvmod\t_\t_"


@pytest.mark.parametrize("row, reason", [
    ("1\ta\ta\tDET", "a line of 4 columns (CoNLL-U has 10): '1 a a DET'"),
    ("1\ta\ta\tDET\tDT\t_\t2\tdet\t_\t_\textra", "a line of more than 10 columns (CoNLL-U has 10)"),
    ("1\ta\ta\tDET\tDT\t_\tx\tdet\t_\t_", "word 1 'a' has head 'x', not a word id"),
    ("one\ta\ta\tDET\tDT\t_\t2\tdet\t_\t_", "'one' is not a valid ID"),
    ("a dog on a bed", "line must contain either tabs or two spaces"),
    ("# global.columns = A B C D E F G H I J\n1\t2\t3\t4\t5\t6\t7\t8\t9\t10",
     "a '# global.columns' comment names the columns 'a b c d e f g h i j'"),
])
def test_malformed_text_is_one_line(tmp_path, row, reason):
    good = "# sent_id = a#0\n1\tdog\tdog\tNOUN\tNN\t_\t0\troot\t_\t_\n\n"
    with pytest.raises(ConlluError) as info:
        parse_conllu(good + row + "\n")
    assert reason in str(info.value) and "\n" not in str(info.value)
    path = tmp_path / "bad.conllu"
    path.write_text(good + "# comments only\n\n" + row + "\n")
    with pytest.raises(ConlluError, match=r"^sentence 2: ") as info:
        list(read_conllu(path))
    assert reason in str(info.value) and "\n" not in str(info.value)


def test_index_finds_every_block_at_its_byte_offset(tmp_path):
    text = ("# sent_id = café#0\r\n# text = un café\r\n"
            "1\tun\tun\tDET\t_\t_\t2\tdet\t_\t_\r\n2\tcafé\tcafé\tNOUN\t_\t_\t0\troot\t_\t_\r\n\r\n"
            "# comments only\n\n" + TEXT)   # the last block ends without a blank line
    path = tmp_path / "mixed.conllu"
    path.write_bytes(text.encode("utf-8"))
    seen = []
    blocks = index_conllu(path, seen.append)
    assert [(b.sent_id, b.text) for b in blocks] == [("café#0", "un café"), ("a#0", "Don't sit = stand"),
                                                      ("b#0", None)]
    assert blocks[0] == ConlluBlock(0, len(text.split("\r\n\r\n")[0].encode()) + 2, "café#0", "un café")
    with open(path, "rb") as handle:
        read = [parse_conllu(read_block(handle, block)) for block in blocks]
    assert [found for found, in read] == parse_conllu(text)
    assert read[0][0].words[1].form == "café"
    # the rows the scheme detection counts: word lines only, as written (id, upos, head, deprel)
    assert seen == [[("1", "DET", "2", "det"), ("2", "NOUN", "0", "root")],
                    [("1", "AUX", "4", "aux"), ("2", "PART", "4", "advmod"), ("3", "VERB", "_", "dep"),
                     ("4", "VERB", "0", "root")],
                    [("1", "_", "0", "_")]]


def test_backend_reads_words_only_and_names_a_broken_block(tmp_path):
    path = tmp_path / "c.conllu"
    path.write_text(TEXT + "\n# sent_id = bad#0\n1\ta\ta\tDET\n\n")
    backend = ConlluBackend(path)
    assert [w.id for w in backend.find_key("a#0").words] == [1, 2, 3, 4]
    assert str(build_tree(backend.find_key("a#0"))) == "[null null null stand null null null]"
    offset = backend.blocks[2].offset
    with pytest.raises(UserError) as info:
        backend.find_key("bad#0")
    assert str(info.value) == (f"{path}: the sentence at byte {offset} is not readable CoNLL-U (ConlluError: a line "
                               "of 4 columns (CoNLL-U has 10): '1 a a DET')")


# ------------------------------------------------------------------------------------------------------
# The same sentences and trees as stanza's reader

@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    generate_synthetic(out, num_images=60, seed=5)
    return out / "captions.conllu"


def _trees(sentences, scheme):
    converter = SchemeConverter(scheme)
    converted = [converter.convert(s)[0] for s in sentences]
    return [(str(build_tree(s)), str(build_tree(s, TreeRules(verb_prep="word")))) for s in converted]


def test_same_sentences_and_trees_as_stanzas_reader(synthetic):
    """stanza's ``CoNLL.conll2doc`` read CoNLL-U before; its sentences, converted as the stanza backend converts
    stanza's output, equal the reader's column for column on every test file and the synthetic set, and give the
    same trees in both verb-preposition styles, after each file's scheme conversion."""
    CoNLL = pytest.importorskip("stanza.utils.conll").CoNLL
    files = [*FIXTURES, synthetic]
    assert len(files) >= 7
    for path in files:
        text = path.read_text()
        ours = parse_conllu(text)
        theirs = [sentence_from_stanza(s) for s in CoNLL.conll2doc(input_str=text).sentences]
        assert theirs == ours, path
        scheme = detect_scheme(ours).scheme
        assert scheme in SCHEMES
        assert _trees(theirs, scheme) == _trees(ours, scheme), path
    with_mwt = TEXT.split("\n\n")[0] + "\n\n"   # the sentence with a multiword token, an empty node, "_" columns
    assert [sentence_from_stanza(s) for s in CoNLL.conll2doc(input_str=with_mwt).sentences] == \
        parse_conllu(with_mwt)
