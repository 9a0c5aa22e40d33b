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
from retr.pipeline.cli import cli
from retr.pipeline.parse_trees import run_parse_trees, shard_folder


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
    code, _, err = run_cli.as_user("pipeline", "show-tree", "a dog", "--conllu", "x.conllu", "--stanza-dir", "d")
    assert code != 0 and "not both" in err


@pytest.mark.parametrize("command", ["parse-trees", "show-tree", "fetch-parser-models"])
def test_help_has_example(command):
    result = CliRunner().invoke(cli, [command, "--help"])
    assert result.exit_code == 0 and "Example:" in result.output and f"retr-pipeline {command}" in result.output
