"""Training runs that stop and go on (trainers/training/loop.py, checkpoint.py, common/locks.py): one process per
run, resume from anything a kill leaves — to the losses of the uninterrupted run —, the same data and settings on
resume, non-finite values and wrong-kind features stopped in one line.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from retr.common.errors import UserError
from retr.common.locks import exclusive_lock
from retr.trainers.commands import cli
from retr.trainers.runs import checkpoint as ckpt
from retr.trainers.runs.layout import BEST, CONFIG, LOCK, METRICS
from trainer_synthetic import write_uninformative_regions


TINY = ["--embed-size", "16", "--word-dim", "8", "--batch-size", "16", "--quiet", "--log-every", "1",
        "--val-images", "10", "--device", "cpu"]
RETR_TRAIN = [sys.executable, "-c", "from retr.trainers.commands import main; main()"]


@pytest.fixture(scope="module")
def data(synthetic_data):
    """(folder, manifest, features) of the shared (read-only) synthetic set."""
    manifest, features = synthetic_data(images=60)     # 48 training images, 240 captions: 15 steps an epoch
    return manifest.parent, str(manifest), str(features)


def _train(data, out, epochs, *extra, model="vsepp"):
    _, manifest, features = data
    return CliRunner().invoke(cli, [model, "--features", features, "--manifest", manifest, "--out", str(out),
                                    "--epochs", str(epochs), *TINY, *extra])


def _lines(run: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock field (the one thing two identical runs do not share)."""
    lines = [json.loads(line) for line in (run / METRICS).read_text().splitlines()]
    return [{k: v for k, v in line.items() if k != "seconds"} for line in lines]


def _error_line(result) -> str:
    lines = [line for line in result.output.strip().splitlines() if line]
    assert result.exit_code != 0 and isinstance(result.exception, UserError), result.output
    return str(result.exception)


@pytest.fixture(scope="module")
def straight(synthetic_run, tmp_path_factory):
    """An uninterrupted 3-epoch run: what every interrupted one must end up equal to (this module's copy, which
    a test evaluates)."""
    return synthetic_run("vsepp", "--epochs", "3", *TINY, images=60,
                         copy_to=tmp_path_factory.mktemp("straight") / "run")


# ------------------------------------------------------------------------------------------------ lock

def test_a_second_process_on_the_same_out_is_refused_naming_the_holder(data, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from retr.common.locks import exclusive_lock\n"
                               f"with exclusive_lock({str(out / LOCK)!r}, 'x'):\n"
                               "    print('locked', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = _train(data, out, 1)
        message = _error_line(result)
        assert f"pid {holder.pid} on host" in message and "is in use" in message
        assert not (out / METRICS).exists() and not (out / CONFIG).exists()
    finally:
        holder.kill()
        holder.wait()
    assert _train(data, out, 1).exit_code == 0           # the lock died with its holder


@pytest.mark.slow
def test_two_runs_started_together_leave_one_run(data, tmp_path):
    _, manifest, features = data
    out = tmp_path / "run"
    args = [*RETR_TRAIN, "vsepp", "--features", features, "--manifest", manifest, "--out", str(out), "--epochs",
            "2", *TINY]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert sorted(code for code, _ in results) == [0, 1], results
    err = next(err for code, err in results if code == 1)
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert "is in use by pid" in err or "already holds a run" in err
    keys = [(line["epoch"], line["step"], "val" in line) for line in _lines(out) if "event" not in line]
    assert len(keys) == len(set(keys)) == 2 * 15 + 2


def test_lock_helper_refuses_then_releases(tmp_path):
    with exclusive_lock(tmp_path / "l", "thing"):
        pid = os.fork()
        if pid == 0:                                       # a child process: the lock is the parent's
            try:
                with exclusive_lock(tmp_path / "l", "thing"):
                    os._exit(3)
            except UserError as exc:
                os._exit(0 if f"pid {os.getppid()}" in str(exc) else 4)
        assert os.waitpid(pid, 0)[1] >> 8 == 0
    with exclusive_lock(tmp_path / "l", "thing"):
        pass


# ------------------------------------------------------------------------------------------------ resume

def test_resume_without_a_checkpoint_starts_again_and_matches(data, straight, tmp_path):
    out = tmp_path / "run"
    assert _train(data, out, 1).exit_code == 0
    for path in (*out.glob("checkpoint-*.pt"), out / BEST):   # as if killed before the first checkpoint
        path.unlink()
    with open(out / METRICS, "a") as handle:
        handle.write('{"epoch": 0, "step": 2, "lo')
    result = CliRunner().invoke(cli, ["vsepp", "--out", str(out), "--resume", "--epochs", "3", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "starting it again from the beginning" in result.output
    assert _lines(out) == _lines(straight)
    assert json.loads((out / CONFIG).read_text())["epochs"] == 3


def test_resume_cuts_the_log_back_to_the_checkpoint(data, straight, tmp_path):
    out = tmp_path / "run"
    assert _train(data, out, 1).exit_code == 0
    with open(out / METRICS, "a") as handle:          # the unfinished epoch 2 of a killed process
        handle.write('{"type": "step", "epoch": 2, "step": 16, "loss": 1.0, "lr": 0.0002}\n{"type": "st')
    assert CliRunner().invoke(cli, ["vsepp", "--out", str(out), "--resume", "--epochs", "3"]).exit_code == 0
    assert _lines(out) == _lines(straight)
    final = ckpt.load_checkpoint(ckpt.checkpoint_path(out, 2))
    expected = ckpt.load_checkpoint(ckpt.checkpoint_path(straight, 2))
    for key in ("model", "optimizer"):
        assert _tensors(final[key]) == _tensors(expected[key])


def _tensors(state) -> list:
    """A nested state's leaves, tensors as bytes (bitwise comparison)."""
    if isinstance(state, dict):
        return [(k, _tensors(v)) for k, v in sorted(state.items(), key=lambda kv: str(kv[0]))]
    if isinstance(state, (list, tuple)):
        return [_tensors(v) for v in state]
    if isinstance(state, torch.Tensor):
        return [str(state.dtype), list(state.shape), state.numpy().tobytes()]
    return state


def test_resume_refuses_changed_settings_by_name_and_applies_safe_ones(data, tmp_path):
    out = tmp_path / "run"
    assert _train(data, out, 1).exit_code == 0
    result = CliRunner().invoke(cli, ["vsepp", "--out", str(out), "--resume", "--lr", "1e-2", "--batch-size", "8",
                                      "--embed-size", "32"])
    message = _error_line(result)
    assert "--lr 0.01 (run: 0.0002)" in message and "--batch-size 8 (run: 16)" in message \
        and "--embed-size 32 (run: 16)" in message
    result = CliRunner().invoke(cli, ["scan", "--out", str(out), "--resume"])
    assert "is a vsepp run" in _error_line(result)
    assert CliRunner().invoke(cli, ["vsepp", "--out", str(out), "--resume", "--epochs", "2", "--lr", "2e-4",
                                    "--quiet"]).exit_code == 0        # the run's own value may be repeated
    assert json.loads((out / CONFIG).read_text())["epochs"] == 2
    assert len(ckpt.list_checkpoints(out)) == 2


def test_resume_refuses_other_data_and_follows_moved_data(data, tmp_path):
    folder, manifest, features = data
    out = tmp_path / "run"
    assert _train(data, out, 1).exit_code == 0
    other = write_uninformative_regions(folder, name=f"other-{tmp_path.name}", out=tmp_path)
    result = CliRunner().invoke(cli, ["vsepp", "--out", str(out), "--resume", "--epochs", "2",
                                      "--features", str(other)])
    assert "was trained on other data" in _error_line(result) and "features_attrs" in str(result.exception)
    edited = tmp_path / "manifest.jsonl"
    edited.write_text(Path(manifest).read_text().replace("a ", "the ", 1))
    result = CliRunner().invoke(cli, ["vsepp", "--out", str(out), "--resume", "--epochs", "2",
                                      "--manifest", str(edited)])
    assert "manifest_sha256" in _error_line(result)
    moved = tmp_path / "moved"
    shutil.copytree(Path(features).parent, moved)             # the index and its shard folder, elsewhere
    result = CliRunner().invoke(cli, ["vsepp", "--out", str(out), "--resume", "--epochs", "2", "--quiet",
                                      "--features", str(moved / Path(features).name)])
    assert result.exit_code == 0, result.output


# ------------------------------------------------------------------------------------------------ kill -9

def _spawn(args) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_kill_at_random_moments_then_resume_gives_the_uninterrupted_run(data, tmp_path):
    """kill -9 once the log has reached a random line (0: as soon as the loop starts; before the first checkpoint;
    later), then ``--resume`` with ``--out`` alone: the log line for line and the last and best checkpoints'
    tensors bit for bit equal the uninterrupted run's."""
    _, manifest, features = data
    rng = random.Random(16)
    lines_per_epoch = 16                                    # 15 step lines and the epoch line
    first = [*RETR_TRAIN, "vsepp", "--features", features, "--manifest", manifest, "--epochs", "3", *TINY]
    straight = tmp_path / "straight"          # run as the trials are (a test before may have changed torch's threads)
    subprocess.run([*first, "--out", str(straight)], check=True, capture_output=True, timeout=300)
    targets = [0, rng.randrange(1, lines_per_epoch), rng.randrange(lines_per_epoch + 1, 3 * lines_per_epoch)]
    for trial, target in enumerate(targets):
        out = tmp_path / f"trial{trial}"
        proc = _spawn([*first, "--out", str(out)])
        line = proc.stderr.readline()
        while line.startswith("note:"):                    # e.g. which preset the run starts from
            line = proc.stderr.readline()
        assert line.startswith("training"), line + proc.stderr.read()   # "training vsepp …": the loop has started
        while target and proc.poll() is None and _count_lines(out / METRICS) < target:
            time.sleep(0.002)
        assert proc.poll() is None, f"trial {trial}: the run ended before line {target}"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        resumed = subprocess.run([*RETR_TRAIN, "vsepp", "--out", str(out), "--resume", "--quiet"],
                                 capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr
        assert _lines(out) == _lines(straight), f"trial {trial} (killed at line {target})"
        for name in (ckpt.checkpoint_path(out, 2).name, BEST):
            a, b = ckpt.load_checkpoint(out / name), ckpt.load_checkpoint(straight / name)
            assert _tensors(a["model"]) == _tensors(b["model"]) and a["epoch"] == b["epoch"]
            assert _tensors(a["optimizer"]) == _tensors(b["optimizer"])


def _count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


# ------------------------------------------------------------------------------------------------ bad values

def _poison(features: Path, tmp_path: Path, image_id: str) -> Path:
    """A copy of the feature set whose row ``image_id`` holds NaN (written past the store's own checks)."""
    copy = tmp_path / "poisoned"
    shutil.copytree(features.parent, copy)
    for shard in sorted((copy / features.stem).glob("*.h5")):
        with h5py.File(shard, "r+") as f:
            ids = [i.decode() if isinstance(i, bytes) else i for i in f["ids"][:]]
            if image_id in ids:
                row = ids.index(image_id)
                f["features"][row] = np.full(f["features"].shape[1:], np.nan, dtype=f["features"].dtype)
    return copy / features.name


def test_a_nan_feature_row_stops_training_at_its_batch_naming_the_image(data, tmp_path):
    """Found before the first step by the rows' check; with --no-verify, the loop's own check stops at its batch."""
    folder, manifest, features = data
    train_ids = [json.loads(line)["id"] for line in Path(manifest).read_text().splitlines()
                 if json.loads(line)["split"] == "train"]
    poisoned = _poison(Path(features), tmp_path, train_ids[7])
    out = tmp_path / "run"
    command = ["vsepp", "--features", str(poisoned), "--manifest", manifest, "--out", str(out), "--epochs", "2", *TINY]
    message = _error_line(CliRunner().invoke(cli, command))
    assert "are not finite (NaN or inf)" in message and f"id '{train_ids[7]}'" in message
    assert "retr-pipeline verify" in message and not out.exists()
    result = CliRunner().invoke(cli, [*command, "--no-verify"])
    message = _error_line(result)
    assert train_ids[7] in message and "not finite" in message and "retr-pipeline verify" in message
    assert not list(out.glob("checkpoint-*.pt"))
    assert all(np.isfinite(line["loss"]) for line in _lines(out) if "loss" in line)


def _feature_file(path: Path, features: np.ndarray, ids: list[str]) -> Path:
    with h5py.File(path, "w") as f:
        f.create_dataset("features", data=features)
        f.create_dataset("ids", data=np.array(ids, dtype=h5py.string_dtype()))
        f.attrs.update(kind="regions", extractor="hand-made", complete=True)
    return path


@pytest.mark.parametrize("shape,dtype,words", [((60, 16), np.float32, "[N, K, D]"),
                                               ((60,), np.float32, "[N, K, D]"),
                                               ((60, 4, 16), np.int8, "int8")])
def test_features_the_trainer_cannot_read_are_refused_in_one_line(data, tmp_path, shape, dtype, words):
    folder, manifest, _ = data
    ids = [json.loads(line)["id"] for line in Path(manifest).read_text().splitlines()]
    path = _feature_file(tmp_path / "f.h5", np.ones(shape, dtype=dtype), ids)
    result = CliRunner().invoke(cli, ["vsepp", "--features", str(path), "--manifest", manifest, "--out",
                                      str(tmp_path / "run"), "--epochs", "1", *TINY])
    assert words in _error_line(result)
    assert not (tmp_path / "run").exists()                 # nothing left behind by a run that never started


def test_eval_refuses_features_of_another_width_than_the_model(data, straight, tmp_path):
    folder, manifest, _ = data
    ids = [json.loads(line)["id"] for line in Path(manifest).read_text().splitlines()]
    wide = _feature_file(tmp_path / "wide.h5", np.ones((len(ids), 4, 100), dtype=np.float16), ids)
    result = CliRunner().invoke(cli, ["eval", str(straight), "--features", str(wide), "--protocol", "f30k-1k",
                                      "--allow-size-mismatch", "--quiet"])
    assert "D = 100, the model takes D = 16" in _error_line(result)


def test_a_run_records_where_and_how_it_started_and_eval_which_checkpoint(data, straight, tmp_path):
    config = json.loads((straight / CONFIG).read_text())
    env = config["environment"]
    assert env["torch"] == torch.__version__ and env["host"] and env["python"] and env["retr"]
    assert isinstance(env["command"], list)
    assert config["preset"] == "f30k"
    sims_path = tmp_path / "sims"                              # np.save adds .npy; the ids file follows it
    result = CliRunner().invoke(cli, ["eval", str(straight), "--protocol", "f30k-1k", "--allow-size-mismatch",
                                      "--save-sims", str(sims_path), "--json", "--checkpoint", "last", "--quiet"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["models"][0]["checkpoint"] == ckpt.list_checkpoints(straight)[-1][1].name
    sims = np.load(tmp_path / "sims.npy")
    ids = json.loads((tmp_path / "sims.npy.ids.json").read_text())
    assert sims.shape == (len(ids["image_ids"]), len(ids["caption_keys"]))
    assert ids["caption_keys"][0] == ids["image_ids"][0] + "#0"


def test_the_default_preset_is_named_when_the_run_starts(data, tmp_path):
    result = _train(data, tmp_path / "run", 1)
    lines = result.output.splitlines()
    note = next(i for i, line in enumerate(lines) if line.startswith("note: no --preset given"))
    assert "f30k" in lines[note] and lines[note + 1].startswith("training vsepp (preset f30k)")
    assert "no --preset" not in _train(data, tmp_path / "run2", 1, "--preset", "coco").output


def test_runs_read_their_data_from_anywhere_and_after_moving_with_it(data, tmp_path, monkeypatch):
    """A run trained with relative paths evaluates from another folder, and a project folder (runs and
    data) moved elsewhere still finds its data through the run-relative paths."""
    folder, manifest, features = data
    project = tmp_path / "project"
    shutil.copytree(folder, project / "data", ignore=shutil.ignore_patterns("*.partial"))
    monkeypatch.chdir(project)
    assert _train(("data", "data/manifest.jsonl", "data/scene-regions.h5"), "runs/a", 1).exit_code == 0
    config = json.loads((project / "runs/a" / CONFIG).read_text())
    assert Path(config["features"]).is_absolute()
    assert config["paths_from_run"]["features"] == "../../data/scene-regions.h5"
    monkeypatch.chdir(tmp_path)                                           # elsewhere
    evaluate = ["eval", "--protocol", "f30k-1k", "--allow-size-mismatch", "--quiet", "--json"]
    result = CliRunner().invoke(cli, [evaluate[0], str(project / "runs/a"), *evaluate[1:]])
    assert result.exit_code == 0, result.output
    shutil.move(project, tmp_path / "moved")                              # runs and data move together
    moved = CliRunner().invoke(cli, [evaluate[0], str(tmp_path / "moved/runs/a"), *evaluate[1:]])
    assert moved.exit_code == 0, moved.output
    assert json.loads(moved.output)["rsum"] == json.loads(result.output)["rsum"]
    resumed = CliRunner().invoke(cli, ["vsepp", "--out", str(tmp_path / "moved/runs/a"), "--resume", "--epochs", "2",
                                       "--quiet"])
    assert resumed.exit_code == 0, resumed.output
    assert json.loads((tmp_path / "moved/runs/a" / CONFIG).read_text())["features"].startswith(
        str(tmp_path / "moved"))


# ------------------------------------------------------------------------------------------------------------------
# Resume continues exactly: the losses of 1 epoch + resume equal those of an uninterrupted 2-epoch run.

SCAN_ARGS = ["--embed-size", "16", "--word-dim", "8", "--batch-size", "16", "--quiet", "--log-every", "1",
        "--val-images", "10"]


def _train_scan(features, manifest, out, epochs, *extra):
    return CliRunner().invoke(cli, ["scan", "--features", features, "--manifest", manifest, "--out", str(out),
                                    "--epochs", str(epochs), *SCAN_ARGS, *extra], catch_exceptions=False)


def _scan_losses(run):
    """The step and epoch lines (not the events: a run stopped at 1 epoch has ended, and may say so)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "event" not in line]


@pytest.mark.slow
def test_resume_gives_the_same_losses(data, tmp_path):
    _, manifest, features = data
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert _train_scan(features, manifest, straight, 2).exit_code == 0
    assert _train_scan(features, manifest, split, 1).exit_code == 0
    with pytest.raises(UserError, match="--resume"):
        _train_scan(features, manifest, split, 2)
    assert _train_scan(features, manifest, split, 2, "--resume").exit_code == 0
    a, b = _scan_losses(straight), _scan_losses(split)
    assert [line.get("loss") for line in a] == [line.get("loss") for line in b]
    assert [line.get("val") for line in a] == [line.get("val") for line in b]
    assert sum("loss" in line for line in a) > 4


@pytest.mark.slow
@pytest.mark.parametrize("left", [[], ["run.lock"], None])
def test_resume_of_a_run_killed_before_its_settings_starts_it(tmp_path, left, synthetic_data):
    """Requeue scripts always pass --resume: a run killed before config.json (nothing there, only run.lock, or
    no folder at all) starts with a note and trains as a fresh run does."""
    manifest, features = synthetic_data(images=40)
    out = tmp_path / "run"
    if left is not None:
        out.mkdir()
        for name in left:
            (out / name).write_text("")
    result = CliRunner().invoke(cli, ["scan", "--features", str(features), "--manifest", str(manifest), "--out",
                                      str(out), "--epochs", "1", *SCAN_ARGS, "--resume"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "nothing to resume" in result.stderr and "starting the run" in result.stderr
    assert (out / "best.pt").is_file() and json.loads((out / "config.json").read_text())["epochs"] == 1
