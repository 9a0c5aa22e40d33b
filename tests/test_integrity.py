"""``store/integrity.py``: a feature set's rows against the checksums stored when they were written, before training
and evaluation — a damaged shard refused in one line before the first step, naming the shard and ``retr-pipeline
verify``; every file read once per state (path, size, modification time, inode) and remembered; streamed in bounded
blocks; ``--no-verify`` skips it."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from retr.common.errors import UserError
from retr.store import integrity
from retr.store.integrity import RowNames, check_rows, file_state, row_files, verify_rows
from test_pipeline_wrong_inputs import assert_one_error_line

TINY = ["--embed-size", "16", "--word-dim", "8", "--batch-size", "16", "--epochs", "1", "--val-images", "10",
        "--device", "cpu", "--quiet"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """This test's own ``$RETR_CACHE`` (what is remembered starts empty)."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("RETR_CACHE", str(folder))
    return folder


@pytest.fixture
def trainings(monkeypatch):
    """The training loop's calls (it records and trains nothing)."""
    from retr.trainers.training import loop

    calls = []
    monkeypatch.setattr(loop, "train", lambda cfg, **kw: calls.append(cfg) or {})
    return calls


def damage(shard: Path, row: int) -> None:
    """Zero the bytes of ``row``'s features on disk, as a bad block would (HDF5 and the checksums untouched)."""
    with h5py.File(shard, "r") as f:
        chunk = f["features"].id.get_chunk_info(row)       # one row per chunk
    with open(shard, "r+b") as handle:
        handle.seek(chunk.byte_offset)
        handle.write(b"\0" * chunk.size)


@pytest.fixture
def data(synthetic_data, tmp_path):
    """A copy of the synthetic data (manifest, two-shard feature set) this test may damage."""
    return synthetic_data(images=40, copy_to=tmp_path / "data")


def test_a_damaged_row_stops_training_before_the_first_step(data, cache, trainings, run_cli, tmp_path):
    manifest, features = data
    shard = features.parent / "scene-regions" / "shard-00001-of-00002.h5"
    damage(shard, 3)
    out = tmp_path / "run"
    code, stdout, stderr = run_cli.as_user("train", "vsepp", "--features", features, "--manifest", manifest, "--out",
                                           out, *TINY)
    assert_one_error_line(code, stdout, stderr)
    assert stderr == (f"error: --features {features}: 1 of 20 checked rows in scene-regions/shard-00001-of-00002.h5 "
                      f"do not match the checksum stored when they were written (changed since, or their id was), "
                      f"e.g. row 23 (id 'synth_00023', row 3 of scene-regions/shard-00001-of-00002.h5); "
                      f"`retr-pipeline verify {features}` lists every problem of the set (--no-verify skips this "
                      f"check)\n")
    assert trainings == [] and not out.exists()
    from retr.pipeline import verify            # the rows `retr-pipeline verify` lists are found by the same code
    assert verify.check_rows is check_rows
    # --no-verify: for those who know
    run_cli("train", "vsepp", "--features", features, "--manifest", manifest, "--out", out, *TINY, "--no-verify")
    assert len(trainings) == 1


def test_evaluation_refuses_a_damaged_set_and_no_verify_evaluates(data, cache, synthetic_run, run_cli, tmp_path):
    manifest, features = data
    run = synthetic_run("vsepp", *TINY, copy_to=tmp_path / "run")
    damage(features.parent / "scene-regions" / "shard-00000-of-00002.h5", 0)
    evaluate = ["eval", run, "--features", features, "--manifest", manifest, "--protocol", "f30k-1k",
                "--allow-size-mismatch", "--device", "cpu", "--quiet"]
    code, stdout, stderr = run_cli.as_user("train", *evaluate)
    assert_one_error_line(code, stdout, stderr)
    assert "row 0 (id 'synth_00000', row 0 of scene-regions/shard-00000-of-00002.h5)" in stderr
    assert "retr-pipeline verify" in stderr and not (run / "eval.json").exists()
    assert "rsum:" in run_cli("train", *evaluate, "--no-verify").output


def test_a_set_is_read_once_per_state_of_its_files(data, cache):
    _, features = data
    shards = [file for file, _, _ in row_files(features)]
    assert verify_rows(features) == 40                      # both shards read
    assert verify_rows(features) == 0                       # both remembered
    assert len(list((cache / "verified").glob("*.json"))) == 2
    stat = shards[0].stat()
    os.utime(shards[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))   # written again: read again
    assert verify_rows(features) == 20 and verify_rows(features) == 0
    inode = file_state(shards[1])["inode"]
    moved = shards[1].with_name("moved.h5")
    shutil.copy2(shards[1], moved)                          # the same bytes, size and time in another file (inode)
    os.replace(moved, shards[1])
    assert file_state(shards[1])["inode"] != inode
    assert verify_rows(features) == 20


def test_where_nothing_can_be_remembered_the_set_is_still_verified(data, tmp_path, monkeypatch):
    _, features = data
    blocker = tmp_path / "a-file"
    blocker.write_text("no folder")
    monkeypatch.setenv("RETR_CACHE", str(blocker / "cache"))     # below a file: the cache cannot be made
    assert verify_rows(features) == 40 and verify_rows(features) == 40


def test_rows_are_read_in_bounded_blocks(data):
    _, features = data
    shard = row_files(features)[0][0]
    blocks = []
    with h5py.File(shard, "r") as f:
        per_row = integrity.row_bytes(f)
        found = check_rows(f, RowNames(features.name, 0, shard.name), chunk_bytes=3 * per_row,
                           advance=blocks.append)
    assert found.problems == [] and found.rows_read == 20 == found.rows_checksummed
    assert blocks == [3] * 6 + [2]                          # 20 rows, at most 3 rows' bytes at a time


def test_a_large_set_says_it_is_being_verified(data, cache, monkeypatch, caplog):
    _, features = data
    monkeypatch.setattr(integrity, "ANNOUNCE_BYTES", 0)
    with caplog.at_level(logging.INFO, logger="retr"):
        verify_rows(features, quiet=True)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == 1 and lines[0].startswith(f"verifying {features}: ") and "--no-verify skips it" in lines[0]


def test_a_file_that_is_no_feature_set_is_one_line(data, tmp_path):
    manifest, _ = data
    with pytest.raises(UserError, match="is not a readable HDF5 file"):
        verify_rows(manifest)


def test_shards_without_checksums_are_checked_for_finite_values(tmp_path, cache):
    """Sets written before checksums existed: a NaN row is still found."""
    from retr.store.features import CHECKSUMS, ShardWriter, shard_name, write_index
    from tests.conftest import grid_attrs

    path = tmp_path / "old" / shard_name(0, 1)
    with ShardWriter(path, grid_attrs(), (2, 3), dtype="float32") as writer:
        writer.append(["a", "b"], np.ones((2, 2, 3)))
    with h5py.File(path, "r+") as f:
        del f[CHECKSUMS]
        f["features"][1, 0, 0] = np.nan
    index = write_index(tmp_path / "old.h5", [path])
    with pytest.raises(UserError, match=r"1 of 2 checked rows of 'features' in old/shard-00000-of-00001.h5 are not "
                                        r"finite \(NaN or inf\), e.g. row 1 \(id 'b'"):
        verify_rows(index)
