"""Resume continues exactly: the losses of 1 epoch + resume equal those of an uninterrupted 2-epoch run."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from retr.common.errors import UserError
from retr.trainers.commands import cli
from trainer_synthetic import make_synthetic

ARGS = ["--embed-size", "16", "--word-dim", "8", "--batch-size", "16", "--quiet", "--log-every", "1",
        "--val-images", "10"]


def _train(features, manifest, out, epochs, *extra):
    return CliRunner().invoke(cli, ["scan", "--features", features, "--manifest", manifest, "--out", str(out),
                                    "--epochs", str(epochs), *ARGS, *extra], catch_exceptions=False)


def _losses(run):
    """The step and epoch lines (not the events: a run stopped at 1 epoch has ended, and may say so)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "event" not in line]


@pytest.mark.slow
def test_resume_gives_the_same_losses(tmp_path):
    manifest, features = make_synthetic(tmp_path, images=60)
    manifest, features = str(manifest), str(features)
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert _train(features, manifest, straight, 2).exit_code == 0
    assert _train(features, manifest, split, 1).exit_code == 0
    with pytest.raises(UserError, match="--resume"):
        _train(features, manifest, split, 2)
    assert _train(features, manifest, split, 2, "--resume").exit_code == 0
    a, b = _losses(straight), _losses(split)
    assert [line.get("loss") for line in a] == [line.get("loss") for line in b]
    assert [line.get("val") for line in a] == [line.get("val") for line in b]
    assert sum("loss" in line for line in a) > 4


@pytest.mark.slow
@pytest.mark.parametrize("left", [[], ["run.lock"], None])
def test_resume_of_a_run_killed_before_its_settings_starts_it(tmp_path, left):
    """Requeue scripts always pass --resume: a run killed before config.json (nothing there, only run.lock, or
    no folder at all) starts with a note and trains as a fresh run does."""
    manifest, features = make_synthetic(tmp_path, images=40)
    out = tmp_path / "run"
    if left is not None:
        out.mkdir()
        for name in left:
            (out / name).write_text("")
    result = CliRunner().invoke(cli, ["scan", "--features", str(features), "--manifest", str(manifest), "--out",
                                      str(out), "--epochs", "1", *ARGS, "--resume"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "nothing to resume" in result.stderr and "starting the run" in result.stderr
    assert (out / "best.pt").is_file() and json.loads((out / "config.json").read_text())["epochs"] == 1
