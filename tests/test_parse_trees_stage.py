"""The parse-trees stage end to end on the synthetic dataset's gold CoNLL-U: every caption gets a tree,
failures are recorded, interrupted runs resume, dictionaries can be reused, commands follow the CLI rules."""
from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from retr.common.errors import UserError
from retr.manifests.schema import read_manifest, write_manifest
from retr.manifests.synthetic import generate_synthetic
from retr.parsers.backends import ConlluBackend
from retr.store.trees import TreeSet, read_trees
from retr.pipeline.commands import cli
from retr.pipeline.parse_trees import TooManyFailures, run_parse_trees, shard_folder


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    generate_synthetic(out, num_images=24, seed=3)
    return out


def test_parse_trees_on_synthetic_conllu_gives_every_caption_a_tree(synth, tmp_path):
    out = tmp_path / "trees.h5"
    result = CliRunner().invoke(cli, ["parse-trees", "--manifest", str(synth / "manifest.jsonl"), "--conllu",
                                      str(synth / "captions.conllu"), "--out", str(out), "--shard-size", "25",
                                      "--quiet"])
    assert result.exit_code == 0, result.output
    assert "wrote 120 trees for 120 captions" in result.output and "0 failures" in result.output
    records = read_manifest(synth / "manifest.jsonl")
    keys, nodes, entities, relations = read_trees(out)
    assert keys == [r.caption_key(k) for r in records for k in range(len(r.captions))]
    assert nodes.shape == (120, 7) and nodes.dtype == np.int32
    assert entities[:2] == ["null", "unknown"] and relations[:2] == ["null", "unknown"]
    assert nodes[:, 0::2].max() < len(entities) and nodes[:, 1::2].max() < len(relations)
    # every synthetic caption names a subject, a relation and a landmark; R2, E3, R6, E7 stay null
    assert (nodes[:, [0, 3, 4]] != 0).all() and (nodes[:, [1, 2, 5, 6]] == 0).all()
    trees = TreeSet(out)
    assert trees.attrs["format_version"] == 1 and trees.attrs["kind"] == "trees"
    for name in ("manifest_sha256", "created", "retr_version", "backend", "rules", "dictionaries_source"):
        assert name in trees.attrs
    assert trees.attrs["backend"].startswith("conllu:captions.conllu")
    assert trees.failures == []
    # the text form says what the ids stand for
    by_key = dict(zip(records[0].captions, range(5)))
    for caption, k in by_key.items():
        row = trees.keys.index(records[0].caption_key(k))
        assert trees.text[row].startswith(f"({trees.labels(row)[3]} (null ")
    # train-split relations of a scene: the same relation read from both objects' sides
    train_relations = {relations[i] for i in nodes[:, 3]}
    assert {"to_left_of", "to_right_of", "above", "below"} & train_relations
    assert (synth / "manifest.jsonl").exists() and shard_folder(out).is_dir()
    with h5py.File(out) as f:
        assert f["caption_keys"].dtype.kind == "O" and f["failures"].shape == (0, 2)


def test_failures_are_recorded_and_never_rows(synth, tmp_path):
    records = read_manifest(synth / "manifest.jsonl")
    first = records[0]
    changed = type(first)(first.id, first.path, first.split,
                          ("a caption nobody parsed",) + first.captions[1:], first.extra)
    extra = type(first)("extra_image", first.path, "train", ("a dog on a bed",), {})
    manifest = tmp_path / "manifest.jsonl"
    write_manifest(manifest, [changed, *records[1:], extra])
    summary = run_parse_trees(manifest, tmp_path / "trees.h5", ConlluBackend(synth / "captions.conllu"))
    assert summary.trees == 119 and len(summary.failures) == 2
    reasons = dict(summary.failures)
    assert "the caption is 'a caption nobody parsed'" in reasons[first.caption_key(0)]
    assert "no sentence with sent_id extra_image#0" in reasons["extra_image#0"]
    trees = TreeSet(tmp_path / "trees.h5")
    assert first.caption_key(0) not in trees and trees.failures == summary.failures
    assert trees.nodes_for([first.caption_key(0)], missing="null").tolist() == [[0] * 7]
    with pytest.raises(UserError, match="no tree"):
        trees.nodes_for([first.caption_key(0)])


class _Interrupting(ConlluBackend):
    def __init__(self, path, fail_on_call=None):
        super().__init__(path)
        self.calls, self.fail_on_call = 0, fail_on_call

    def parse(self, items):
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise KeyboardInterrupt
        return super().parse(items)


def test_resume_after_interruption_skips_finished_shards(synth, tmp_path):
    manifest, conllu = synth / "manifest.jsonl", synth / "captions.conllu"
    out = tmp_path / "trees.h5"
    with pytest.raises(KeyboardInterrupt):
        run_parse_trees(manifest, out, _Interrupting(conllu, fail_on_call=3), shard_size=30, batch_size=15)
    shards = sorted(p.name for p in shard_folder(out).iterdir())
    assert shards == ["shard-00000-of-00004.h5"] and not out.exists()
    resumed = _Interrupting(conllu)
    summary = run_parse_trees(manifest, out, resumed, shard_size=30, batch_size=15)
    assert (summary.shards_reused, summary.shards_parsed, resumed.calls) == (1, 3, 6)
    fresh = run_parse_trees(manifest, tmp_path / "fresh.h5", ConlluBackend(conllu), shard_size=30)
    a, b = read_trees(out), read_trees(tmp_path / "fresh.h5")
    assert a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]
    assert fresh.trees == summary.trees == 120
    # a finished run re-encodes from its shards without parsing again
    again = _Interrupting(conllu, fail_on_call=1)
    assert run_parse_trees(manifest, out, again, shard_size=30).shards_parsed == 0 and again.calls == 0
    # shards of another run are refused, not mixed
    with pytest.raises(UserError, match="another run"):
        run_parse_trees(manifest, out, ConlluBackend(conllu), shard_size=50)
    restarted = run_parse_trees(manifest, out, ConlluBackend(conllu), shard_size=50, restart=True)
    assert (restarted.shards_parsed, restarted.shards_reused) == (3, 0)
    assert sorted(p.name for p in shard_folder(out).iterdir())[0] == "shard-00000-of-00003.h5"


def test_dictionaries_reused_across_datasets(synth, tmp_path):
    manifest, conllu = synth / "manifest.jsonl", synth / "captions.conllu"
    base = tmp_path / "base.h5"
    run_parse_trees(manifest, base, ConlluBackend(conllu), num_entities=6, num_relations=4)
    base_trees = TreeSet(base)
    assert len(base_trees.entities) == 6 and len(base_trees.relations) == 4
    assert (base_trees.nodes == 1).any()  # labels beyond the 4 kept entities are unknown
    # only the test images, with the first run's dictionaries (no training captions needed)
    test_only = tmp_path / "test.jsonl"
    write_manifest(test_only, [r for r in read_manifest(manifest) if r.split == "test"])
    with pytest.raises(UserError, match="--dictionaries"):
        run_parse_trees(test_only, tmp_path / "x.h5", ConlluBackend(conllu))
    result = CliRunner().invoke(cli, ["parse-trees", "--manifest", str(test_only), "--conllu", str(conllu),
                                      "--out", str(tmp_path / "t.h5"), "--dictionaries", str(base), "--quiet"])
    assert result.exit_code == 0, result.output
    reused = TreeSet(tmp_path / "t.h5")
    assert reused.entities == base_trees.entities and reused.relations == base_trees.relations
    rows = [base_trees.keys.index(k) for k in reused.keys]
    assert np.array_equal(reused.nodes, base_trees.nodes[rows])
    assert reused.attrs["dictionaries_source"] == str(base)


def test_show_tree_prints_the_tree(synth):
    manifest = read_manifest(synth / "manifest.jsonl")
    caption = manifest[0].captions[0]
    result = CliRunner().invoke(cli, ["show-tree", caption, "--conllu", str(synth / "captions.conllu")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == f"caption  {caption}"
    assert lines[1].startswith("tree     (") and "slots    E1=" in lines[2]
    by_key = CliRunner().invoke(cli, ["show-tree", "--key", manifest[0].caption_key(0), "--conllu",
                                      str(synth / "captions.conllu")])
    assert by_key.exit_code == 0 and by_key.output.splitlines()[:2] == lines[:2]
    assert "(ROOT" in result.output  # the constituency bracket of the gold parse
    missing = CliRunner().invoke(cli, ["show-tree", "no such caption", "--conllu", str(synth / "captions.conllu")])
    assert missing.exit_code != 0


def test_stanza_without_models_is_one_error_line(synth, tmp_path, run_cli):
    code, _, err = run_cli.as_user("pipeline", "parse-trees", "--manifest", synth / "manifest.jsonl", "--out",
                                   tmp_path / "t.h5", "--stanza-dir", tmp_path / "nowhere", "--device", "cpu")
    assert code == 1
    assert err.startswith("error: stanza English models") and len(err.strip().splitlines()) == 1
    assert "fetch-parser-models" in err and str(tmp_path / "nowhere") in err and not (tmp_path / "t.h5").exists()
    code, _, err = run_cli.as_user("pipeline", "show-tree", "a dog", "--conllu", synth / "captions.conllu",
                                   "--stanza-dir", tmp_path)
    assert code != 0 and "not both" in err


@pytest.mark.parametrize("command", ["parse-trees", "show-tree", "fetch-parser-models"])
def test_help_has_example(command):
    result = CliRunner().invoke(cli, [command, "--help"])
    assert result.exit_code == 0 and "Example:" in result.output and f"retr-pipeline {command}" in result.output


def _with_unparsed_captions(synth, tmp_path, count):
    """The synthetic manifest with the first caption of ``count`` images changed (their parses no longer match)."""
    records = read_manifest(synth / "manifest.jsonl")
    changed = [type(r)(r.id, r.path, r.split, (f"a caption nobody parsed {n}",) + r.captions[1:], r.extra)
               if n < count else r for n, r in enumerate(records)]
    manifest = tmp_path / "manifest.jsonl"
    write_manifest(manifest, changed)
    return manifest, [r.caption_key(0) for r in records[:count]]


def test_too_many_failures_exit_non_zero_with_one_line(synth, tmp_path, run_cli):
    """10 of 120 captions (8.3 %) without a tree: over the default threshold (5 %) the command exits 1 with one
    error line and writes no trees.h5; the parse shards stay, so a re-run with a higher threshold re-encodes."""
    manifest, failed = _with_unparsed_captions(synth, tmp_path, 10)
    out = tmp_path / "trees.h5"
    args = ["parse-trees", "--manifest", manifest, "--conllu", synth / "captions.conllu", "--out", out, "--quiet",
            "--shard-size", "50"]
    code, stdout, err = run_cli.as_user("pipeline", *args)
    assert code == 1 and stdout == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: 10 of 120 captions got no tree (8.33%), more than --max-failures 0.05 (5%) "
                          f"allows; {out} not written (the parses stay in trees.h5.shards/ beside it); "
                          f"first failure {failed[0]}: "), err
    assert "raise --max-failures" in err and "max_failures" not in err
    assert not out.exists() and len(list(shard_folder(out).glob("shard-*.h5"))) == 3
    with pytest.raises(TooManyFailures) as info:  # the same from Python, with the failures
        run_parse_trees(manifest, out, ConlluBackend(synth / "captions.conllu"), shard_size=50)
    assert sorted(k for k, _ in info.value.failures) == sorted(failed) and info.value.captions == 120
    # under the threshold: exit 0, the summary names the failure fraction and the threshold
    code, stdout, err = run_cli.as_user("pipeline", *args, "--max-failures", "0.1")
    assert code == 0, err
    assert stdout.splitlines()[0] == (f"wrote 110 trees for 120 captions to {out} (10 failures, 8.33% of the "
                                      "captions, threshold 10%; shards parsed 0, reused 3)"), stdout
    trees = TreeSet(out)
    assert len(trees.keys) == 110 and trees.attrs["max_failures"] == 0.1
    # exactly at the threshold is allowed; 0 allows no failure
    summary = run_parse_trees(manifest, out, ConlluBackend(synth / "captions.conllu"), shard_size=50,
                              max_failures=10 / 120)
    assert summary.failure_fraction == 10 / 120
    before = out.read_bytes()
    with pytest.raises(TooManyFailures, match=r"more than max_failures 0 \(0%\)"):
        run_parse_trees(manifest, out, ConlluBackend(synth / "captions.conllu"), shard_size=50, max_failures=0)
    assert out.read_bytes() == before  # a refused run leaves an earlier trees.h5 as it was


def test_under_the_default_threshold_exits_zero(synth, tmp_path, run_cli):
    manifest, _ = _with_unparsed_captions(synth, tmp_path, 6)  # 6 of 120 = 5 %: not more than the default
    out = tmp_path / "trees.h5"
    code, stdout, err = run_cli.as_user("pipeline", "parse-trees", "--manifest", manifest, "--conllu",
                                        synth / "captions.conllu", "--out", out, "--quiet")
    assert code == 0 and err == "", err
    assert stdout.splitlines()[0] == (f"wrote 114 trees for 120 captions to {out} (6 failures, 5% of the captions, "
                                      "threshold 5%; shards parsed 1, reused 0)"), stdout
    assert TreeSet(out).attrs["max_failures"] == 0.05


@pytest.mark.parametrize("value", ["1.5", "-0.1", "nan"])
def test_max_failures_must_be_a_fraction(synth, tmp_path, run_cli, value):
    code, _, err = run_cli.as_user("pipeline", "parse-trees", "--manifest", synth / "manifest.jsonl", "--conllu",
                                   synth / "captions.conllu", "--out", tmp_path / "t.h5", "--max-failures", value)
    assert code == 1 and err.startswith("error: --max-failures must be a fraction of the captions from 0 to 1")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "t.h5").exists()
