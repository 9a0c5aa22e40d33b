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


class FakeWandb:
    """``wandb`` as far as ``--log wandb`` uses it: ``init`` (recorded) returns a run recording ``log`` and
    ``finish``."""

    def __init__(self):
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            def log(self, values, step):
                fake.logged.append((step, dict(values)))

            def finish(self):
                fake.finished += 1
        return Run()


def _wandb_run(data, out, monkeypatch, fake, *extra):
    import sys

    manifest, features = data
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = ["vsepp", "--features", str(features), "--manifest", str(manifest), "--out", str(out), "--embed-size",
            "16", "--word-dim", "8", "--batch-size", "16", "--log-every", "1", "--val-images", "10", "--quiet",
            "--device", "cpu", "--log", "wandb", "--wandb-project", "my-project", *extra]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output


def test_log_wandb_mirrors_the_metrics_lines_and_the_settings(data, tmp_path, monkeypatch):
    """The W&B run gets the run's settings as its config, every step's and epoch's scalars at their steps (the
    values of metrics.jsonl), and finishes; a resume continues the same W&B run (its id kept in RUN/wandb/)."""
    fake = FakeWandb()
    out = tmp_path / "run"
    _wandb_run(data, out, monkeypatch, fake, "--epochs", "1")
    (init,) = fake.inits
    run_id = (out / "wandb" / "run-id").read_text().strip()
    assert init["project"] == "my-project" and init["name"] == "run" and init["id"] == run_id and len(run_id) == 12
    assert init["resume"] == "allow" and init["dir"] == str(out) and init["config"]["model"] == "vsepp"
    assert init["config"]["model_args"]["embed_size"] == 16 and init["config"]["log"] == ["wandb"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    epoch = next(r for r in records if r["type"] == "epoch")
    logged = dict(fake.logged)
    assert [s for s, _ in fake.logged if "train/loss" in _] == [r["step"] for r in steps]
    assert all(logged[r["step"]]["train/loss"] == r["loss"] for r in steps[:-1])
    last = [v for s, v in fake.logged if s == epoch["step"] and "val/rsum" in v][0]
    assert last["val/rsum"] == epoch["val"]["rsum"] and last["val/t2i_r1"] == epoch["val"]["t2i"]["r1"]
    assert fake.finished == 1
    _wandb_run(data, out, monkeypatch, fake, "--epochs", "2", "--resume")
    assert [i["id"] for i in fake.inits] == [run_id, run_id] and fake.finished == 2


def test_log_wandb_offline_writes_its_run_files_under_the_run(data, tmp_path, monkeypatch):
    """The real package in W&B's offline mode: no network, the W&B run (the id RUN/wandb/run-id keeps) written
    under RUN/wandb/, started with the run's settings and finished. What it logs is the fake's test above; the
    offline transaction file is written by W&B's own service process, so it is not read here."""
    pytest.importorskip("wandb", reason="the wandb extra is not installed: pip install 'retr[wandb]'")
    import sys

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    manifest, features = data
    out = tmp_path / "run"
    args = ["vsepp", "--features", str(features), "--manifest", str(manifest), "--out", str(out), "--embed-size",
            "16", "--word-dim", "8", "--batch-size", "16", "--epochs", "1", "--val-images", "10", "--quiet",
            "--device", "cpu", "--log", "wandb"]
    assert "wandb" not in sys.modules or sys.modules["wandb"].__name__ == "wandb"
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    run_id = (out / "wandb" / "run-id").read_text().strip()
    (folder,) = (out / "wandb").glob(f"offline-run-*-{run_id}")
    assert (folder / f"run-{run_id}.wandb").is_file()
    debug = (folder / "logs" / "debug.log").read_text()
    assert "'model': 'vsepp'" in debug and f"finishing run retr/{run_id}" in debug


def test_an_unknown_log_target_or_missing_wandb_is_one_line_before_any_work(data, tmp_path, monkeypatch, run_cli):
    import sys

    from test_pipeline_wrong_inputs import assert_one_error_line

    manifest, features = data
    base = ["vsepp", "--features", features, "--manifest", manifest, "--out", tmp_path / "r", "--quiet"]
    code, stdout, stderr = run_cli.as_user("train", *base, "--log", "mlflow")
    assert_one_error_line(code, stdout, stderr)
    assert "--log mlflow: choose among tensorboard, wandb" in stderr
    monkeypatch.setitem(sys.modules, "wandb", None)                       # not installed
    code, stdout, stderr = run_cli.as_user("train", *base, "--log", "wandb")
    assert_one_error_line(code, stdout, stderr)
    assert "wandb is not installed (needed by --log wandb): pip install 'retr[wandb]'" in stderr
    assert not (tmp_path / "r").exists()
