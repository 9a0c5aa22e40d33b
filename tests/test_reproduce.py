"""Recipes: every published row's command, checked as data and run end to end on the synthetic data."""
from __future__ import annotations

import dataclasses
import json

import pytest

from retr.trainers.models import get_spec, preset
from retr.trainers.reproduction.recipes import RECIPES

#: The authors' flags for SCAN (kuanghuei/SCAN README; reference/scan.md), written out here on purpose:
#: (dataset, direction, aggregation) → λ_softmax, λ_lse (None: AVG has none); dataset → epochs, lr, lr step.
AUTHORS_SCAN_FLAGS = {
    ("f30k", "t2i", "lse"): (9.0, 6.0), ("f30k", "t2i", "avg"): (9.0, None),
    ("f30k", "i2t", "lse"): (4.0, 5.0), ("f30k", "i2t", "avg"): (4.0, None),
    ("coco", "t2i", "lse"): (9.0, 6.0), ("coco", "t2i", "avg"): (9.0, None),
    ("coco", "i2t", "lse"): (4.0, 20.0), ("coco", "i2t", "avg"): (4.0, None),
}
AUTHORS_SCAN_SCHEDULE = {"f30k": (30, 2e-4, 15), "coco": (20, 5e-4, 10)}


@pytest.mark.parametrize("combination", sorted(AUTHORS_SCAN_FLAGS))
def test_scan_presets_equal_the_authors_flags(combination):
    dataset, direction, agg = combination
    lambda_softmax, lambda_lse = AUTHORS_SCAN_FLAGS[combination]
    epochs, lr, step = AUTHORS_SCAN_SCHEDULE[dataset]
    for values in (preset("scan", f"{dataset}-{direction}-{agg}"),
                   preset("scan", dataset, direction=direction, agg=agg)):
        assert (values["direction"], values["agg"], values["lambda_softmax"]) == (direction, agg, lambda_softmax)
        if lambda_lse is not None:
            assert values["lambda_lse"] == lambda_lse
        assert (values["epochs"], values["lr"], values["lr_update"]) == (epochs, lr, step)
        assert (values["margin"], values["batch_size"], values["grad_clip"]) == (0.2, 128, 2.0)
        assert values["max_violation"] is True and values["bi_gru"] is True
        assert (values["embed_size"], values["word_dim"], values["norm"]) == (1024, 300, "clipped_l2norm")


def test_scan_dataset_presets_pick_the_published_best_aggregation():
    """Flickr30K Table 1: t-i AVG 446.2 > LSE 434.1, i-t AVG 452.2 > LSE 451.4; COCO 1K Table 2: t-i AVG
    500.5 > LSE 489.3, i-t LSE (494.5; the 5K table's single model is i-t LSE)."""
    assert preset("scan", "f30k")["agg"] == "avg" and preset("scan", "f30k")["direction"] == "t2i"
    assert preset("scan", "f30k", direction="i2t")["agg"] == "avg"
    assert preset("scan", "coco", direction="t2i")["agg"] == "avg"
    assert preset("scan", "coco", direction="i2t")["agg"] == "lse"
    assert preset("scan", "coco", direction="i2t")["lambda_lse"] == 20.0
    assert preset("scan", "f30k", agg="max")["lambda_softmax"] == 9.0      # no published row: AVG's λ


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_is_runnable_data(name):
    from retr.trainers.evaluation.metrics import PROTOCOLS

    recipe = RECIPES[name]
    assert recipe.protocol in PROTOCOLS
    assert recipe.published.source and recipe.published.t2i[0] is not None
    for member in recipe.members:
        spec = get_spec(member.model)
        values = {**spec.resolve_preset(member.preset, member.settings), **member.settings}
        names = {f.name for f in dataclasses.fields(spec.config_class)}
        spec.config_class(**{k: v for k, v in values.items() if k in names})
    if recipe.ensemble:
        assert len({m.run for m in recipe.members}) == len(recipe.members)


def test_recipes_command_lists_every_recipe(run_cli):
    out = run_cli("train", "recipes").output
    for name in RECIPES:
        assert name in out
    listed = json.loads(run_cli("train", "recipes", "--json").output)["recipes"]
    assert {r["name"] for r in listed} == set(RECIPES)
    ensemble = next(r for r in listed if r["name"] == "scan-f30k-ensemble")
    assert ensemble["published"]["rsum"] == 465.0 and len(ensemble["members"]) == 2


@pytest.mark.slow
def test_reproduce_runs_an_ensemble_and_a_single_recipe_end_to_end(tmp_path, run_cli, synthetic_data):
    manifest, features = synthetic_data(images=40, seed=0)
    out = tmp_path / "runs"
    small = ["--features", features, "--manifest", manifest, "--out", out, "--epochs", "1", "--batch-size", "16",
             "--train-split", "train", "--val-images", "0", "--set", "embed_size=16", "--set", "word_dim=8",
             "--allow-size-mismatch", "--device", "cpu", "--quiet"]
    first = run_cli("train", "reproduce", "scan-f30k-ensemble", *small)
    report = json.loads((out / "reproduce-scan-f30k-ensemble.json").read_text())
    assert [r["kind"] for r in report["rows"]] == ["single", "single", "ensemble"]
    assert report["overrides"]["epochs"] == 1 and report["reproduction"] is False
    for row in report["rows"]:
        for side in ("i2t", "t2i"):
            for k in ("r1", "r5", "r10"):
                assert row["difference"][side][k] == pytest.approx(
                    round(row["measured"][side][k] - row["published"][side][k], 2))
    assert report["rows"][2]["published"]["rsum"] == 465.0
    assert (out / "scan-f30k-t2i-avg" / "best.pt").is_file() and (out / "scan-f30k-i2t-lse" / "best.pt").is_file()
    assert "ensemble: scan-f30k-t2i-avg + scan-f30k-i2t-lse" in first.output and "published" in first.output
    # the ensemble row is `retr-train eval` of the two members
    run_cli("train", "eval", out / "scan-f30k-t2i-avg", out / "scan-f30k-i2t-lse", "--protocol", "f30k-1k",
            "--allow-size-mismatch", "--device", "cpu", "--quiet")
    stored = json.loads((out / "scan-f30k-t2i-avg" / "eval.json").read_text())["results"]
    together = next(r for r in stored if r["ensemble"])
    assert together["rsum"] == pytest.approx(report["rows"][2]["measured"]["rsum"], abs=1e-9)
    # again: both members are finished and skipped, the numbers are the same
    again = run_cli("train", "reproduce", "scan-f30k-ensemble", *small)
    assert again.output.count("finished, skipped") == 2
    assert json.loads((out / "reproduce-scan-f30k-ensemble.json").read_text())["rows"][2]["measured"] == \
        report["rows"][2]["measured"]
    # a single-model recipe reuses the member run the ensemble trained
    single = run_cli("train", "reproduce", "scan-f30k-t2i-avg", *small)
    assert "finished, skipped" in single.output
    one = json.loads((out / "reproduce-scan-f30k-t2i-avg.json").read_text())
    assert [r["kind"] for r in one["rows"]] == ["single"] and one["rows"][0]["published"]["rsum"] == 446.2
    # more epochs: the finished member is resumed, not retrained
    longer = [*small]
    longer[longer.index("--epochs") + 1] = "2"
    resumed = run_cli("train", "reproduce", "scan-f30k-t2i-avg", *longer)
    assert "resuming" in resumed.output
    metrics = [json.loads(line) for line in (out / "scan-f30k-t2i-avg" / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics if "val" in m] == [1, 2]


def test_reproduce_refuses_settings_no_member_has(tmp_path, run_cli, synthetic_data):
    manifest, features = synthetic_data(images=40)
    result = run_cli("train", "reproduce", "scan-f30k-t2i-avg", "--features", features, "--manifest", manifest,
                     "--out", tmp_path / "o", "--set", "gamma=3", ok=False)
    assert "no member of scan-f30k-t2i-avg has the setting(s) gamma" in str(result.exception)


def test_the_recipes_page_holds_the_recipes_table_and_the_readme_starts_with_the_user_path():
    from pathlib import Path

    from retr.trainers.reproduction.reproduce import markdown_table

    root = Path(__file__).resolve().parent.parent
    page = (root / "docs" / "recipes.md").read_text(encoding="utf-8")
    assert markdown_table() in page, "docs/recipes.md's table is stale: paste `retr-train recipes --markdown`"
    readme = (root / "README.md").read_text(encoding="utf-8")
    assert "| recipe " not in readme, "the recipe table lives in docs/recipes.md"
    headings = [line for line in readme.splitlines() if line.startswith("## ")]
    assert headings[:2] == ["## Install and a first result", "## Reproduce a paper's row"]
    first_screen = readme[:readme.index("### Setup, tests and extras")]
    assert "make demo" in first_screen and "make test" in first_screen


# ------------------------------------------------------------------------- "reproduction: yes" only when it is one

def _features(shape=(36, 2048), **attrs):
    """A stand-in for an opened feature set: what :func:`feature_reasons` reads (attributes and row shape)."""
    from types import SimpleNamespace

    return SimpleNamespace(attrs=attrs, feature_shape=shape)


#: what `retr-pipeline extract --extractor butd-regions` records with its defaults and MILVLG's file
BUTD_DEFAULT_ATTRS = {
    "kind": "regions", "extractor": "butd-regions", "weights": "bua-caffe-frcn-r101-k36.pth sha256:" + "ab" * 32,
    "short_side": 600, "max_side": 1000, "min_boxes": 36, "max_boxes": 36, "conf_threshold": 0.2, "half": False,
    "detector_settings": json.dumps({"pre_nms_topk": 6000, "post_nms_topk": 300, "rpn_nms_threshold": 0.7,
                                     "min_size": 16.0, "pooled_size": 14, "class_nms_threshold": 0.3,
                                     "conf_threshold": 0.2, "min_boxes": 36, "max_boxes": 36}, sort_keys=True),
    "manifest_sha256": "m" * 64}


def test_the_butd_extractor_defaults_are_what_the_recipes_need():
    """The recipe's provenance is stated as data; the extractor's defaults must still satisfy it (so neither can
    drift alone): every attribute the recipe names is what a default extraction records."""
    from retr.extractors.butd.model import DetectorSettings
    from retr.trainers.reproduction.recipes import BUTD, accepts

    recorded = {**BUTD_DEFAULT_ATTRS, "detector_settings": json.dumps(DetectorSettings().__dict__, sort_keys=True)}
    from retr.trainers.reproduction.reproduce import _attr
    for key, wanted in BUTD.extracted.items():
        assert accepts(wanted, _attr(recorded, key)), key


@pytest.mark.parametrize("extractor", ["resnet152-grid", "vgg16-maps", "tencrop-resnet152", "tencrop-vgg19"])
def test_backbone_extractor_defaults_are_what_the_recipes_need(extractor, monkeypatch):
    """Built with random weights (no download), a default extractor's attributes satisfy its recipe provenance
    except for the weights, which are then the one reason."""
    from retr.extractors.base import build_extractor
    from retr.trainers.reproduction import recipes
    from retr.trainers.reproduction.reproduce import feature_reasons

    needed = next(p for p in (recipes.RESNET_GRID, recipes.VGG_MAPS, recipes.TENCROP_RESNET, recipes.TENCROP_VGG19)
                  if p.extractor == extractor)
    ex = build_extractor(extractor, weights="random")
    attrs = {**ex.attrs(), "manifest_sha256": "m" * 64}
    assert feature_reasons(needed, _features(needed.shape, **attrs), "m" * 64) == \
        [f"features: weights random (recipe {needed.extracted['weights'].said})"]


def test_smfea_recipe_inputs_are_the_pipeline_defaults():
    from retr.parsers.referral_tree import TreeRules
    from retr.pipeline.concepts import DEFAULT_ADJECTIVES, DEFAULT_NOUNS, DEFAULT_VERBS, GRAPH_DEFAULTS
    from retr.trainers.reproduction.recipes import SMFEA_CONCEPTS, SMFEA_TREES

    assert SMFEA_TREES.attrs["rules"] == json.loads(TreeRules().to_json())
    assert SMFEA_CONCEPTS.attrs["requested"] == {"NOUN": DEFAULT_NOUNS, "ADJ": DEFAULT_ADJECTIVES,
                                                 "VERB": DEFAULT_VERBS}
    assert SMFEA_CONCEPTS.attrs["graph"] == GRAPH_DEFAULTS


@pytest.mark.parametrize("change, reason", [
    ({"weights": "random"}, "features: weights random (recipe the bottom-up-attention fix36 Caffe model"),
    ({"weights": "faster_rcnn_from_caffe_attr.pkl sha256:" + "cd" * 32}, "features: weights faster_rcnn_from_caffe"),
    ({"short_side": 224}, "features: short_side 224 (recipe 600)"),
    ({"detector_settings": json.dumps({"pre_nms_topk": 6000, "post_nms_topk": 36, "pooled_size": 7,
                                       "rpn_nms_threshold": 0.7, "class_nms_threshold": 0.3})},
     "features: detector_settings.post_nms_topk 36 (recipe 300)"),
    ({"detector_settings": json.dumps({"pre_nms_topk": 6000, "post_nms_topk": 36, "pooled_size": 7,
                                       "rpn_nms_threshold": 0.7, "class_nms_threshold": 0.3})},
     "features: detector_settings.pooled_size 7 (recipe 14)"),
    ({"max_boxes": 100, "min_boxes": 10}, "features: min_boxes 10 (recipe 36)"),
    ({"half": True}, "features: half true (recipe false)"),
    ({"tf32": True}, "features: tf32 true (recipe false)"),     # TF32 keeps other boxes (docs/butd.md, TF32)
    ({"extractor": "resnet152-grid"}, "features: extractor resnet152-grid (recipe butd-regions)"),
    ({"manifest_sha256": "x" * 64}, "features: made from another manifest than --manifest"),
    ({"source": "tsv", "weights": "from a TSV"}, "features: imported from tsv (recipe: extracted by retr, or "
                                                 "imported from scan-precomp)"),
])
def test_each_feature_departure_is_a_reason(change, reason):
    from retr.trainers.reproduction.recipes import BUTD
    from retr.trainers.reproduction.reproduce import feature_reasons

    assert feature_reasons(BUTD, _features(**BUTD_DEFAULT_ATTRS), "m" * 64) == []
    reasons = feature_reasons(BUTD, _features(**{**BUTD_DEFAULT_ATTRS, **change}), "m" * 64)
    assert any(r.startswith(reason) for r in reasons), reasons


def test_features_of_another_width_and_scan_precomp_imports():
    from retr.trainers.reproduction.recipes import BUTD
    from retr.trainers.reproduction.reproduce import feature_reasons

    assert "features: 36×1024 per image (recipe 36×2048)" in \
        feature_reasons(BUTD, _features((36, 1024), **BUTD_DEFAULT_ATTRS), "m" * 64)
    imported = {"kind": "regions", "extractor": "butd-regions", "source": "scan-precomp",
                "weights": "SCAN precomputed bottom-up-attention features (36 boxes)", "manifest_sha256": "m" * 64}
    assert feature_reasons(BUTD, _features(**imported), "m" * 64) == []


def test_side_inputs_absent_or_built_otherwise_are_reasons(tmp_path):
    from retr.store.labels import write_label_file
    from retr.trainers.reproduction.recipes import RECIPES
    from retr.trainers.reproduction.reproduce import input_reasons

    jgcar = RECIPES["jgcar-f30k"]
    assert input_reasons(jgcar, {}, "m" * 64) == ["no --labels: fallback labels (shared caption concepts)"]
    coco_labels = tmp_path / "coco.json"
    write_label_file(coco_labels, {"a": ["dog"]}, {"source": "coco-instances", "manifest_sha256": "m" * 64})
    assert input_reasons(jgcar, {"labels": str(coco_labels)}, "m" * 64)[0] == \
        "--labels: source coco-instances (recipe \"f30k-entities\")"
    entities = {"source": "f30k-entities", "f30k_labels": "heads", "boxed_only": True, "manifest_sha256": "m" * 64}
    f30k_labels = tmp_path / "f30k.json"
    write_label_file(f30k_labels, {"a": ["dog"]}, entities)
    assert input_reasons(jgcar, {"labels": str(f30k_labels)}, "m" * 64) == []
    write_label_file(f30k_labels, {"a": ["animals"]}, {**entities, "f30k_labels": "types"})
    assert input_reasons(jgcar, {"labels": str(f30k_labels)}, "m" * 64) == \
        ["--labels: f30k_labels types (recipe \"heads\")"]
    assert input_reasons(RECIPES["jgcar-coco"], {"labels": str(coco_labels)}, "m" * 64) == []
    assert input_reasons(RECIPES["jgcar-coco"], {"labels": str(coco_labels)}, "other") == \
        ["--labels: made from another manifest than --manifest"]
    smfea = RECIPES["smfea-f30k"]
    missing = input_reasons(smfea, {}, "m" * 64)
    assert [r.split(":")[0] for r in missing] == ["no --trees", "no --concepts", "no --concept-vectors"]
    assert "trees" not in json.dumps(input_reasons(RECIPES["smfea-f30k-no-trees"], {}, "m" * 64))


def test_trees_and_concepts_built_otherwise_are_reasons(tmp_path, monkeypatch):
    from retr.trainers.reproduction import reproduce
    from retr.trainers.reproduction.recipes import RECIPES

    stored = {"trees": {"scheme": "clearnlp", "rules": '{"verb_prep": "placeholder"}', "manifest_sha256": "m" * 64},
              "concepts": {"pos_source": "frequency", "requested": '{"NOUN": 210, "ADJ": 60, "VERB": 30}',
                           "graph": json.dumps({"scale_base": 5.0, "offset": 0.02, "threshold": 0.3,
                                                "neighbour_weight": 0.25}), "manifest_sha256": "m" * 64}}
    monkeypatch.setattr(reproduce, "_input_attrs", lambda name, path: stored[name])
    reasons = reproduce.input_reasons(RECIPES["smfea-f30k"], {"trees": "t.h5", "concepts": "c.h5",
                                                              "concept_vectors": "glove.txt"}, "m" * 64)
    assert reasons == ['--trees: scheme clearnlp (recipe "ud2")', '--concepts: pos_source frequency (recipe "conllu")']


@pytest.mark.slow
def test_a_member_run_made_otherwise_is_refused_and_retrain_sets_it_aside(tmp_path, run_cli, synthetic_data):
    manifest, features = synthetic_data(images=40, seed=0)
    out = tmp_path / "runs"
    small = ["--features", features, "--manifest", manifest, "--out", out, "--epochs", "1", "--batch-size", "16",
             "--train-split", "train", "--val-images", "0", "--set", "word_dim=8", "--allow-size-mismatch",
             "--device", "cpu", "--quiet"]
    first = run_cli("train", "reproduce", "scan-f30k-t2i-avg", *small, "--set", "embed_size=16")
    assert first.stdout.splitlines()[0].startswith("reproduction: no (")   # the first line on stdout
    report = json.loads((out / "reproduce-scan-f30k-t2i-avg.json").read_text())
    assert report["reproduction"] is False
    for reason in ("override embed_size 16 (recipe 1024)", "override epochs 1 (recipe 30)",
                   "features: extractor scene-regions (recipe butd-regions)", "split size 4, protocol 1000"):
        assert reason in report["reasons"]
    run = out / "scan-f30k-t2i-avg"
    before = sorted(p.name for p in run.iterdir())
    refused = run_cli("train", "reproduce", "scan-f30k-t2i-avg", *small, "--set", "embed_size=8", ok=False)
    message = str(refused.exception)
    assert "member scan-f30k-t2i-avg" in message and "embed_size 16 (recipe 8)" in message
    assert "--retrain" in message and sorted(p.name for p in run.iterdir()) == before
    # other features: the data the run was trained on is part of the comparison
    other_manifest, other_features = synthetic_data(images=40, seed=1)
    moved = [a if a != features else other_features for a in small]
    moved = [a if a != manifest else other_manifest for a in moved]
    refused = run_cli("train", "reproduce", "scan-f30k-t2i-avg", *moved, "--set", "embed_size=16", ok=False)
    assert "features_ids_sha256" in str(refused.exception) or "manifest_sha256" in str(refused.exception)
    retrained = run_cli("train", "reproduce", "scan-f30k-t2i-avg", *small, "--set", "embed_size=8",
                        "--retrain", "scan-f30k-t2i-avg")
    assert "moved to" in retrained.output
    aside = [p for p in out.iterdir() if p.name.startswith("scan-f30k-t2i-avg.replaced-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == before
    assert json.loads((run / "config.json").read_text())["model_args"]["embed_size"] == 8
    unknown = run_cli("train", "reproduce", "scan-f30k-t2i-avg", *small, "--retrain", "scan-coco-t2i-avg", ok=False)
    assert "not a member of scan-f30k-t2i-avg" in str(unknown.exception)


def test_the_first_line_says_yes_only_without_reasons():
    from retr.trainers.reproduction.reproduce import reproduction_line

    assert reproduction_line({"reproduction": True, "reasons": []}) == "reproduction: yes"
    assert reproduction_line({"reproduction": False, "reasons": ["no --labels: fallback labels"]}) == \
        "reproduction: no (1 reason): no --labels: fallback labels"


@pytest.mark.slow
def test_vocab_split_builds_the_vocabulary_from_train_and_dev_as_scan(tmp_path, run_cli, synthetic_data):
    """SCAN's vocab.py counts the train and dev captions; --vocab-split (the recipes' setting) does the same, the
    default keeps the training splits only."""
    from retr.manifests.schema import read_manifest, write_manifest

    from retr.trainers.reproduction.recipes import RECIPES

    assert RECIPES["scan-f30k-t2i-avg"].members[0].settings["vocab_splits"] == ("train", "restval", "val")
    manifest, features = synthetic_data(images=40, seed=0, copy_to=tmp_path / "s")     # its manifest is edited
    records = read_manifest(manifest)
    records = [r if r.split != "val" else type(r)(r.id, r.path, r.split, tuple(c + " zebu" for c in r.captions),
                                                  r.extra) for r in records]
    write_manifest(manifest, records)
    common = ["--features", features, "--manifest", manifest, "--epochs", "1", "--batch-size", "16",
              "--embed-size", "8", "--word-dim", "8", "--val-images", "0", "--device", "cpu", "--quiet"]
    run_cli("train", "vsepp", *common, "--out", tmp_path / "default")
    run_cli("train", "vsepp", *common, "--out", tmp_path / "dev", "--vocab-split", "train,restval,val")
    words = {name: json.loads((tmp_path / name / "vocab.json").read_text())["word2idx"] for name in ("default", "dev")}
    assert "zebu" not in words["default"] and "zebu" in words["dev"]
    # splits that hold no caption (a Flickr30K manifest has no restval) are one line, and no run is left
    refused = run_cli.as_user("train", "vsepp", *map(str, common), "--out", str(tmp_path / "none"),
                              "--vocab-split", "restval")
    assert refused[0] != 0 and refused[2].count("\n") == 1 and "no captions in restval" in refused[2]
    assert not (tmp_path / "none").exists()


def test_rows_without_a_recipe_are_listed_with_their_reason_and_unmet_needs_are_reasons(run_cli):
    from retr.trainers.reproduction.recipes import NOT_EXPRESSED

    listed = json.loads(run_cli("train", "recipes", "--json").output)
    assert len(listed["not_expressed"]) == len(NOT_EXPRESSED) >= 5
    assert all(row["source"] and row["reason"] for row in listed["not_expressed"])
    ablation = next(r for r in listed["recipes"] if r["name"] == "sman-l3-table5-f30k")
    assert not ablation["unmet"] and "GloVe" in ablation["notes"]      # Tables III-V are GloVe runs
    assert RECIPES["sman-l3-table5-f30k"].members[0].settings["word_vectors"] == "glove"
    assert RECIPES["sman-glove-f30k"].published.rsum == 435.3 and "word_vectors" not in RECIPES["sman-f30k"].members[0].settings
    assert ablation["inputs"] == {} and ablation["features"]["extractor"] == "resnet152-grid"
    smfea = next(r for r in listed["recipes"] if r["name"] == "smfea-f30k")
    assert set(smfea["inputs"]) == {"trees", "concepts", "concept_vectors"}


def test_identified_table_rows_have_the_settings_the_text_names():
    """SCAN Table 4's rows by the numbers §4.4 quotes; JGCAR's d sweeps; SMAN's Tables IV-V."""
    assert RECIPES["scan-f30k-i2t-avg-uni-gru"].members[0].settings["bi_gru"] is False
    assert RECIPES["scan-f30k-i2t-avg-sum-violation"].published.i2t[0] == 45.8
    assert abs((67.9 / 45.8 - 1) - 0.482) < 1e-3        # "improving the model by 48.2%" (sentence R@1)
    assert RECIPES["jgcar-v2-d16-coco"].members[0].settings == {"lambda4": 0.0, "embed_size": 16}
    assert RECIPES["sman-l1-m0.15-table5-f30k"].members[0].settings["intra_pair_margin"] == 0.15
