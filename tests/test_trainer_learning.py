"""End to end: `retr-train scan` / `vsepp` learn the synthetic task; `eval` (single, ensemble, JSON, sims); `table`.

Features come from the scene descriptions (tests/trainer_synthetic.py), not from an extractor with random
weights, so the test checks that the trainer learns rather than how informative random CNN features are.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from retr.trainers.commands import cli

TINY = ["--embed-size", "64", "--word-dim", "32", "--batch-size", "32", "--lr", "2e-3", "--quiet",
        "--log-every", "5"]


def _invoke(args):
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def synthetic(synthetic_data, tmp_path_factory):
    """(this module's output folder, manifest, features) of the 200-image synthetic set."""
    manifest, features = synthetic_data(images=200)
    return tmp_path_factory.mktemp("synthetic"), str(manifest), str(features)


TRAINED = {"scan": ["--direction", "t2i", "--epochs", "3"], "vsepp": ["--epochs", "4"]}


@pytest.fixture(scope="module")
def trained(synthetic, synthetic_run):
    """The SCAN and VSE++ runs, trained once whatever the order of the tests (this module's copies, which they
    evaluate): model → (run folder, what training printed)."""
    folder, _, _ = synthetic
    runs = {}
    for model, extra in TRAINED.items():
        run = synthetic_run(model, *TINY, *extra, images=200, copy_to=folder / f"run-{model}")
        runs[model] = run, synthetic_run.printed(run)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(TRAINED))
def test_training_reaches_many_times_chance(synthetic, trained, model):
    folder, manifest, features = synthetic
    run, printed = trained[model]
    assert "warning" not in printed
    assert {"config.json", "vocab.json", "best.pt", "metrics.jsonl"} <= {p.name for p in run.iterdir()}
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epochs = [line for line in lines if "val" in line]
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    # a healthy run (SCAN and VSE++ train on hardest negatives here) gives no collapse warning
    assert not [line for line in lines if "event" in line]
    top1 = [line["in_batch_top1"] for line in lines if "in_batch_top1" in line]
    assert np.mean(top1[-3:]) > 5 / 32
    out = _invoke(["eval", str(run), "--protocol", "f30k-1k", "--allow-size-mismatch", "--json", "--save-sims", str(folder / f"{model}.npy")])
    result = json.loads(out)
    assert result["images"] == 20 and result["captions"] == 100 and result["ensemble"] is False
    chance = 100 * 1 / 20                          # R@1 of a random ranking of 20 images (and of 5 of 100 captions)
    assert result["t2i"]["r1"] >= 5 * chance and result["i2t"]["r1"] >= 5 * chance, result
    assert result["rsum"] == pytest.approx(sum(result[s][k] for s in ("i2t", "t2i") for k in ("r1", "r5", "r10")))
    sims = np.load(folder / f"{model}.npy")
    assert sims.shape == (20, 100) and sims.dtype == np.float64
    assert (sims.argmax(axis=0) == np.arange(100) // 5).mean() * 100 == pytest.approx(result["t2i"]["r1"])
    text = _invoke(["eval", str(run), "--protocol", "f30k-1k", "--allow-size-mismatch"])
    assert "single model" in text and "rsum" in text


@pytest.mark.slow
def test_ensemble_and_table(synthetic, trained):
    folder, manifest, features = synthetic
    runs = [trained["scan"][0], trained["vsepp"][0]]
    margins = []
    for model in ("scan", "vsepp"):          # each run's own matrix, as the single-model test saves it
        margins.append(json.loads(_invoke(["eval", str(trained[model][0]), "--protocol", "f30k-1k",
                                           "--allow-size-mismatch", "--json", "--save-sims",
                                           str(folder / f"{model}.npy")]))["refinement"]["margin"])
    result = json.loads(_invoke(["eval", *map(str, runs), "--protocol", "coco-1k", "--allow-size-mismatch", "--json",
                                 "--save-sims", str(folder / "ens.npy")]))
    assert result["ensemble"] is True and len(result["folds"]) == 5
    # refined: each matrix holds float64 scores where ranks are decided and float32 estimates elsewhere, each within
    # half its refinement's margin of its float64 value; a pair one evaluation rescored and another did not differs
    # by at most that, so the ensemble is its members' mean within the margins, not to the last digit
    margins.append(result["refinement"]["margin"])
    mean = (np.load(folder / "scan.npy") + np.load(folder / "vsepp.npy")) / 2
    np.testing.assert_allclose(np.load(folder / "ens.npy"), mean, rtol=0, atol=sum(margins) / 2)
    table = _invoke(["table", *map(str, runs)])
    assert "ensemble of 2" in table and "single" in table and "scan(t2i)" in table and "vsepp" in table


def test_early_stop_ends_the_run_and_resume_respects_it(synthetic):
    """With lr 0 nothing improves after the first validation: --early-stop 1 stops after epoch 2 of 5,
    and --resume of the stopped run trains nothing more."""
    folder, manifest, features = synthetic
    run = folder / "run-early-stop"
    args = ["vsepp", "--features", features, "--manifest", manifest, "--out", str(run), "--embed-size", "16",
            "--word-dim", "8", "--batch-size", "64", "--lr", "0", "--epochs", "5", "--early-stop", "1", "--quiet"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "early stop: no better validation rSum for 1 epochs (best" in result.output
    epochs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in epochs if "val" in e] == [1, 2]
    assert json.loads((run / "config.json").read_text())["early_stop"] == 1
    result = CliRunner().invoke(cli, args + ["--resume"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    epochs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in epochs if "val" in e] == [1, 2]


def test_table_tells_seeds_apart_in_every_format(synthetic, tmp_path):
    folder, manifest, features = synthetic
    runs = []
    for seed in (0, 1):
        run = tmp_path / f"vsepp-s{seed}"
        _invoke(["vsepp", "--features", features, "--manifest", manifest, "--out", str(run), "--embed-size", "16",
                 "--word-dim", "8", "--batch-size", "64", "--epochs", "1", "--seed", str(seed), "--quiet"])
        _invoke(["eval", str(run), "--protocol", "f30k-1k", "--allow-size-mismatch", "--quiet"])
        runs.append(str(run))
    text = _invoke(["table", *runs])
    lines = text.splitlines()
    assert lines[0].split()[:7] == ["run", "model", "preset", "seed", "protocol", "split", "kind"]
    rows = [line.split() for line in lines[2:4]]
    # each run was evaluated on its 20-image test split, not f30k-1k's 1,000: the protocol is marked and a note says so
    assert [r[:7] for r in rows] == [["vsepp-s0", "vsepp", "f30k", "0", "f30k-1k*", "test", "single"],
                                     ["vsepp-s1", "vsepp", "f30k", "1", "f30k-1k*", "test", "single"]]
    assert lines[4:] == ["* vsepp-s0, vsepp-s1: f30k-1k on a test split of 20 images, not the protocol's 1,000 "
                         "(--allow-size-mismatch): not comparable with published numbers"]   # one note for both
    import csv
    import io

    table = list(csv.reader(io.StringIO(_invoke(["table", *runs, "--format", "csv"]))))
    stored = json.loads((tmp_path / "vsepp-s1" / "eval.json").read_text())["results"][0]
    assert table[2][0] == "vsepp-s1" and float(table[2][-1]) == stored["rsum"]      # csv: full precision
    assert len(table) == 3 and table[2][4] == "f30k-1k*"            # csv: data rows only, the mark in the cell
    markdown = _invoke(["table", *runs, "--format", "markdown"])
    assert markdown.splitlines()[0].startswith("| run") and markdown.splitlines()[1].startswith("|---")
    assert markdown.splitlines()[-1].startswith("* vsepp-s0, vsepp-s1: f30k-1k on a test split of 20 images")
    assert "\\begin{tabular}" in _invoke(["table", *runs, "--format", "latex"])
