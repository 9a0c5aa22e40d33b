"""Referral-tree rules, dictionaries and parsing backends, on hand-written UD v2 parses.

``tests/data/referral_trees/captions.conllu`` holds 50 COCO/Flickr30K-style captions, each with a parse written
by hand as stanza's English EWT models produce it (read by retr's own CoNLL-U reader, :mod:`retr.store.conllu`);
``expected_trees.json`` gives each caption's expected tree and the constructions it exercises.
"""
from __future__ import annotations

import json
from pathlib import Path

import h5py
import nltk
import numpy as np
import pytest

from retr.common.errors import MissingResourceError, UserError
from retr.parsers import referral_tree as rt
from retr.parsers.backends import (CaptionItem, ConlluBackend, StanzaBackend, fetch_parser_models,
                                   normalize_caption)
from retr.parsers.dictionaries import (NULL_ID, UNKNOWN_ID, Dictionaries, build_dictionaries,
                                       load_dictionaries)
from retr.parsers.referral_tree import ReferralTree, TreeRules, build_tree, nltk_to_slots
from retr.store.conllu import ConlluSentence, parse_conllu

DATA = Path(__file__).parent / "data" / "referral_trees"
CONLLU = DATA / "captions.conllu"
EXPECTED = json.loads((DATA / "expected_trees.json").read_text())
SENTENCES = {s.sent_id: s for s in parse_conllu(CONLLU.read_text())}

#: Every construction the issue names, as tagged in expected_trees.json.
REQUIRED_CONSTRUCTIONS = {
    "verb_prep", "object", "copula", "there_is", "verbless", "nmod_of_object", "object_conjunction",
    "conjunction", "passive", "agent", "relative_clause", "compound_noun", "adjective_noun", "plural",
    "numeral", "pronoun_subject", "relational_noun", "fixed_preposition", "frame_noun", "quantity_noun",
    "predicative_adjective", "noun_predicate", "xcomp", "particle", "possessive", "complement_fallback",
    "acl_promoted", "prepositional_predicate", "adjective_complement",
}


def test_test_data_is_large_and_covers_every_construction():
    assert len(EXPECTED) >= 40 and set(EXPECTED) == set(SENTENCES)
    covered = {c for entry in EXPECTED.values() for c in entry["constructions"]}
    assert REQUIRED_CONSTRUCTIONS <= covered, REQUIRED_CONSTRUCTIONS - covered


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_expected_tree(key):
    entry = EXPECTED[key]
    sentence = SENTENCES[key]
    assert normalize_caption(sentence.text) == normalize_caption(entry["text"])
    assert str(build_tree(sentence)) == entry["tree"], entry["text"]


def test_equivalent_phrasings_give_one_tree():
    by_text = {e["text"]: str(build_tree(SENTENCES[k])) for k, e in EXPECTED.items()}
    assert by_text["There is a cat on the bed."] == by_text["A cat on a bed."] == by_text["A cat is on a bed."]


def test_entity_candidates_most_specific_first():
    def slots(text):
        key = next(k for k, e in EXPECTED.items() if e["text"] == text)
        return build_tree(SENTENCES[key]).slots

    hydrant = slots("A red fire hydrant next to a parked car")
    assert hydrant[0] == ("fire_hydrant", "red_hydrant", "hydrant")
    assert hydrant[4] == ("parked_car", "car")
    assert slots("A brown teddy bear is laying on a bed.")[0] == ("teddy_bear", "brown_bear", "bear")
    assert slots("Several cars are parked along the street.")[0] == ("car",)
    assert slots("Someone is cutting a cake with a knife.")[0] == ()


def test_verb_prep_word_style_keeps_the_preposition():
    rules = TreeRules(verb_prep="word")
    want = {
        "a dog runs on the grass near a fence": "run_on",
        "A cat is sitting on top of a car.": "sit_on_top_of",
        "A woman standing in front of a mirror.": "stand_in_front_of",
        "The sky is full of kites.": "full_of",
        "A woman is holding an umbrella in the rain.": "hold",
    }
    for key, entry in EXPECTED.items():
        if entry["text"] in want:
            assert build_tree(SENTENCES[key], rules).labels()[3] == want[entry["text"]]
    with pytest.raises(ValueError):
        TreeRules(verb_prep="other")


def test_missing_lemmas_fall_back(monkeypatch):
    monkeypatch.setattr(rt, "_wordnet_lemmatizer", lambda: None)
    text = ("# text = Dogs chase a ball\n"
            "1\tDogs\t_\tNOUN\tNNS\t_\t2\tnsubj\t_\t_\n"
            "2\tchase\t_\tVERB\tVBP\t_\t0\troot\t_\t_\n"
            "3\ta\t_\tDET\tDT\t_\t4\tdet\t_\t_\n"
            "4\tball\t_\tNOUN\tNN\t_\t2\tobj\t_\t_\n\n")
    sentence = parse_conllu(text)[0]
    assert str(build_tree(sentence)) == "[dogs null null chase ball null null]"


def test_malformed_parse_is_an_error():
    text = "1\tdog\tdog\tNOUN\tNN\t_\t1\tdep\t_\t_\n\n"
    with pytest.raises(ValueError, match="no root"):
        build_tree(parse_conllu(text)[0])


def test_bracketed_form_and_json_round_trip():
    tree = build_tree(SENTENCES["ref_001#0"])
    assert tree.bracketed() == "(run_PREP (null dog null) (near grass fence))"
    assert nltk_to_slots(nltk.Tree.fromstring(tree.bracketed())) == tree.labels()
    assert ReferralTree.from_json(tree.to_json()) == tree
    with pytest.raises(ValueError):
        ReferralTree(((),) * 6)


# ------------------------------------------------------------------------------------------------------
# Dictionaries

def _tree(*slots):
    return ReferralTree(tuple(tuple(s) for s in slots))


def test_dictionaries_rank_by_frequency_with_fixed_null_and_unknown():
    trees = [
        _tree(("red_dog", "dog"), (), (), ("run_PREP",), ("grass",), ("near",), ("fence",)),
        _tree(("dog",), (), (), ("run_PREP",), ("grass",), (), ()),
        _tree(("cat",), (), (), ("on",), ("bed",), (), ()),
        _tree(("cat",), (), (), ("on",), ("grass",), (), ()),
    ]
    d = build_dictionaries(trees, num_entities=6, num_relations=4)
    # counts: dog 2, grass 3, cat 2, bed 1, fence 1, red_dog 1 → grass, cat, dog (ties alphabetical), bed …
    assert d.entities == ["null", "unknown", "grass", "cat", "dog", "bed"]
    assert d.relations == ["null", "unknown", "on", "run_PREP"]
    ids = d.encode(trees[0])
    assert ids.dtype == np.int32 and ids.shape == (7,)
    # red_dog is not in the dictionary: falls back to dog; near and fence are unknown; empty slots null
    assert ids.tolist() == [4, NULL_ID, NULL_ID, 3, 2, UNKNOWN_ID, UNKNOWN_ID]
    assert d.display_labels(trees[0], ids)[5:] == ["unknown:near", "unknown:fence"]
    assert build_dictionaries(trees, 6, 4, min_count=2).entities == ["null", "unknown", "grass", "cat", "dog"]
    bigger = build_dictionaries(trees, 10, 10)
    assert bigger.encode(trees[0])[0] == bigger.entities.index("red_dog")


def test_dictionaries_save_and_reuse(tmp_path):
    d = Dictionaries(["null", "unknown", "dog"], ["null", "unknown", "on"])
    path = tmp_path / "dicts.json"
    path.write_text(d.to_json())
    assert load_dictionaries(path).entities == d.entities
    with h5py.File(tmp_path / "t.h5", "w") as f:
        f.attrs["entities"] = json.dumps(d.entities)
        f.attrs["relations"] = json.dumps(d.relations)
    assert load_dictionaries(tmp_path / "t.h5").relations == d.relations
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UserError, match="entities"):
        load_dictionaries(tmp_path / "bad.json")
    with pytest.raises(UserError, match="does not exist"):
        load_dictionaries(tmp_path / "none.json")
    with pytest.raises(UserError, match="ids 0 and 1"):
        Dictionaries(["dog", "null"], ["null", "unknown"])
    with pytest.raises(ValueError, match="^num_entities and num_relations must be at least 3"):
        build_dictionaries([], num_entities=2)


# ------------------------------------------------------------------------------------------------------
# CoNLL-U backend

def _items(keys_texts):
    return [CaptionItem(i, k, t) for i, (k, t) in enumerate(keys_texts)]


def test_conllu_backend_matches_by_key_and_reports_mismatches():
    backend = ConlluBackend(CONLLU)
    assert backend.match == "key"
    items = _items([("ref_003#0", EXPECTED["ref_003#0"]["text"]),
                    ("ref_001#0", "A dog runs on the grass near a fence."),   # case/period differences are fine
                    ("ref_002#0", "a completely different caption"),
                    ("missing#0", "a dog")])
    outcomes = backend.parse(items)
    assert [o.key for o in outcomes] == [i.key for i in items]
    assert outcomes[0].sentence.sent_id == "ref_003#0" and outcomes[1].sentence.sent_id == "ref_001#0"
    assert outcomes[2].sentence is None and "the caption is 'a completely different caption'" in outcomes[2].error
    assert outcomes[3].sentence is None and "no sentence with sent_id missing#0" in outcomes[3].error
    assert str(outcomes[0].sentence.constituency).startswith("(ROOT (S (NP (EX There))")
    assert set(backend.unmatched_keys({"ref_001#0"})) == set(EXPECTED) - {"ref_001#0"}


def test_conllu_backend_by_order_and_bad_files(tmp_path):
    blocks = CONLLU.read_text().strip().split("\n\n")[:3]
    no_ids = "\n\n".join("\n".join(l for l in b.splitlines() if not l.startswith("# sent_id")) for b in blocks)
    path = tmp_path / "order.conllu"
    path.write_text(no_ids + "\n\n")
    backend = ConlluBackend(path)
    assert backend.match == "order"
    texts = [EXPECTED[f"ref_00{i}#0"]["text"] for i in (1, 2, 3)]
    outcomes = backend.parse(_items([(f"x#{i}", t) for i, t in enumerate(texts)]))
    assert [str(build_tree(o.sentence)) for o in outcomes] == [EXPECTED[f"ref_00{i}#0"]["tree"] for i in (1, 2, 3)]
    with pytest.raises(UserError, match="has 3 sentences"):
        backend.check_count(4)
    mixed = tmp_path / "mixed.conllu"
    mixed.write_text(blocks[0] + "\n\n" + no_ids.split("\n\n")[1] + "\n\n")
    with pytest.raises(UserError, match="1 of 2 sentences"):
        ConlluBackend(mixed)
    duplicate = tmp_path / "dup.conllu"
    duplicate.write_text(blocks[0] + "\n\n" + blocks[0] + "\n\n")
    with pytest.raises(UserError, match="twice"):
        ConlluBackend(duplicate)
    with pytest.raises(UserError, match="does not exist"):
        ConlluBackend(tmp_path / "none.conllu")


def test_conllu_backend_isolates_a_broken_sentence(tmp_path):
    blocks = CONLLU.read_text().strip().split("\n\n")[:2]
    broken = "# sent_id = bad#0\n# text = a dog\n1\ta\ta\tDET\n\n"
    path = tmp_path / "broken.conllu"
    path.write_text(blocks[0] + "\n\n" + broken + blocks[1] + "\n\n")
    outcomes = ConlluBackend(path).parse(_items([("ref_001#0", EXPECTED["ref_001#0"]["text"]),
                                                 ("bad#0", "a dog"),
                                                 ("ref_002#0", EXPECTED["ref_002#0"]["text"])]))
    assert outcomes[0].sentence is not None and outcomes[2].sentence is not None
    assert outcomes[1].sentence is None and outcomes[1].error.startswith("unreadable CoNLL-U")


def test_conllu_find_text_and_key():
    backend = ConlluBackend(CONLLU)
    assert backend.find_text("A DOG runs on the grass near a fence").sent_id == "ref_001#0"
    assert backend.find_key("ref_002#0").text == EXPECTED["ref_002#0"]["text"]
    assert backend.find_text("no such caption") is None


# ------------------------------------------------------------------------------------------------------
# stanza backend

def test_stanza_backend_without_models_says_how_to_get_them(tmp_path, monkeypatch):
    monkeypatch.delenv("STANZA_RESOURCES_DIR", raising=False)
    with pytest.raises(MissingResourceError) as info:
        StanzaBackend(tmp_path / "models", device="cpu")
    message = str(info.value)
    assert "\n" not in message and str(tmp_path / "models") in message and "--stanza-dir" in message
    assert "fetch-parser-models" in message and "stanza.download" in message
    monkeypatch.setenv("STANZA_RESOURCES_DIR", str(tmp_path / "env"))
    with pytest.raises(MissingResourceError, match="STANZA_RESOURCES_DIR"):
        StanzaBackend(device="cpu")
    # a folder with resources.json but no English models is still "missing"
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "resources.json").write_text("{}")
    with pytest.raises(MissingResourceError):
        StanzaBackend(tmp_path / "partial", device="cpu")


class _FakePipeline:
    """Stands in for ``stanza.Pipeline``: returns the hand-written parse of each blank-line separated text, as
    stanza objects (read by stanza's own CoNLL-U reader), which the backend converts to retr's sentences."""

    def __init__(self):
        CoNLL = pytest.importorskip("stanza.utils.conll").CoNLL
        self.calls = []
        self.by_text = {normalize_caption(s.text): s for s in CoNLL.conll2doc(input_str=CONLLU.read_text()).sentences}

    def __call__(self, text):
        self.calls.append(text)
        paragraphs = text.split("\n\n")
        found = [self.by_text[normalize_caption(p)] for p in paragraphs if normalize_caption(p) in self.by_text]
        if "explode" in text:
            raise RuntimeError("boom")
        return type("Doc", (), {"sentences": found})()


def test_stanza_backend_batches_and_isolates_failures():
    fake = _FakePipeline()
    backend = StanzaBackend(device="cpu", pipeline=fake)
    texts = [EXPECTED[k]["text"] for k in ("ref_001#0", "ref_002#0", "ref_003#0")]
    outcomes = backend.parse(_items([(f"c#{i}", t) for i, t in enumerate(texts)]))
    assert len(fake.calls) == 1 and fake.calls[0].count("\n\n") == 2
    assert all(isinstance(o.sentence, ConlluSentence) for o in outcomes)
    assert outcomes[0].sentence.words == SENTENCES["ref_001#0"].words   # as read from CoNLL-U, column for column
    assert [str(build_tree(o.sentence)) for o in outcomes] == [EXPECTED[k]["tree"] for k in
                                                               ("ref_001#0", "ref_002#0", "ref_003#0")]
    fake.calls.clear()
    outcomes = backend.parse(_items([("a#0", texts[0]), ("b#0", "explode  here"), ("c#0", texts[1])]))
    assert len(fake.calls) == 4  # the batch, then one call per caption
    assert outcomes[0].sentence is not None and outcomes[2].sentence is not None
    assert outcomes[1].sentence is None and "boom" in outcomes[1].error


def test_fetch_parser_models_calls_stanza_download(tmp_path, monkeypatch):
    import stanza

    calls = []
    monkeypatch.setattr(stanza, "download", lambda *a, **k: calls.append((a, k)))
    assert fetch_parser_models(tmp_path / "m") == tmp_path / "m"
    (args, kwargs), = calls
    assert args == ("en",) and kwargs["model_dir"] == str(tmp_path / "m")
    assert kwargs["processors"] == "tokenize,pos,lemma,depparse,constituency" and kwargs["package"] == "default"

    def offline(*a, **k):
        raise ConnectionError("Failed to resolve 'raw.githubusercontent.com'")

    monkeypatch.setattr(stanza, "download", offline)
    with pytest.raises(UserError, match="internet access"):
        fetch_parser_models(tmp_path / "m")
