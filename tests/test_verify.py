"""``retr-pipeline verify`` and ``inspect`` (pipeline/verify.py): problems are found and reported, sound sets pass;
every row is read (streamed), the index's ids are compared with its shards', the per-row checksums the writer
stored are recomputed; ``--sample N`` and ``--no-checksum`` are the quick modes.
"""
from __future__ import annotations

from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from retr.pipeline.verify import summarize_feature_set, verify_feature_set, verify_report
from retr.store.features import CHECKSUMS, ShardWriter, row_checksums, shard_name, write_index
from tests.conftest import CliRunnerHelper, grid_attrs


def cli(*args):
    """``retr-pipeline ARGS`` in this process, through the console script's error handling (retr.common.cli.run)."""
    code, stdout, stderr = CliRunnerHelper().as_user("pipeline", *args)
    return SimpleNamespace(returncode=code, stdout=stdout, stderr=stderr)


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


# ------------------------------------------------------------------------------------------------------------------
# ``verify`` reads every row (streamed), compares the index's ids with its shards', and recomputes the per-row
# checksums the writer stored; ``--sample N`` and ``--no-checksum`` are the quick modes.

#: tencrop rows are small (10 × 2048) and a valid kind for verify
SHAPE = (10, 2048)


def tencrop_attrs():
    return grid_attrs(kind="tencrop", extractor="tencrop-resnet152")


def write_set(folder, rows_per_shard=(40, 40, 40), seed=0):
    """An index over ``len(rows_per_shard)`` tencrop shards; returns (index path, shard paths, ids)."""
    rng = np.random.default_rng(seed)
    paths, ids, start = [], [], 0
    count = len(rows_per_shard)
    for s, rows in enumerate(rows_per_shard):
        path = folder / "tencrop-resnet152" / shard_name(s, count)
        shard_ids = [f"img_{start + i}" for i in range(rows)]
        with ShardWriter(path, tencrop_attrs(), SHAPE, shard_index=s, num_shards=count) as writer:
            writer.append(shard_ids, rng.standard_normal((rows, *SHAPE)).astype(np.float32))
            writer.add_error(f"broken_{s}", "cannot identify image file")
        paths.append(path)
        ids += shard_ids
        start += rows
    return write_index(folder / "tencrop-resnet152.h5", paths), paths, ids


def old_sample_rows(n: int, sample: int = 64, seed: int = 0) -> set[int]:
    """The rows the old verify read: ``sample`` random rows of ``n`` plus the first and last."""
    rng = np.random.default_rng(seed)
    return set(np.unique(np.concatenate([[0, n - 1], rng.choice(n, size=min(sample, n), replace=False)])).tolist())


def test_a_nan_row_outside_the_old_sample_is_found(tmp_path):
    index, paths, ids = write_set(tmp_path, rows_per_shard=(100, 100))
    n = len(ids)
    row = max(set(range(n)) - old_sample_rows(n))  # a row the 64-row sample never read (in shard 1)
    with h5py.File(paths[1], "r+") as f:
        f["features"][row - 100, 4, 9] = np.nan
    problems = verify_feature_set(index, checksum=False)
    assert problems == [f"1 of 100 checked rows of 'features' in tencrop-resnet152/shard-00001-of-00002.h5 are not finite (NaN or inf), "
                        f"e.g. row {row} (id 'img_{row}', row {row - 100} of tencrop-resnet152/shard-00001-of-00002.h5)"]
    assert verify_feature_set(index, sample=64, checksum=False) == []  # the quick mode can miss it, as before


def test_rows_are_streamed_in_blocks_and_named_across_block_boundaries(tmp_path):
    index, paths, ids = write_set(tmp_path, rows_per_shard=(13,))
    with h5py.File(paths[0], "r+") as f:
        f["features"][12, 0, 0] = np.inf   # the last row, alone in the last block of 5 rows
        f["features"][5, 1, 1] = np.nan    # the first row of the second block
    row_bytes = 10 * 2048 * 2
    problems = verify_feature_set(index, checksum=False, chunk_bytes=5 * row_bytes)
    assert problems == ["2 of 13 checked rows of 'features' in tencrop-resnet152/shard-00000-of-00001.h5 are not finite (NaN or inf), "
                        "e.g. row 5 (id 'img_5', row 5 of tencrop-resnet152/shard-00000-of-00001.h5)"]
    assert verify_feature_set(index, checksum=False, chunk_bytes=1) == problems  # one row per block


def test_a_sound_set_reads_and_checksums_every_row(tmp_path):
    index, _paths, _ids = write_set(tmp_path)
    report = verify_report(index)
    assert report.problems == [] and report.notes == []
    assert (report.rows, report.rows_read, report.rows_checksummed) == (120, 120, 120)
    quick = verify_report(index, sample=10, checksum=False)
    assert quick.ok and quick.rows_read == 12 and quick.rows_checksummed == 0


def test_writer_checksums_cover_id_features_and_extras(tmp_path):
    path = tmp_path / "r" / shard_name(0, 1)
    features = np.arange(2 * 3 * 2048, dtype=np.float32).reshape(2, 3, 2048) / 1000
    boxes = np.ones((2, 3, 4), np.float32)
    attrs = grid_attrs(kind="regions", extractor="butd-regions")
    with ShardWriter(path, attrs, (3, 2048), extras={"boxes": ((3, 4), "float32"), "num_boxes": ((), "int32")}) as w:
        w.append(["a", "b"], features, boxes=boxes, num_boxes=np.array([3, 2]))
    with h5py.File(path, "r") as f:
        stored = f[CHECKSUMS][:]
        assert "crc32" in f[CHECKSUMS].attrs["algorithm"]
    # features as written (float16), then the extras in name order: boxes, num_boxes
    expected = row_checksums(["a", "b"], [features.astype(np.float16), boxes, np.array([3, 2], np.int32)])
    assert np.array_equal(stored, expected)
    assert not np.array_equal(expected, row_checksums(["b", "a"], [features.astype(np.float16), boxes,
                                                                   np.array([3, 2], np.int32)]))


def test_a_swapped_id_inside_a_shard_is_found(tmp_path):
    index, paths, _ids = write_set(tmp_path)
    with h5py.File(paths[1], "r+") as f:
        first, second = f["ids"][3], f["ids"][4]
        f["ids"][3], f["ids"][4] = second, first
    problems = verify_feature_set(index, checksum=False)
    assert problems == ["2 ids of shard tencrop-resnet152/shard-00001-of-00003.h5 differ from the index's copy, e.g. index row 43 is "
                        "'img_43', row 3 of the shard is 'img_44' (re-write the index with `retr-pipeline index`, "
                        "or find out which file was changed)"]
    # the shard on its own: its ids are still unique, but the checksums bind each id to its row
    alone = verify_feature_set(paths[1])
    assert alone == ["2 of 40 checked rows in shard-00001-of-00003.h5 do not match the checksum stored when they "
                     "were written (changed since, or their id was), e.g. row 3 (id 'img_44')"]


def test_a_duplicated_id_inside_a_shard_is_found(tmp_path):
    index, paths, _ids = write_set(tmp_path)
    with h5py.File(paths[2], "r+") as f:
        f["ids"][7] = f["ids"][6]
    problems = verify_feature_set(index, checksum=False)
    assert len(problems) == 1 and "1 ids of shard tencrop-resnet152/shard-00002-of-00003.h5 differ" in problems[0]
    assert "index row 87 is 'img_87', row 7 of the shard is 'img_86'" in problems[0]


def test_a_zeroed_row_fails_its_checksum(tmp_path, run_cli):
    index, paths, _ids = write_set(tmp_path)
    with h5py.File(paths[0], "r+") as f:
        f["features"][17] = 0
    assert verify_feature_set(index) == [
        "1 of 40 checked rows in tencrop-resnet152/shard-00000-of-00003.h5 do not match the checksum stored when they were written "
        "(changed since, or their id was), e.g. row 17 (id 'img_17', row 17 of tencrop-resnet152/shard-00000-of-00003.h5)"]
    code, out, err = run_cli.as_user("pipeline", "verify", index)
    assert code == 1 and "row 17 (id 'img_17'" in out
    assert err == "error: 1 of 1 feature set(s) failed verification\n"
    code, out, err = run_cli.as_user("pipeline", "verify", "--no-checksum", index)
    assert code == 0 and err == ""
    assert out == f"{index}: ok (all 120 rows read, checksums not compared (--no-checksum))\n"


def test_shards_without_checksums_still_verify_with_a_note(tmp_path, run_cli):
    """Shards written before checksums existed: the same layout without the ``checksums`` dataset."""
    index, paths, _ids = write_set(tmp_path)
    for path in paths[:2]:
        with h5py.File(path, "r+") as f:
            del f[CHECKSUMS]
    write_index(index, paths)  # an index over old and new shards together
    report = verify_report(index)
    assert report.problems == []
    assert report.notes == ["no checksums in 2 of 3 shards (e.g. tencrop-resnet152/shard-00000-of-00003.h5; written before retr stored "
                            "them): their rows were checked for finite values only"]
    assert report.rows_read == 120 and report.rows_checksummed == 40
    code, out, err = run_cli.as_user("pipeline", "verify", paths[0])
    assert code == 0 and err == ""
    assert out.splitlines() == [f"{paths[0]}: ok (all 40 rows read, 0 matched their checksums)",
                                "  note: no checksums in shard-00000-of-00003.h5 (written before retr stored them): "
                                "rows were checked for finite values only"]


def test_sample_mode_reads_only_the_sample(tmp_path, run_cli):
    index, paths, ids = write_set(tmp_path)
    code, out, _err = run_cli.as_user("pipeline", "verify", "--sample", "5", index)
    assert code == 0 and out == f"{index}: ok (7 of 120 rows read, 7 matched their checksums)\n"
    sampled = sorted(old_sample_rows(120, sample=5))
    row = sampled[3]   # a sampled row: found by the quick mode too, in whichever shard it is
    shard, within = divmod(row, 40)
    with h5py.File(paths[shard], "r+") as f:
        f["features"][within] = 0
    problems = verify_feature_set(index, sample=5)
    assert len(problems) == 1 and f"row {row} (id 'img_{row}', row {within} of tencrop-resnet152/{paths[shard].name})" in problems[0]


@pytest.mark.parametrize("kind", ["grid", "regions"])
def test_one_dimensional_features_are_a_problem_not_a_crash(tmp_path, kind, run_cli):
    path = tmp_path / "flat.h5"
    with h5py.File(path, "w") as f:
        f["ids"] = np.array(["a", "b"], dtype=object).astype(h5py.string_dtype())
        f["features"] = np.zeros(2, np.float16)
        f.attrs.update(grid_attrs(kind=kind))
        f.attrs.update(format_version=1, dtype="float16", created="x", retr_version="x", complete=True)
    assert verify_feature_set(path) == ["features have shape (2,) and ids (2,); a feature set has features "
                                        "[N, K, D] and ids [N]"]
    code, out, err = run_cli.as_user("pipeline", "verify", path)
    assert code == 1 and "Traceback" not in err and err.startswith("error: ")
    code, out, err = run_cli.as_user("pipeline", "inspect", path)
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err == f"error: {path} is not a feature set (no 'features' dataset [N, K, D]); `retr-pipeline verify {path}` says more\n"


def test_inspect_on_a_garbage_file_is_one_line(tmp_path, run_cli):
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(b"\x00garbage" * 100)
    code, out, err = run_cli.as_user("pipeline", "inspect", garbage)
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: {garbage} is not a readable HDF5 file (")


def test_verify_json_is_one_object_per_feature_set(tmp_path, make_feature_set):
    import json

    from click.testing import CliRunner

    from retr.pipeline.commands import cli as pipeline_cli

    path, _ = make_feature_set(num_shards=2, rows_per_shard=2)
    result = CliRunner().invoke(pipeline_cli, ["verify", str(path), "--json"])
    assert result.exit_code == 0, result.output
    [report] = [json.loads(line) for line in result.output.splitlines()]
    assert report["ok"] is True and report["problems"] == [] and report["rows"] == report["rows_read"] > 0
