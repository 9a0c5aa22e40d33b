"""Resume continues exactly: the losses of 1 epoch + resume equal those of an uninterrupted 2-epoch run."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from retr.common.errors import UserError
from retr.trainers.cli import cli
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
