"""Concept data for SMFEA/CVSE: vocabulary, labels, the co-occurrence graph (hand-checked), concepts.h5, CLI."""
from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from retr.common.errors import MissingResourceError, UserError
from retr.manifests.schema import ManifestRecord
from retr.pipeline.concepts import (build_concepts, concept_graph, cooccurrence_counts, fallback_words, multi_hot,
                                    select_concepts)
from retr.store.concepts import ConceptSet, write_concepts
from retr.store.word_vectors import read_word_vectors


def test_graph_matches_hand_computation():
    # 11 captions over concepts 0, 1, 2: {0,1,2} ×1, {0,1} ×3, {0} ×1, {2} ×6
    labels = np.array([[1, 1, 1]] + [[1, 1, 0]] * 3 + [[1, 0, 0]] + [[0, 0, 1]] * 6, dtype=np.uint8)
    counts = cooccurrence_counts(labels)
    assert counts.tolist() == [[5, 4, 1], [4, 4, 1], [1, 1, 7]]
    # P = [[-, .8, .2], [1, -, .25], [1/7, 1/7, -]]; 5^(P-.02) - 5^-.02 >= .3  <=>  P >= 0.1676
    # B = [[0,1,1],[1,0,1],[0,0,0]], column sums 1, 1, 2 -> A = [[1,.25,.125],[.25,1,.125],[0,0,1]]
    # row sums 1.375, 1.375, 1 -> D^-1/2 A^T D^-1/2:
    expected = np.array([[1 / 1.375, 0.25 / 1.375, 0.0],
                         [0.25 / 1.375, 1 / 1.375, 0.0],
                         [0.125 / 1.375 ** 0.5, 0.125 / 1.375 ** 0.5, 1.0]])
    np.testing.assert_allclose(concept_graph(counts), expected, rtol=1e-5, atol=1e-6)


def test_graph_threshold_edge_and_unseen_concept():
    # P = 0.16 is below the threshold, 0.17 above; a concept never seen has no edges and keeps its self loop
    counts = np.array([[100, 16, 0], [16, 100, 0], [0, 0, 0]])
    assert (concept_graph(counts)[:2, :2] > 0).sum() == 2          # only the diagonal
    counts[0, 1] = counts[1, 0] = 17
    graph = concept_graph(counts)
    assert graph[0, 1] > 0 and graph[1, 0] > 0
    assert graph[2].tolist() == [0.0, 0.0, 1.0]


def test_select_concepts_by_pos_and_frequency():
    words = [[("dog", "NOUN"), ("run", "VERB"), ("brown", "ADJ")], [("dog", "NOUN"), ("cat", "NOUN")],
             [("cat", "NOUN"), ("ball", "NOUN"), ("run", "VERB"), ("sit", "VERB"), ("dog", "VERB")]]
    chosen = select_concepts(words, num_nouns=2, num_adjectives=5, num_verbs=3)
    # nouns: cat 2, dog 2 (tie: alphabetical), ball 1 cut; adjectives: brown; verbs: run 2, sit 1 ("dog" taken)
    assert chosen == [("cat", "NOUN"), ("dog", "NOUN"), ("brown", "ADJ"), ("run", "VERB"), ("sit", "VERB")]
    assert select_concepts(words, 1, 1, 1, pos_source="frequency") == []  # no "ANY" words given


def test_fallback_words_drop_function_words():
    assert [w for w, _ in fallback_words("A dog is running on the grass, next to 2 cats.")] == \
        ["dog", "running", "grass", "cats"]


def test_multi_hot_uses_own_words_only():
    labels = multi_hot([[("dog", "NOUN"), ("grass", "NOUN")], [("cat", "NOUN")]], ["cat", "dog", "grass"])
    assert labels.tolist() == [[0, 1, 1], [1, 0, 0]]


def _records():
    return [ManifestRecord("a", "a.jpg", "train", ("a dog runs on grass", "a brown dog")),
            ManifestRecord("b", "b.jpg", "train", ("a cat sits", "a cat and a dog")),
            ManifestRecord("c", "c.jpg", "test", ("a zebra eats grass", "a dog"))]


def test_build_write_read_roundtrip(tmp_path):
    data = build_concepts(_records(), num_nouns=3, num_adjectives=1, num_verbs=1)
    assert data.attrs["pos_source"] == "frequency"
    # training captions only define the vocabulary ("zebra" and "eats" occur only in the test split)
    assert "zebra" not in data.concepts and data.concepts[:2] == ["dog", "cat"]
    path = write_concepts(tmp_path / "concepts.h5", data)
    concepts = ConceptSet(path)
    dog, grass = concepts.concepts.index("dog"), concepts.concepts.index("grass")
    caption = concepts.labels_for_captions(["c#0"])[0]
    assert caption[grass] == 1 and caption[dog] == 0          # the test caption sees its own words only
    image = concepts.labels_for_images(["c"])[0]
    assert image[grass] == 1 and image[dog] == 1              # the image label is the union of its captions
    assert concepts.counts[dog] == 3 and concepts.cooccurrence[dog, concepts.concepts.index("cat")] == 1
    with pytest.raises(UserError, match="no concept labels"):
        concepts.labels_for_captions(["zzz#0"])
    with h5py.File(path, "r") as f:
        assert f.attrs["kind"] == "concepts" and f["caption_labels"].shape == (6, len(data.concepts))


def test_missing_conllu_sentence_is_an_error():
    words = {"a#0": [("dog", "NOUN")], "a#1": [("dog", "NOUN")]}
    with pytest.raises(UserError, match="no sentence for 4 caption"):
        build_concepts(_records(), words)


def test_missing_concept_file_is_one_line(tmp_path):
    with pytest.raises(MissingResourceError, match="build-concepts"):
        ConceptSet(tmp_path / "absent.h5")


def test_word_vectors_glove_format(tmp_path):
    path = tmp_path / "glove.txt"
    path.write_text("dog 1 2 3\ntennis 0 0 2\nracket 2 2 0\ncat 0.5 0.5 0.5\n", encoding="utf-8")
    vectors, missing = read_word_vectors(path, ["dog", "tennis_racket", "unicorn"])
    np.testing.assert_allclose(vectors, [[1, 2, 3], [1, 1, 1], [0, 0, 0]])
    assert missing == ["unicorn"]
    path.write_text("dog 1 2 3\ncat 1 2\n", encoding="utf-8")
    with pytest.raises(UserError, match="line 2"):
        read_word_vectors(path, ["dog", "cat"])
    with pytest.raises(MissingResourceError, match="GloVe"):
        read_word_vectors(tmp_path / "none.txt", ["dog"])


def test_build_concepts_command_on_synthetic(tmp_path):
    from retr.manifests.synthetic import generate_synthetic
    from retr.pipeline.commands import cli

    generate_synthetic(tmp_path / "s", 30, seed=1)
    out = tmp_path / "concepts.h5"
    result = CliRunner().invoke(cli, ["build-concepts", "--manifest", str(tmp_path / "s" / "manifest.jsonl"),
                                      "--conllu", str(tmp_path / "s" / "captions.conllu"), "--out", str(out),
                                      "--nouns", "5", "--adjectives", "6", "--verbs", "3"])
    assert result.exit_code == 0, result.output
    concepts = ConceptSet(out)
    assert concepts.attrs["pos_source"] == "conllu"
    assert json.loads(concepts.attrs["actual"]) == {"NOUN": 5, "ADJ": 6, "VERB": 3}
    colours = {"red", "green", "blue", "yellow", "purple", "orange"}
    assert set(concepts.concepts[5:11]) <= colours | {"small", "large"}
    # lemmas: "sits" is counted as the verb "sit"
    assert "sits" not in concepts.concepts
    assert concepts.forms["sits"] == concepts.concepts.index("sit") and concepts.forms["is"] == concepts.forms["be"]
    adjacency = concepts.adjacency
    assert np.isfinite(adjacency).all() and (np.diag(adjacency) > 0).all()
    bad = CliRunner().invoke(cli, ["build-concepts", "--manifest", str(tmp_path / "none.jsonl"), "--out", str(out)])
    assert bad.exit_code != 0


def test_build_concepts_without_pos_tags_needs_an_explicit_choice(tmp_path, run_cli):
    from retr.manifests.synthetic import generate_synthetic

    generate_synthetic(tmp_path / "s", 20, seed=2)
    manifest, out = tmp_path / "s" / "manifest.jsonl", tmp_path / "concepts.h5"
    code, _, err = run_cli.as_user("pipeline", "build-concepts", "--manifest", manifest, "--out", out)
    assert code != 0 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert "--conllu" in err and "--select frequency" in err and "fetch-parser-models" in err and not out.exists()
    result = run_cli("pipeline", "build-concepts", "--manifest", manifest, "--out", out, "--select", "frequency",
                     "--nouns", "4", "--adjectives", "2", "--verbs", "1")
    assert ConceptSet(out).attrs["pos_source"] == "frequency" and "POS from frequency" in result.output


def test_conllu_words_need_a_sent_id_and_readable_rows(tmp_path):
    """Read by retr's CoNLL-U reader: lemmas (the form where the lemma is ``_``) and POS groups by caption key; a
    sentence without ``# sent_id`` and a malformed row are one-line errors naming the sentence."""
    from collections import Counter

    from retr.pipeline.concepts import read_conllu_words

    path = tmp_path / "c.conllu"
    path.write_text("# sent_id = a#0\n1\tDogs\tdog\tNOUN\tNNS\t_\t2\tnsubj\t_\t_\n2\tsit\t_\tVERB\tVBP\t_\t0\troot\t_\t_\n"
                    "3-4\tdon't\t_\t_\t_\t_\t_\t_\t_\t_\n3\tdo\tdo\tAUX\t_\t_\t2\taux\t_\t_\n"
                    "4\tn't\tnot\tPART\t_\t_\t2\tadvmod\t_\t_\n\n")
    forms = Counter()
    assert read_conllu_words(path, forms) == {"a#0": [("dog", "NOUN"), ("sit", "VERB"), ("do", "OTHER"),
                                                      ("not", "OTHER")]}
    assert forms == {("dogs", "dog"): 1, ("sit", "sit"): 1, ("do", "do"): 1, ("n't", "not"): 1}
    path.write_text(path.read_text() + "# text = a cat\n1\tcat\tcat\tNOUN\tNN\t_\t0\troot\t_\t_\n\n")
    with pytest.raises(UserError, match=r": sentence 2 has no '# sent_id = <image id>#<caption index>' comment$"):
        read_conllu_words(path)
    path.write_text("# sent_id = a#0\n1\tdog\tdog\tNOUN\n\n")
    with pytest.raises(UserError) as info:
        read_conllu_words(path)
    assert str(info.value) == (f"{path} is not readable CoNLL-U (sentence 1: a line of 4 columns (CoNLL-U has 10): "
                               "'1 dog dog NOUN')")
    with pytest.raises(UserError, match="does not exist"):
        read_conllu_words(tmp_path / "none.conllu")
