"""``retr-train export``: every model's run becomes a pickle-free folder (safetensors, config, vocabulary, model
card) that ``retr.load_model``, ``eval`` and ``search`` read to the run's own scores; wrong inputs are one line.

One tiny run per registered model (one epoch on a small synthetic set with its side files), exported once."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from test_pipeline_wrong_inputs import assert_one_error_line
from trainer_synthetic import make_synthetic

pytestmark = pytest.mark.slow

MODELS = ("vsepp", "scan", "sman", "seam", "jgcar", "smfea", "vse-infinity")
TINY = ["--embed-size", "16", "--word-dim", "8", "--batch-size", "16", "--epochs", "1", "--val-images", "5",
        "--device", "cpu", "--quiet"]
#: a model's settings for a tiny run beyond TINY, and the side files it takes
EXTRA = {"sman": ["--shortlist", "0"], "seam": ["--hops", "2", "--attention-hidden", "8", "--gru-size", "8"],
         "jgcar": ["--hidden-size", "8", "--num-negatives", "3", "--shortlist", "5"],
         "smfea": ["--tree-hidden", "8", "--concept-word-dim", "8"]}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``{model: (run, export)}`` and the data: every model trained once and exported once."""
    from click.testing import CliRunner

    from retr.pipeline.commands import cli as pipeline
    from retr.trainers.commands import cli

    folder = tmp_path_factory.mktemp("export")
    manifest, features = make_synthetic(folder / "s", images=30, seed=0)
    conllu = folder / "s" / "captions.conllu"
    for args in (["parse-trees", "--manifest", manifest, "--conllu", conllu, "--out", folder / "trees.h5", "--quiet"],
                 ["build-concepts", "--manifest", manifest, "--conllu", conllu, "--out", folder / "concepts.h5"]):
        result = CliRunner().invoke(pipeline, [str(a) for a in args])
        assert result.exit_code == 0, result.output
    from retr.store.features import FeatureSet

    regions = str(FeatureSet(features).feature_shape[0])
    side = {"smfea": ["--trees", folder / "trees.h5", "--concepts", folder / "concepts.h5", "--num-regions", regions],
            "jgcar": ["--num-regions", regions]}
    runs = {}
    for model in MODELS:
        run, export = folder / "runs" / model, folder / "exports" / model
        args = [model, "--features", features, "--manifest", manifest, "--out", run, *TINY, *EXTRA.get(model, []),
                *side.get(model, [])]
        result = CliRunner().invoke(cli, [str(a) for a in args])
        assert result.exit_code == 0, (model, result.output)
        result = CliRunner().invoke(cli, ["export", str(run), "--out", str(export)])
        assert result.exit_code == 0, (model, result.output)
        runs[model] = (run, export)
    return runs, Path(manifest), Path(features)


def test_an_export_holds_four_files_and_no_pickle(exported):
    from retr.store.features import FeatureSet

    runs, _, features = exported
    shape = [int(n) for n in FeatureSet(features).feature_shape]
    for model, (run, export) in runs.items():
        assert sorted(p.name for p in export.iterdir()) == ["README.md", "config.json", "model.safetensors",
                                                              "vocab.json"], model
        config = json.loads((export / "config.json").read_text())
        assert config["model"] == model and config["features"] == "" and config["manifest"] == ""
        assert config["export"]["format_version"] == 1 and config["export"]["checkpoint"] == "best.pt"
        assert config["export"]["features"]["shape"] == shape and "device" not in config
        assert (export / "model.safetensors").read_bytes()[8:9] == b"{"      # safetensors: a JSON header, no pickle


@pytest.mark.parametrize("model", MODELS)
def test_an_export_scores_as_its_run(exported, model, run_cli, tmp_path):
    """The same numbers through ``eval`` (the export given the run's data; and the same float64 similarity matrix
    where the model has one: two-step JGCAR ranks each direction apart), the same model weights through
    ``retr.load_model``, the same hits through search."""
    import retr

    runs, manifest, features = exported
    run, export = runs[model]
    data = ["--features", features, "--manifest", manifest]
    two_step = model == "jgcar"
    sims, results = {}, {}
    for name, folder in (("run", run), ("export", export)):
        save = [] if two_step else ["--save-sims", tmp_path / f"{name}.npy"]
        out = run_cli("train", "eval", folder, *data, "--protocol", "f30k-1k", "--allow-size-mismatch", "--json",
                      "--device", "cpu", *save).output
        results[name] = {k: v for k, v in json.loads(out.strip().splitlines()[-1]).items()
                         if k in ("i2t", "t2i", "rsum", "images", "captions")}
        if not two_step:
            sims[name] = np.load(tmp_path / f"{name}.npy")
    assert results["export"] == results["run"]
    if not two_step:
        np.testing.assert_array_equal(sims["export"], sims["run"])
    trained, run_vocab, _ = retr.load_model(run)
    loaded, vocab, config = retr.load_model(export)
    assert config["model"] == model and vocab.to_json() == run_vocab.to_json()
    for (name, a), (_, b) in zip(trained.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    hits = [retr.Retriever.from_run(folder, features=str(features), manifest=str(manifest), device="cpu",
                                    cache=False).text_to_images(["a red circle"], k=3)[0].to_json()
            for folder in (run, export)]
    assert hits[0] == hits[1]


def test_the_model_card_renders_the_runs_table(exported, run_cli, tmp_path):
    """After ``eval``, an export's card holds the run's stored results as a markdown table (the mismatched
    protocol marked), the features to extract and how to load it, under the Hub's YAML header."""
    runs, manifest, features = exported
    run, _ = runs["scan"]
    copy = tmp_path / "scan"
    shutil.copytree(run, copy)
    (copy / "eval.json").unlink(missing_ok=True)          # only this evaluation in the card
    run_cli("train", "eval", copy, "--protocol", "f30k-1k", "--allow-size-mismatch", "--quiet", "--device", "cpu")
    run_cli("train", "export", copy, "--out", tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    header, body = card.split("---\n")[1], card.split("---\n", 2)[2]
    assert "library_name: retr" in header and "- scan" in header and "- recall" in header
    table = [line for line in body.splitlines() if line.startswith("| scan ")]
    stored = json.loads((copy / "eval.json").read_text())["results"][0]
    assert len(table) == 1 and "f30k-1k*" in table[0] and f"{stored['rsum']:.1f}" in table[0]
    assert "* scan: f30k-1k on a test split of" in body
    assert "retr.load_model(" in body and "## Features it needs" in body


def _one_line(run_cli, *argv):
    code, stdout, stderr = run_cli.as_user("train", *argv)
    assert_one_error_line(code, stdout, stderr)
    return stderr


def test_wrong_inputs_are_one_line_and_write_nothing(exported, run_cli, tmp_path):
    runs, manifest, features = exported
    run, export = runs["vsepp"]
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    assert "is not empty" in _one_line(run_cli, "export", run, "--out", full)
    assert (full / "keep.txt").read_text() == "mine" and len(list(full.iterdir())) == 1
    assert "is an export already" in _one_line(run_cli, "export", export, "--out", tmp_path / "again")
    assert "holds no config.json, so it is not a run folder" in _one_line(run_cli, "export", tmp_path, "--out",
                                                                           tmp_path / "x")
    assert not (tmp_path / "again").exists() and not (tmp_path / "x").exists()
    # weights of another model under this config: refused when loaded, naming the file
    other = tmp_path / "mixed"
    shutil.copytree(export, other)
    shutil.copy(runs["scan"][1] / "model.safetensors", other / "model.safetensors")
    assert "does not hold the weights of the vsepp model" in _one_line(
        run_cli, "eval", other, "--features", features, "--manifest", manifest, "--protocol", "f30k-1k",
        "--allow-size-mismatch", "--device", "cpu")
    # a file that is no safetensors
    (other / "model.safetensors").write_bytes(b"not safetensors")
    assert "is not a readable safetensors file" in _one_line(
        run_cli, "eval", other, "--features", features, "--manifest", manifest, "--protocol", "f30k-1k",
        "--allow-size-mismatch", "--device", "cpu")
    # an export evaluated without data: it records no local path
    assert "pass --features and --manifest" in _one_line(run_cli, "eval", export, "--protocol", "f30k-1k",
                                                         "--allow-size-mismatch", "--device", "cpu")


def test_nothing_is_written_into_a_local_export(exported, run_cli, tmp_path):
    """An export is shared as made: ``eval`` records no result in it and ``search`` keeps its gallery cache in
    ``$RETR_CACHE/search/`` (found again by the next search); its weights have its other files' mode (safetensors
    wrote them 0600)."""
    import os

    runs, manifest, features = exported
    export = shutil.copytree(runs["vsepp"][1], tmp_path / "export")
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in export.iterdir()}
    search = ["search", export, "--features", features, "--manifest", manifest, "--query", "a red circle", "--json",
              "--device", "cpu", "--quiet"]
    first = run_cli("train", *search).output
    caches = sorted((Path(os.environ["RETR_CACHE"]) / "search").rglob("*.pt"))
    assert caches and run_cli("train", *search).output == first
    run_cli("train", "eval", export, "--features", features, "--manifest", manifest, "--protocol", "f30k-1k",
            "--allow-size-mismatch", "--device", "cpu", "--quiet")
    assert {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in export.iterdir()} == before
    for _run, folder in runs.values():
        modes = {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}
        assert len(set(modes.values())) == 1, modes


def test_the_model_cards_extract_command_makes_the_same_features(synthetic_data, run_cli, tmp_path, monkeypatch):
    """The card's ``retr-pipeline extract`` command carries every setting the feature set records: for ``make
    demo``'s region features (a random detector at 224 px, 36 proposals, 7×7 pooling) the command, run as printed,
    builds the extractor with the options that made the set (the extraction itself is not run here)."""
    import inspect
    import shlex
    from types import SimpleNamespace

    from retr.extractors.base import build_extractor, extractor_spec
    from retr.extractors.recorded import extraction_options
    from retr.store.features import FeatureSet, ShardWriter, shard_name, write_index

    demo = {"weights": "random", "short_side": 224, "max_side": 224, "post_nms_topk": 36, "pooled_size": 7}
    manifest, scene = synthetic_data(images=40)
    rows = FeatureSet(scene)
    features = tmp_path / "features" / "butd-regions.h5"
    shard = features.parent / "butd-regions" / shard_name(0, 1)
    attrs = {**build_extractor("butd-regions", **demo).attrs(), "manifest_sha256": "0" * 64}   # as extract adds
    with ShardWriter(shard, attrs, rows.feature_shape) as writer:
        writer.append(list(rows.ids), rows.read_all())      # the demo's attributes on rows the trainer can read
    write_index(features, [shard])
    run, export = tmp_path / "run", tmp_path / "export"
    run_cli("train", "vsepp", "--features", features, "--manifest", manifest, "--out", run, *TINY)
    run_cli("train", "export", run, "--out", export)
    card = (export / "README.md").read_text()
    command, = [line for line in card.splitlines() if line.startswith("retr-pipeline extract ")]
    for flag in ("--weights random", "--short-side 224", "--max-side 224", "--post-nms-topk 36", "--pooled-size 7"):
        assert flag in command, command

    built = []
    monkeypatch.setattr("retr.pipeline.commands.extract.extract_features",
                        lambda manifest, name, out, options, **kw: built.append((name, options)) or
                        SimpleNamespace(line=lambda: "not extracted"))
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    shutil.copy(manifest, work / "data" / "manifest.jsonl")
    monkeypatch.chdir(work)                                 # the card's paths: data/manifest.jsonl, data/features
    code, _out, err = run_cli.as_user("pipeline", *shlex.split(command)[1:])
    assert code == 0, err
    (name, options), = built
    recorded = extraction_options(FeatureSet(features))[1]
    defaults = {k: p.default for k, p in inspect.signature(extractor_spec(name).builder).parameters.items()}
    assert name == "butd-regions" and options["weights"] == "random"
    assert {k: options.get(k, defaults[k]) for k in recorded} == recorded
