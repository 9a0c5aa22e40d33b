"""No pickle payload runs from a checkpoint without --trust-checkpoint; retr's own checkpoints need no pickle."""
from __future__ import annotations

import pathlib

import pytest
import torch

from retr.trainers.runs import checkpoint as ckpt


class Payload:
    """Pickles as a call that creates a marker file: the code a planted checkpoint would run."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


@pytest.fixture(scope="module")
def trained_run(synthetic_data, synthetic_run):
    """The shared run (read-only: the tests below plant files in copies)."""
    manifest, features = synthetic_data(images=30)
    run = synthetic_run("vsepp", "--epochs", "2", "--batch-size", "16", "--train-split", "train", "--embed-size",
                        "16", "--word-dim", "8", "--device", "cpu", "--quiet", images=30)
    return run, manifest, features


def test_own_checkpoints_hold_no_pickled_objects(trained_run):
    run, _, _ = trained_run
    for path in (run / "best.pt", *run.glob("checkpoint-*.pt")):
        assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []
        torch.load(path, weights_only=True)           # loads with no allow-list at all


def _plant(path: pathlib.Path, marker: pathlib.Path) -> None:
    state = torch.load(path, weights_only=True)
    state["extra"] = Payload(marker)
    torch.save(state, path)


def test_planted_best_checkpoint_does_not_run_in_eval(trained_run, tmp_path, run_cli):
    import shutil

    run, manifest, features = trained_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    marker = tmp_path / "pwned"
    _plant(copy / "best.pt", marker)
    code, _, err = run_cli.as_user("train", "eval", copy, "--protocol", "f30k-1k", "--allow-size-mismatch",
                                   "--device", "cpu", "--quiet")
    assert code != 0 and not marker.exists()
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert "--trust-checkpoint" in err and "Python objects" in err
    run_cli("train", "eval", copy, "--protocol", "f30k-1k", "--allow-size-mismatch", "--device", "cpu", "--quiet",
            "--trust-checkpoint")
    assert marker.exists()                          # opted in: the file is read as it is


def test_planted_epoch_checkpoint_does_not_run_on_resume(trained_run, tmp_path, run_cli):
    import shutil

    run, manifest, features = trained_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    marker = tmp_path / "pwned"
    newest = ckpt.list_checkpoints(copy)[-1][1]
    _plant(newest, marker)
    args = ["vsepp", "--features", features, "--manifest", manifest, "--out", copy, "--epochs", "3",
            "--batch-size", "16", "--train-split", "train", "--embed-size", "16", "--word-dim", "8",
            "--device", "cpu", "--quiet", "--resume"]
    code, _, err = run_cli.as_user("train", *args)
    assert code != 0 and not marker.exists() and "--trust-checkpoint" in err
    assert len(err.strip().splitlines()) == 1


def test_legacy_numpy_rng_state_is_the_only_extra_allowed(tmp_path):
    import numpy as np

    path = tmp_path / "legacy.pt"
    torch.save({"rng": {"numpy": np.random.get_state()}}, path)
    assert isinstance(ckpt.load_checkpoint(path)["rng"]["numpy"][1], np.ndarray)
    torch.save({"rng": {"numpy": np.random.get_state()}, "obj": Payload(tmp_path / "m")}, path)
    with pytest.raises(Exception, match="--trust-checkpoint"):
        ckpt.load_checkpoint(path)
    assert not (tmp_path / "m").exists()
