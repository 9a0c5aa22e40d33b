"""``retr-pipeline verify`` and ``inspect``: problems are found and reported, sound sets pass."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

from retr.store.features import ShardWriter, shard_name, write_index
from retr.pipeline.verify import summarize_feature_set, verify_feature_set
from tests.conftest import grid_attrs

BIN = Path(sys.executable).parent


def cli(*args):
    return subprocess.run([str(BIN / "retr-pipeline"), *map(str, args)], capture_output=True, text=True)


def test_sound_set_passes(make_feature_set):
    index, _ = make_feature_set()
    assert verify_feature_set(index) == []
    result = cli("verify", index)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(": ok (all 12 rows read, 12 matched their checksums)")


def test_missing_shard_is_reported(make_feature_set, tmp_path):
    index, _ = make_feature_set(num_shards=3)
    (tmp_path / "features" / "resnet152-grid" / shard_name(1, 3)).unlink()
    problems = verify_feature_set(index)
    assert problems == ["shard resnet152-grid/shard-00001-of-00003.h5 is missing"]
    result = cli("verify", index)
    assert result.returncode == 1
    assert "shard-00001-of-00003.h5 is missing" in result.stdout
    assert result.stderr.startswith("error: 1 of 1 feature set(s) failed verification")
    assert "Traceback" not in result.stderr


def test_duplicate_id_is_reported(tmp_path):
    with ShardWriter(tmp_path / "g" / shard_name(0, 1), grid_attrs(), (49, 2048)) as w:
        w.append(["a", "b", "c"], np.zeros((3, 49, 2048)))
    with h5py.File(tmp_path / "g" / shard_name(0, 1), "r+") as f:
        f["ids"][2] = "a"
    problems = verify_feature_set(tmp_path / "g" / shard_name(0, 1))
    assert problems == ["1 duplicate ids, e.g. 'a'"]


def test_nan_row_is_reported(tmp_path):
    path = tmp_path / "g" / shard_name(0, 1)
    with ShardWriter(path, grid_attrs(), (49, 2048)) as w:
        w.append(["a", "b", "c"], np.zeros((3, 49, 2048)))
    with h5py.File(path, "r+") as f:
        f["features"][1, 3, 7] = np.nan
    problems = verify_feature_set(path, checksum=False)
    assert len(problems) == 1 and "not finite" in problems[0] and "'b'" in problems[0]
    problems = verify_feature_set(path)  # the NaN was written after the checksum: both are reported
    assert "not finite" in problems[0] and "do not match the checksum" in problems[1] and "'b'" in problems[1]


def test_shape_kind_attrs_and_completeness(tmp_path):
    path = tmp_path / "m" / shard_name(0, 1)
    with ShardWriter(path, grid_attrs(kind="maps"), (49, 2048)) as w:  # maps must be D = 512
        w.append(["a"], np.zeros((1, 49, 2048)))
    assert any("expects D in (512,)" in p for p in verify_feature_set(path))
    with h5py.File(path, "r+") as f:
        del f.attrs["manifest_sha256"]
        f.attrs["complete"] = False
    problems = verify_feature_set(path)
    assert "missing root attributes: manifest_sha256" in problems
    assert "file is not marked complete (its writer did not finish)" in problems


def test_error_ids_must_not_be_rows(tmp_path):
    path = tmp_path / "g" / shard_name(0, 1)
    with ShardWriter(path, grid_attrs(), (49, 2048)) as w:
        w.append(["a"], np.zeros((1, 49, 2048)))
        w.add_error("a", "truncated")
    assert verify_feature_set(path) == ["1 ids are both rows and errors, e.g. 'a'"]


def test_not_hdf5(tmp_path):
    bogus = tmp_path / "x.h5"
    bogus.write_text("hello")
    assert "not a readable HDF5 file" in verify_feature_set(bogus)[0]
    assert verify_feature_set(tmp_path / "absent.h5") == [f"{tmp_path / 'absent.h5'} does not exist"]


def test_inspect_summary(make_feature_set):
    index, _ = make_feature_set(num_shards=2, rows_per_shard=5)
    lines = summarize_feature_set(index)
    text = "\n".join(lines)
    assert "kind       grid" in text and "rows       10  × K×D = 49×2048  float16" in text
    assert "in 2 shards" in text and "errors     2" in text and "broken_0: cannot identify image file" in text
    result = cli("inspect", index)
    assert result.returncode == 0 and "weights    random" in result.stdout


def test_index_command(make_feature_set, tmp_path):
    index, _ = make_feature_set(num_shards=2)
    index.unlink()
    result = cli("index", tmp_path / "features" / "resnet152-grid")
    assert result.returncode == 0, result.stderr
    assert index.exists() and verify_feature_set(index) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    result = cli("index", empty)
    assert result.returncode == 1 and result.stderr.startswith("error: no shard files")
