"""Runs written before the ModelSpec registry still load and evaluate to the numbers they had.

``tests/data/legacy_runs/{scan,smfea,jgcar}`` were trained and evaluated by the code of commit 8c160cb
(``make_legacy_runs.py`` says how). Their ``config.json`` has the old form (SMFEA's ``trees``/``concepts`` and
JGCAR's ``labels`` among ``model_args``, partial ``model_args``); the synthetic data they were made from is made
again here (seeded), and ``retr-train eval`` must reproduce the stored ``eval.json`` numbers.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

LEGACY = Path(__file__).parent / "data" / "legacy_runs"


@pytest.mark.parametrize("name", ["scan", "smfea", "jgcar"])
def test_legacy_run_loads_and_evaluates_to_its_numbers(name, synthetic_data, tmp_path, run_cli):
    from retr.trainers.runs import checkpoint as ckpt

    manifest, features = synthetic_data(images=60, seed=0)
    run = tmp_path / name
    shutil.copytree(LEGACY / name, run)
    stored = json.loads((LEGACY / name / "eval.json").read_text())["results"][0]
    (run / "eval.json").unlink()
    config = ckpt.read_config(run)
    if name == "smfea":
        assert set(config["inputs"]) == {"trees", "concepts"} and "trees" not in config["model_args"]
    if name == "jgcar":
        assert set(config["inputs"]) == {"labels"} and "labels" not in config["model_args"]
    run_cli("train", "eval", run, "--protocol", "f30k-1k", "--allow-size-mismatch", "--features", features, "--manifest", manifest,
            "--device", "cpu", "--quiet")
    result = json.loads((run / "eval.json").read_text())["results"][0]
    for side in ("i2t", "t2i"):
        for key in ("r1", "r5", "r10", "medr", "meanr"):
            assert result[side][key] == pytest.approx(stored[side][key], abs=1e-9), (side, key)
    assert result["rsum"] == pytest.approx(stored["rsum"], abs=1e-9)
