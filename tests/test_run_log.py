"""trainers/runs/run_log.py: typed ``metrics.jsonl`` records with per-pair losses, TensorBoard logging that a
resume keeps consistent, and ``retr-train plot``."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from retr.trainers.commands import cli
from retr.trainers.runs.run_log import read_metrics, record_type


@pytest.fixture(scope="module")
def data(synthetic_data):
    return tuple(map(str, synthetic_data(images=40)))


def _train(data, out, epochs, *extra):
    manifest, features = data
    result = CliRunner().invoke(cli, ["vsepp", "--features", features, "--manifest", manifest, "--out", str(out),
                                      "--epochs", str(epochs), "--embed-size", "16", "--word-dim", "8",
                                      "--batch-size", "16", "--log-every", "1", "--quiet", "--device", "cpu",
                                      "--val-images", "10", *extra])
    assert result.exit_code == 0, result.output
    return out


def test_records_are_typed_and_losses_also_per_pair(data, tmp_path):
    run = _train(data, tmp_path / "run", 1)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {line["type"] for line in lines} <= {"step", "epoch", "event"} and lines[-1]["type"] in ("epoch", "event")
    steps = [line for line in lines if line["type"] == "step"]
    captions = 32 * 5                                          # 32 training images, 5 captions each
    sizes = [16] * (captions // 16) + ([captions % 16] if captions % 16 else [])
    assert [s["loss_mean"] for s in steps] == pytest.approx([s["loss"] / n for s, n in zip(steps, sizes)])
    [epoch] = [line for line in lines if line["type"] == "epoch"]
    assert epoch["train_loss_mean"] == pytest.approx(sum(s["loss"] for s in steps) / captions)
    assert record_type({"loss": 1.0}) == "step" and record_type({"val": {}}) == "epoch"   # older runs
    assert record_type({"event": "collapse"}) == "event"


def _scalars(run, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_mirrors_the_log_and_a_resume_purges_the_lost_stretch(data, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    straight = _train(data, tmp_path / "straight", 2, "--log", "tensorboard")
    steps = [r for r in read_metrics(straight) if r["type"] == "step"]
    logged = _scalars(straight, "train/loss_mean")
    assert [s for s, _ in logged] == [r["step"] for r in steps]
    assert np.allclose([v for _, v in logged], [r["loss_mean"] for r in steps], rtol=1e-6)
    assert len(_scalars(straight, "val/rsum")) == 2
    split = _train(data, tmp_path / "split", 1, "--log", "tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    stale = SummaryWriter(str(split / "tensorboard"))          # what a killed second epoch would have logged
    stale.add_scalar("train/loss_mean", 123.0, len(steps) // 2 + 1)
    stale.close()
    assert CliRunner().invoke(cli, ["vsepp", "--out", str(split), "--resume", "--epochs", "2",
                                    "--quiet"]).exit_code == 0
    resumed = _scalars(split, "train/loss_mean")
    assert 123.0 not in [v for _, v in resumed]
    assert [s for s, _ in resumed] == [s for s, _ in logged]


def test_plot_draws_several_runs(data, tmp_path):
    runs = [_train(data, tmp_path / f"s{seed}", 2, "--seed", str(seed)) for seed in (0, 1)]
    out = tmp_path / "curves.png"
    result = CliRunner().invoke(cli, ["plot", *map(str, runs), "--out", str(out)])
    assert result.exit_code == 0, result.output
    from PIL import Image

    image = np.asarray(Image.open(out).convert("L"), dtype=np.float32)
    assert image.shape == (306, 1080) and image.std() > 5    # the report's three panels (12 × 3.4 in at 90 dpi), drawn
    missing = CliRunner().invoke(cli, ["plot", str(tmp_path), "--out", str(out)])
    assert missing.exit_code != 0 and "no metrics.jsonl" in str(missing.exception)


def test_epochs_count_from_one_as_the_console_and_old_logs_are_read_so(data, tmp_path):
    run = _train(data, tmp_path / "run", 2)
    records = read_metrics(run)
    assert [r["epoch"] for r in records if r["type"] == "epoch"] == [1, 2]
    assert {r["epoch"] for r in records if r["type"] == "step"} == {1, 2}
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.jsonl").write_text('{"epoch": 0, "step": 1, "loss": 3.0}\n'
                                       '{"epoch": 0, "step": 1, "train_loss": 3.0, "val": {}}\n{"epoch": 1, "st')
    assert [(r["type"], r["epoch"]) for r in read_metrics(old)] == [("step", 1), ("epoch", 1)]
