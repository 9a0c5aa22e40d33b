"""bench/gpu.py runs every stage on CPU at CI sizes, each line with its baseline and agreeing with it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "gpu.jsonl"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--tiny", "--device", "cpu",
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [json.loads(line) for line in done.stdout.splitlines()]
    assert printed == [json.loads(line) for line in out.read_text().splitlines()]
    return printed


def by_stage(records, stage):
    found = [r for r in records if r["stage"] == stage]
    assert found, f"no {stage} line"
    return found


def test_every_line_names_its_device_and_carries_its_baseline(records):
    assert {r["stage"] for r in records} == {"backbone", "butd", "train", "eval"}
    for r in records:
        assert r["bench"] == "gpu" and r["device"].startswith("cpu")
        assert r["baseline"]["what"] and r["speedup"] > 0


def test_backbone_loop_agrees_with_the_plain_loop_and_is_bounded_by_forward_only(records):
    for r in by_stage(records, "backbone"):
        assert r["images"] == 4 and r["decode"] == "cpu" and r["autocast"] == "none"
        assert r["agreement_min_cosine"] > 0.9999           # float32, the same decoder: the same features
        assert r["images_per_s"] > 0 and r["bound"]["images_per_s"] > 0 and r["of_bound"] > 0


def test_batched_butd_keeps_the_one_image_boxes(records):
    (r,) = by_stage(records, "butd")
    same, n = map(int, r["same_boxes"].split("/"))
    # exactness is tests/test_butd_batched.py's (oneDNN off); here the CPU's kernels may sum in another order,
    # which can swap two near-tied boxes of random weights, so most (not all) images keep the same boxes
    assert r["detector_batch"] == 2 and n == 4 and same >= 2
    assert r["max_feature_difference"] < 1e-3


def test_bench_refuses_an_unknown_stage():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--stages", "nope"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "unknown stage 'nope'" in done.stderr


def test_every_model_trains_through_the_loop_as_the_authors_style_loop_does(records):
    lines = by_stage(records, "train")
    assert sorted(r["model"] for r in lines) == ["jgcar", "scan", "seam", "sman", "smfea", "vsepp"]
    for r in lines:
        assert r["steps"] == 2 and r["steps_per_s"] > 0 and r["baseline"]["steps_per_s"] > 0
        assert r["preload"] == "host" and r["amp"] == "off" and set(r["optimizer"].split("+")) == {"loop"}
        # float32 on the CPU, the same weights, batches and dropout masks: the same first loss to rounding
        assert r["first_loss_relative_difference"] < 1e-5, r
        # what a step dispatches (kernels and the GPU's busy share are CUDA's only), and the precisions in force
        assert 0 < r["per_step"]["launching"] <= r["per_step"]["ops"] and "kernels" not in r["per_step"], r
        assert r["tf32"] and all(isinstance(v, (str, bool)) for v in r["tf32"].values())


def test_scan_evaluation_ranks_equal_float64_and_the_authors_loop(records):
    (r,) = by_stage(records, "eval")
    assert (r["images"], r["captions"]) == (40, 200) and r["seconds"] > 0
    assert r["identical_ranks_vs_float64"] == {"t2i": 1.0, "i2t": 1.0}
    assert r["identical_t2i_ranks_vs_baseline"] == 1.0
    assert r["baseline"]["captions_timed"] == 20 and 0 < r["rescored_fraction"] < 1
    assert 0 < r["per_caption"]["launching"] <= r["per_caption"]["ops"] and r["tf32"]
