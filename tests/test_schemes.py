"""Label schemes of CoNLL-U made elsewhere (parsers/schemes.py): UD v1, Stanford basic dependencies and ClearNLP parses
of the same captions give the referral trees of their UD v2 parses; detection names each scheme; an unknown
scheme is refused in one line; a sentence that cannot be converted is a failure with its reason.

``tests/data/schemes/captions.<scheme>.conllu`` hold 24 captions, each parsed by hand four times, as the parsers
that emit each scheme analyse it (``captions.json``: each caption's expected tree and what it exercises):

* ``ud2`` — UD v2 as stanza's English EWT models produce it (the scheme the tree rules read);
* ``ud1`` — UD v1 (CoreNLP 3.5.2–3.9, models trained on UD English ≤ 1.4): ``dobj``, ``nsubjpass``,
  ``auxpass``, ``neg``, ``mwe``, ``nmod`` on predicates, ``cc`` on the first conjunct;
* ``sd``  — Stanford basic dependencies (the Stanford Parser, SMFEA §3.2.1): prepositions head their objects
  (``prep``/``pobj``), ``nn``, ``num``, ``poss``/``possessive``, ``partmod``/``vmod``, ``rcmod``, ``prt``,
  "be" heads a clause with a prepositional predicate, "to" of an infinitive is ``aux``;
* ``clearnlp`` — ClearNLP labels as spaCy's English pipelines emit them: SD's ``prep``/``pobj`` with ``ROOT``,
  ``compound``, ``nummod``, ``acl``, ``relcl``, ``case`` for 's, ``agent``, ``dative``, and the copula heads
  its clause (``attr``, ``acomp``; ``attr`` for the noun of "there is").
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from retr.common.errors import UserError
from retr.manifests.schema import ManifestRecord, write_manifest
from retr.parsers.backends import ConlluBackend
from retr.parsers.referral_tree import TreeRules, build_tree
from retr.parsers.schemes import (SCHEMES, ConversionError, LabelEvidence, accepts, choose_scheme,
                                  detect_scheme, to_ud2)
from retr.pipeline.commands import cli
from retr.pipeline.parse_trees import TooManyFailures, run_parse_trees
from retr.store.conllu import parse_conllu, read_conllu
from retr.store.trees import TreeSet

DATA = Path(__file__).parent / "data" / "schemes"
#: caption → expected tree, in file order
CAPTIONS: dict[str, str] = {c["text"]: c["tree"] for c in json.loads((DATA / "captions.json").read_text())["captions"]}


def _blocks(scheme: str) -> dict[str, list[str]]:
    """``captions.<scheme>.conllu`` → per caption text, its word lines."""
    blocks = {}
    for block in (DATA / f"captions.{scheme}.conllu").read_text().strip().split("\n\n"):
        text = next(line for line in block.splitlines() if line.startswith("# text = "))[len("# text = "):]
        blocks[text] = [line for line in block.splitlines() if not line.startswith("#")]
    assert list(blocks) == list(CAPTIONS), scheme
    return blocks


BLOCKS = {scheme: _blocks(scheme) for scheme in SCHEMES}

#: captions whose SD/ClearNLP parse attaches something elsewhere than the UD v2 parse (same tree, other arcs)
OTHER_ATTACHMENT = {("sd", "There is a cat on the bed.")}


def conllu(scheme: str, captions=None, ids: bool = True, ptb_upos: bool = False) -> str:
    """A CoNLL-U file of the captions in one scheme (``ptb_upos``: the UPOS column holds the PTB tag and the
    XPOS column nothing, as the Stanford Parser's CoNLL-X output read as CoNLL-U)."""
    blocks = []
    for n, text in enumerate(captions or CAPTIONS):
        lines = [f"# sent_id = img{n:02d}#0"] if ids else []
        lines.append(f"# text = {text}")
        for line in BLOCKS[scheme][text]:
            cols = line.split("\t")
            if ptb_upos:
                cols = cols[:3] + [cols[4], "_"] + cols[5:]
            lines.append("\t".join(cols))
        blocks.append("\n".join(lines) + "\n\n")
    return "".join(blocks)


def sentences(scheme: str, **kw):
    return parse_conllu(conllu(scheme, **kw))


def arcs(sentence) -> list[tuple[int, str]]:
    return [(int(w.head), w.deprel) for w in sentence.words]


# ------------------------------------------------------------------------------------------------------
# Trees and conversions

def test_the_test_captions_cover_what_the_issue_names():
    text = " ".join(CAPTIONS).lower()
    for words in ("next to", "in front of", "'s", "his", "who", "that", "is being", "are parked", "fire hydrant",
                  " or ", " and ", "there is", "is on", " not "):
        assert words in text, words
    sd = conllu("sd") + conllu("clearnlp")
    for label in ("\tprep\t", "\tpobj\t", "\tnn\t", "\tpartmod\t", "\tvmod\t", "\trcmod\t", "\tnum\t", "\tposs\t",
                  "\tpossessive\t", "\tattr\t", "\tdative\t", "\tagent\t", "\tacomp\t", "\trelcl\t", "\tpcomp\t"):
        assert label in sd, label
    v1 = conllu("ud1")
    for label in ("\tdobj\t", "\tnsubjpass\t", "\tauxpass\t", "\tneg\t", "\tmwe\t", "\tnmod:agent\t"):
        assert label in v1, label


@pytest.mark.parametrize("text", list(CAPTIONS))
def test_every_scheme_gives_the_ud2_tree(text):
    expected = CAPTIONS[text]
    for scheme in SCHEMES:
        sentence = sentences(scheme, captions=[text])[0]
        converted, _ = to_ud2(sentence, scheme)
        assert str(build_tree(converted)) == expected, (scheme, text)
    assert str(build_tree(sentences("ud2", captions=[text])[0])) == expected


@pytest.mark.parametrize("scheme", ["ud1", "sd", "clearnlp"])
def test_conversion_gives_the_hand_made_ud2_arcs(scheme):
    ud2 = sentences("ud2")
    for text, original, reference in zip(CAPTIONS, sentences(scheme), ud2):
        converted, _ = to_ud2(original, scheme)
        if (scheme, text) not in OTHER_ATTACHMENT:
            assert arcs(converted) == arcs(reference), (scheme, text, converted.conllu())
        assert [w.text for w in converted.words] == [w.text for w in reference.words]


def test_without_conversion_the_trees_are_poorer():
    """What the issue saw: read as UD v2, UD v1 and SD parses lose objects and relations."""
    wrong = {}
    for scheme in ("ud1", "sd", "clearnlp"):
        wrong[scheme] = sum(str(build_tree(s)) != CAPTIONS[text]
                            for text, s in zip(CAPTIONS, sentences(scheme)))
    assert wrong == {"ud1": 21, "sd": 23, "clearnlp": 23}, wrong


def test_conversions_are_counted_by_name():
    text = "A kite is being flown by a young boy on the beach."
    _, v1 = to_ud2(sentences("ud1", captions=[text])[0], "ud1")
    assert v1 == {"nsubjpass→nsubj:pass": 1, "auxpass→aux:pass": 1, "nmod:agent→obl:agent": 1, "nmod→obl": 1}
    _, sd = to_ud2(sentences("sd", captions=[text])[0], "sd")
    assert sd == {"nsubjpass→nsubj:pass": 1, "auxpass→aux:pass": 1, "prep+pobj→case+obl:agent": 1,
                  "prep+pobj→case+obl": 1}
    _, clear = to_ud2(sentences("clearnlp", captions=[text])[0], "clearnlp")
    assert clear == {"nsubjpass→nsubj:pass": 1, "auxpass→aux:pass": 1, "agent+pobj→case+obl:agent": 1,
                     "prep+pobj→case+obl": 1}
    ud2, none = to_ud2(sentences("ud2", captions=[text])[0], "ud2")
    assert none == {} and str(build_tree(ud2)) == CAPTIONS[text]


def test_stanford_parser_conll_x_output_without_upos():
    """The Stanford Parser's CoNLL-X output has PTB tags where CoNLL-U has UPOS: filled from the tag."""
    for text, sentence in zip(CAPTIONS, sentences("sd", ptb_upos=True)):
        converted, counts = to_ud2(sentence, "sd")
        assert counts["PTB tag→UPOS"] == len(sentence.words)
        assert str(build_tree(converted)) == CAPTIONS[text], text
    assert detect_scheme(sentences("sd", ptb_upos=True)).scheme == "sd"


def test_head_final_stanford_mwe_becomes_head_initial_fixed():
    """Some SD parses write "next to" as mwe(to, next) with "to" heading the PP."""
    text = ("# text = a cat sitting next to a dog\n"
            "1\ta\ta\tDET\tDT\t_\t2\tdet\t_\t_\n"
            "2\tcat\tcat\tNOUN\tNN\t_\t0\troot\t_\t_\n"
            "3\tsitting\tsit\tVERB\tVBG\t_\t2\tvmod\t_\t_\n"
            "4\tnext\tnext\tADJ\tJJ\t_\t5\tmwe\t_\t_\n"
            "5\tto\tto\tADP\tTO\t_\t3\tprep\t_\t_\n"
            "6\ta\ta\tDET\tDT\t_\t7\tdet\t_\t_\n"
            "7\tdog\tdog\tNOUN\tNN\t_\t5\tpobj\t_\t_\n\n")
    converted, counts = to_ud2(parse_conllu(text)[0], "sd")
    assert counts["mwe→fixed"] == 1
    assert arcs(converted)[3:7] == [(7, "case"), (4, "fixed"), (7, "det"), (3, "obl")]
    assert str(build_tree(converted)) == "[cat null null sit_PREP dog null null]"


def test_sentences_that_cannot_be_converted_raise_with_the_reason():
    def one(text):
        return parse_conllu(text)[0]

    two_objects = one("1\ton\ton\tADP\tIN\t_\t0\troot\t_\t_\n2\tbed\tbed\tNOUN\tNN\t_\t1\tpobj\t_\t_\n"
                      "3\tsofa\tsofa\tNOUN\tNN\t_\t1\tpobj\t_\t_\n\n")
    with pytest.raises(ConversionError, match="2 pobj"):
        to_ud2(two_objects, "sd")
    remnant = one("1\tcats\tcat\tNOUN\tNNS\t_\t0\troot\t_\t_\n2\tdogs\tdog\tNOUN\tNNS\t_\t1\tremnant\t_\t_\n\n")
    with pytest.raises(ConversionError, match="remnant"):
        to_ud2(remnant, "ud1")
    collapsed = one("1\tcat\tcat\tNOUN\tNN\t_\t0\troot\t_\t_\n2\tbed\tbed\tNOUN\tNN\t_\t1\tprep_on\t_\t_\n\n")
    with pytest.raises(ConversionError, match="'prep_on'.*Stanford basic"):
        to_ud2(collapsed, "sd")
    with pytest.raises(ConversionError, match="'dobj'.*UD v2"):
        to_ud2(sentences("ud1", captions=["A young boy brushing his teeth."])[0], "ud2")


# ------------------------------------------------------------------------------------------------------
# Detection

@pytest.mark.parametrize("scheme", SCHEMES)
def test_detection_picks_each_scheme(scheme):
    found = detect_scheme(sentences(scheme))
    assert found.scheme == scheme, found.summary()
    assert found.sentences == len(CAPTIONS) and not found.stray


def test_detection_evidence_names_what_decided():
    v1 = detect_scheme(sentences("ud1"))
    names = dict(v1.evidence)
    assert names["dobj"] == 7 and names["nmod on a predicate"] >= 15 and names["cc on the first conjunct"] == 3
    assert v1.summary().startswith("UD v1 (")
    assert "prep" in dict(detect_scheme(sentences("sd")).evidence)
    clear = dict(detect_scheme(sentences("clearnlp")).evidence)
    assert {"attr", "dative", "agent", "relcl"} <= set(clear)


def test_ud1_without_v1_labels_is_told_by_its_structure():
    """Only det/nsubj/nmod/cc/conj — labels both versions share: nmod under a verb and cc on the first
    conjunct say v1; obl would say v2."""
    v1 = conllu("ud1", captions=["Two men and a woman are sitting on a bench."])
    v2 = conllu("ud2", captions=["Two men and a woman are sitting on a bench."])
    assert detect_scheme(parse_conllu(v1)).scheme == "ud1"
    assert detect_scheme(parse_conllu(v2)).scheme == "ud2"
    shared_only = conllu("ud2", captions=["A cat or a dog sleeping on a couch"]).replace("\tobl\t", "\tnmod\t")
    assert detect_scheme(parse_conllu(shared_only)).scheme == "ud2"  # cc on the next


def test_the_backend_detects_while_indexing(tmp_path):
    for scheme in SCHEMES:
        path = tmp_path / f"{scheme}.conllu"
        path.write_text(conllu(scheme))
        evidence = ConlluBackend(path).detect_scheme()
        direct = detect_scheme(sentences(scheme))
        assert evidence.scheme == scheme
        assert evidence.labels == direct.labels and evidence.structure == direct.structure
    assert ConlluBackend(tmp_path / "sd.conllu", detect=False).detect_scheme().scheme == "sd"


def test_unknown_scheme_is_refused_in_one_line():
    # CoNLL-2008 / Penn2Malt style labels
    penn = ("1\tA\ta\tDET\tDT\t_\t2\tNMOD\t_\t_\n2\tdog\tdog\tNOUN\tNN\t_\t3\tSBJ\t_\t_\n"
            "3\truns\trun\tVERB\tVBZ\t_\t0\tROOT\t_\t_\n4\ton\ton\tADP\tIN\t_\t3\tADV\t_\t_\n"
            "5\tgrass\tgrass\tNOUN\tNN\t_\t4\tPMOD\t_\t_\n\n")
    found = detect_scheme(parse_conllu(penn))
    assert found.scheme == "unknown"
    with pytest.raises(UserError) as info:
        choose_scheme("auto", found, "parses.conll")
    message = str(info.value)
    assert len(message.splitlines()) == 1 and message.startswith("parses.conll: the dependency labels are none")
    for label in ("sbj (1)", "pmod (1)", "adv (1)"):  # NMOD and ROOT read as UD's nmod and root
        assert label in message, message
    # UD v1 and v2 labels mixed: neither
    mixed = conllu("ud1", captions=["A young boy brushing his teeth."]) + conllu(
        "ud2", captions=["A man in a red shirt is riding a bike down the street."])
    found = detect_scheme(parse_conllu(mixed))
    assert found.scheme == "unknown" and found.closest() in ("ud1", "ud2")
    # collapsed Stanford dependencies get a hint
    collapsed = conllu("sd", captions=["a dog runs on the grass near a fence"]).replace("\tprep\t", "\tprep_on\t")
    with pytest.raises(UserError, match="collapsed Stanford dependencies"):
        choose_scheme("auto", detect_scheme(parse_conllu(collapsed)), "x")
    # given explicitly, the scheme is used and the detection noted
    choice = choose_scheme("sd", found, "x")
    assert choice.scheme == "sd" and "given by --scheme" in choice.describe()


def test_a_few_stray_labels_are_tolerated_and_fail_one_by_one():
    evidence = LabelEvidence()
    for _ in range(200):
        for sentence in sentences("ud1"):
            evidence.add([(str(w.id), w.upos, str(w.head), w.deprel) for w in sentence.words])
    evidence.add([("1", "NOUN", "0", "root"), ("2", "NOUN", "1", "weird")])
    found = evidence.detect()
    assert found.scheme == "ud1" and found.stray == {"weird": 1}
    assert "1 words with labels outside it: weird (1)" in found.summary()


# ------------------------------------------------------------------------------------------------------
# The commands

@pytest.fixture
def dataset(tmp_path):
    """A manifest of the captions (one image each, all train) and their parses in every scheme."""
    records = [ManifestRecord(f"img{n:02d}", f"img{n:02d}.jpg", "train", (text,))
               for n, text in enumerate(CAPTIONS)]
    write_manifest(tmp_path / "manifest.jsonl", records)
    for scheme in SCHEMES:
        (tmp_path / f"{scheme}.conllu").write_text(conllu(scheme))
    return tmp_path


def test_parse_trees_on_ud1_prints_the_scheme_and_conversions(dataset):
    out = {}
    for scheme in SCHEMES:
        result = CliRunner().invoke(cli, ["parse-trees", "--manifest", str(dataset / "manifest.jsonl"), "--conllu",
                                          str(dataset / f"{scheme}.conllu"), "--out", str(dataset / f"{scheme}.h5"),
                                          "--quiet"])
        assert result.exit_code == 0, result.output
        out[scheme] = result.output
        assert f"wrote {len(CAPTIONS)} trees" in result.output and "(0 failures" in result.output
    line = next(line for line in out["ud1"].splitlines() if line.startswith("scheme "))
    assert line.startswith("scheme ud1: detected, UD v1 (")
    assert line.endswith("converted to UD v2: nmod→obl 19, dobj→obj 7, auxpass→aux:pass 3, cc→following conjunct 3, "
                         "nsubjpass→nsubj:pass 3, mwe→fixed 2, neg→advmod 1, nmod:agent→obl:agent 1"), line
    assert "scheme ud2: detected, UD v2" in out["ud2"] and "converted to UD v2: nothing converted" in out["ud2"]
    assert "scheme sd: detected, Stanford basic dependencies" in out["sd"] and "prep+pobj→case+obl" in out["sd"]
    assert "scheme clearnlp: detected, ClearNLP" in out["clearnlp"] and "be+attr→cop 1" in out["clearnlp"]
    reference = TreeSet(dataset / "ud2.h5")
    assert reference.attrs["scheme"] == "ud2" and json.loads(reference.attrs["conversions"]) == {}
    for scheme in ("ud1", "sd", "clearnlp"):
        trees = TreeSet(dataset / f"{scheme}.h5")
        assert trees.keys == reference.keys and trees.text == reference.text
        assert np.array_equal(trees.nodes, reference.nodes)
        assert trees.attrs["scheme"] == scheme and json.loads(trees.attrs["conversions"])


def test_show_tree_names_the_scheme(dataset):
    text = "A kite is being flown by a young boy on the beach."
    result = CliRunner().invoke(cli, ["show-tree", text, "--conllu", str(dataset / "sd.conllu")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[1] == "tree     (fly_PREP (null kite null) (on young_boy beach))"
    assert lines[3].startswith("scheme   sd: detected, Stanford basic dependencies (")
    assert lines[3].endswith("converted to UD v2: auxpass→aux:pass 1, nsubjpass→nsubj:pass 1, "
                             "prep+pobj→case+obl 1, prep+pobj→case+obl:agent 1"), lines[3]
    forced = CliRunner().invoke(cli, ["show-tree", text, "--conllu", str(dataset / "sd.conllu"), "--scheme", "ud2"])
    assert forced.exit_code != 0 and "cannot convert" in str(forced.exception)


def test_unknown_scheme_refused_by_the_command(dataset, run_cli):
    bad = dataset / "bad.conllu"
    bad.write_text(conllu("sd").replace("\tpobj\t", "\tPMOD\t").replace("\tdet\t", "\tNMOD\t"))
    code, _, err = run_cli.as_user("pipeline", "parse-trees", "--manifest", dataset / "manifest.jsonl",
                                   "--conllu", bad, "--out", dataset / "t.h5", "--quiet")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ") and "pmod (28)" in err and "--scheme" in err
    assert not (dataset / "t.h5").exists()
    code, _, err = run_cli.as_user("pipeline", "show-tree", "a dog runs on the grass near a fence",
                                   "--conllu", bad)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "pmod (" in err


def test_unconvertible_sentences_are_failures_with_reasons(dataset):
    """--scheme given against the labels: every sentence outside it is a failure with its reason, the
    rest get trees; a pobj without a preposition in an SD file is one caption's failure."""
    with pytest.raises(TooManyFailures, match="13 of 24 captions got no tree"):  # more than 5 %
        run_parse_trees(dataset / "manifest.jsonl", dataset / "forced.h5", ConlluBackend(dataset / "ud1.conllu"),
                        scheme="ud2")
    summary = run_parse_trees(dataset / "manifest.jsonl", dataset / "forced.h5",
                              ConlluBackend(dataset / "ud1.conllu"), scheme="ud2", max_failures=1)
    assert summary.scheme.how == "given" and "the labels look like ud1" in summary.lines()[1]
    reasons = dict(summary.failures)
    outside = [f"img{n:02d}#0" for n, text in enumerate(CAPTIONS)
               if any(not accepts("ud2", line.split("\t")[7]) for line in BLOCKS["ud1"][text])]
    assert sorted(reasons) == outside and len(outside) == 13 and summary.trees == len(CAPTIONS) - 13
    assert all(r.startswith("cannot convert from ud2 to UD v2: label ") for r in reasons.values())
    broken = conllu("sd").replace("\t7\tpobj\t", "\t6\tpobj\t", 1)  # "fence" under "grass"
    assert broken != conllu("sd")
    (dataset / "broken.conllu").write_text(broken)
    summary = run_parse_trees(dataset / "manifest.jsonl", dataset / "broken.h5",
                              ConlluBackend(dataset / "broken.conllu"))
    assert summary.scheme.scheme == "sd" and len(summary.failures) == 1
    key, reason = summary.failures[0]
    assert key == "img00#0" and "pobj of 'grass', which is not a preposition" in reason
    assert TreeSet(dataset / "broken.h5").failures == summary.failures


def test_scheme_is_part_of_a_shards_identity(dataset):
    manifest, path = dataset / "manifest.jsonl", dataset / "ud1.conllu"
    run_parse_trees(manifest, dataset / "t.h5", ConlluBackend(path))
    with pytest.raises(UserError, match="its scheme differs"):
        run_parse_trees(manifest, dataset / "t.h5", ConlluBackend(path), scheme="sd")
    again = run_parse_trees(manifest, dataset / "t.h5", ConlluBackend(path))
    assert again.shards_reused == 1 and again.conversions["dobj→obj"] == 7


def _sd(*rows: str):
    """One SD sentence from ``form lemma UPOS XPOS head label`` rows."""
    lines = []
    for i, row in enumerate(rows, 1):
        form, lemma, upos, xpos, head, label = row.split()
        lines.append("\t".join([str(i), form, lemma, upos, xpos, "_", head, label, "_", "_"]))
    return parse_conllu("\n".join(lines) + "\n\n")[0]


def test_coordinated_and_stacked_prepositions():
    """SD coordinates prepositions ("on the bed and on the sofa": conj(on, on)); UD coordinates their objects.
    A preposition whose complement is another ("from under the bed", pcomp) gives the noun two case words."""
    coordinated = _sd("a a DET DT 2 det", "cat cat NOUN NN 0 root", "sleeping sleep VERB VBG 2 vmod",
                      "on on ADP IN 3 prep", "the the DET DT 6 det", "bed bed NOUN NN 4 pobj",
                      "and and CCONJ CC 4 cc", "on on ADP IN 4 conj", "the the DET DT 10 det",
                      "sofa sofa NOUN NN 8 pobj")
    converted, counts = to_ud2(coordinated, "sd")
    assert arcs(converted) == [(2, "det"), (0, "root"), (2, "acl"), (6, "case"), (6, "det"), (3, "obl"),
                               (10, "cc"), (10, "case"), (10, "det"), (6, "conj")]
    assert counts["conj+pobj→case+conj"] == 1 and counts["cc→following conjunct"] == 1
    assert str(build_tree(converted)) == "[cat null null sleep_PREP bed and sofa]"
    stacked = _sd("a a DET DT 2 det", "cat cat NOUN NN 0 root", "hiding hide VERB VBG 2 vmod",
                  "from from ADP IN 3 prep", "under under ADP IN 4 pcomp", "the the DET DT 7 det",
                  "bed bed NOUN NN 5 pobj")
    converted, counts = to_ud2(stacked, "sd")
    assert arcs(converted)[3:] == [(7, "case"), (7, "case"), (7, "det"), (3, "obl")]
    assert counts["prep+pcomp→case+case"] == 1
    tree = build_tree(converted, TreeRules(verb_prep="word"))
    assert str(tree) == "[cat null null hide_from_under bed null null]"


def test_clearnlp_dative_noun_and_stranded_preposition():
    gives = _sd("a a DET DT 2 det", "man man NOUN NN 3 nsubj", "gives give VERB VBZ 0 ROOT",
                "a a DET DT 5 det", "dog dog NOUN NN 3 dative", "a a DET DT 7 det", "bone bone NOUN NN 3 dobj")
    converted, counts = to_ud2(gives, "clearnlp")
    assert [label for _, label in arcs(converted)] == ["det", "nsubj", "root", "det", "iobj", "det", "obj"]
    assert str(build_tree(converted)) == "[man null null give bone null null]"
    around = _sd("people people NOUN NNS 2 nsubj", "standing stand VERB VBG 0 root",
                 "around around ADP IN 2 prep")
    converted, counts = to_ud2(around, "sd")
    assert arcs(converted)[2] == (2, "advmod") and counts == {"prep→advmod": 1}


def test_parse_trees_with_the_wrong_scheme_exits_non_zero(dataset, run_cli):
    """The audit's run: ClearNLP parses read with --scheme ud2 fail caption after caption; the command must
    not exit 0 with a handful of trees."""
    out = dataset / "forced.h5"
    code, stdout, err = run_cli.as_user("pipeline", "parse-trees", "--manifest", dataset / "manifest.jsonl",
                                        "--conllu", dataset / "clearnlp.conllu", "--scheme", "ud2", "--out", out,
                                        "--quiet")
    assert code == 1 and stdout == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: 24 of 24 captions got no tree (100%), more than --max-failures 0.05 (5%) "
                          "allows"), err
    assert "not in UD v2" in err and not out.exists()


# ------------------------------------------------------------------------------------------------------
# spaCy's "be" + acomp on a participle

SPACY = Path(__file__).parent / "data" / "schemes"
SPACY_EXPECTED = json.loads((SPACY / "spacy_be_acomp.json").read_text())["sentences"]


def test_spacy_be_acomp_on_a_participle_becomes_an_auxiliary():
    """spaCy hangs "diving" / "overgrown" on "is" as acomp; UD v2 makes the participle the verb and "be" its
    aux (VBG) or aux:pass (VBN, and VBD: a past participle tagged as past tense). A JJ acomp stays a copula."""
    read = list(read_conllu(SPACY / "spacy_be_acomp.conllu"))
    assert [s.sent_id for s in read] == list(SPACY_EXPECTED)
    assert detect_scheme(read).scheme == "clearnlp"
    for sentence in read:
        want = SPACY_EXPECTED[sentence.sent_id]
        converted, counts = to_ud2(sentence, "clearnlp")
        assert [f"{h}:{label}" for h, label in arcs(converted)] == want["ud2"], converted.conllu()
        assert dict(counts) == want["conversions"], sentence.sent_id
        tree = build_tree(converted)
        assert str(tree) == want["tree"], sentence.sent_id
        be = next(w for w in converted.words if w.lemma == "be")
        assert be.upos == "AUX" and tree.labels()[3] != "be"
        acomp = next((w.xpos for w in sentence.words if w.deprel == "acomp"), "VBG")  # img08: spaCy's aux already
        assert be.deprel == {"JJ": "cop", "VBG": "aux"}.get(acomp, "aux:pass"), sentence.sent_id
    assert [key for key, want in SPACY_EXPECTED.items() if "4:aux" in want["ud2"] or "5:aux" in want["ud2"]] == [
        "img00#0", "img02#0", "img04#0", "img08#0"]


def test_participle_without_a_ptb_tag_is_read_from_upos_and_feats():
    """A parse with UPOS only (XPOS ``_``): VERB + FEATS decide, a form in -ing without FEATS too."""
    def one(form, lemma, upos, feats):
        rows = [("a", "a", "DET", "2", "det"), ("man", "man", "NOUN", "3", "nsubj"), ("is", "be", "AUX", "0", "ROOT"),
                (form, lemma, upos, "3", "acomp")]
        text = "".join(f"{i}\t{f}\t{lem}\t{u}\t_\t{feats if i == 4 else '_'}\t{h}\t{d}\t_\t_\n"
                       for i, (f, lem, u, h, d) in enumerate(rows, 1))
        converted, _ = to_ud2(parse_conllu(text + "\n")[0], "clearnlp")
        return converted.words[2].deprel, converted.words[1].deprel
    assert one("diving", "dive", "VERB", "Aspect=Prog|Tense=Pres|VerbForm=Part") == ("aux", "nsubj")
    assert one("injured", "injure", "VERB", "Aspect=Perf|Tense=Past|VerbForm=Part") == ("aux:pass", "nsubj:pass")
    assert one("sleeping", "sleep", "VERB", "_") == ("aux", "nsubj")
    assert one("tired", "tired", "ADJ", "Degree=Pos") == ("cop", "nsubj")


def test_parse_trees_on_spacy_parses_with_participles(tmp_path):
    records = [ManifestRecord(key.split("#")[0], f"{key.split('#')[0]}.jpg", "train", (want["text"],))
               for key, want in SPACY_EXPECTED.items()]
    write_manifest(tmp_path / "manifest.jsonl", records)
    result = CliRunner().invoke(cli, ["parse-trees", "--manifest", str(tmp_path / "manifest.jsonl"), "--conllu",
                                      str(SPACY / "spacy_be_acomp.conllu"), "--out", str(tmp_path / "t.h5"),
                                      "--quiet"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("scheme "))
    assert line.startswith("scheme clearnlp: detected, ClearNLP")
    for name in ("be+acomp VBG→aux 3", "be+acomp VBN→aux:pass 2", "be+acomp VBD→aux:pass 1", "be+acomp→cop 2",
                 "nsubj→nsubj:pass 3", "obl→obl:agent 1"):
        assert name in line, (name, line)
    trees = TreeSet(tmp_path / "t.h5")
    assert trees.text[trees.keys.index("img01#0")] == "(overgrow_PREP (null seabed null) (null coral_reef null))"
    assert [trees.labels(row)[3] for row in range(len(trees.keys))] == [
        "dive_PREP", "overgrow_PREP", "smile_PREP", "cover_PREP", "run_PREP", "park_PREP", "null", "full_PREP",
        "stand_PREP"]
