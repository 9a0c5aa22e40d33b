"""Importers: SCAN precomp, bottom-up TSV (6 and 10 fields), MILVLG npz — arrays reproduced exactly."""
from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from retr.common.errors import UserError
from retr.manifests.schema import read_manifest
from retr.pipeline.importers import import_npz, import_scan, import_tsv
from retr.store.features import FeatureSet
from retr.pipeline.verify import verify_feature_set

BIN = Path(sys.executable).parent


def run_cli(*args: str):
    """Run a retr-pipeline command in this process (fast); returns click's result."""
    from click.testing import CliRunner

    from retr.pipeline.commands import cli
    return CliRunner().invoke(cli, list(args))


def run_console_script(*args: str) -> subprocess.CompletedProcess:
    """Run the installed console script (to see exactly what a user sees on stderr)."""
    return subprocess.run([str(BIN / "retr-pipeline"), *args], capture_output=True, text=True)


def write_scan(folder: Path, split: str, n: int, rng, ids: list[str] | None = None, k: int = 36) -> np.ndarray:
    features = rng.standard_normal((n, k, 2048)).astype(np.float32)
    np.save(folder / f"{split}_ims.npy", features)
    (folder / f"{split}_caps.txt").write_text("".join(f"caption {c} of {split} image {i}\n"
                                                      for i in range(n) for c in range(5)))
    if ids is not None:
        (folder / f"{split}_ids.txt").write_text("\n".join(ids) + "\n")
    return features


def test_import_scan_reproduces_arrays_and_captions(tmp_path):
    rng = np.random.default_rng(0)
    data = tmp_path / "f30k_precomp"
    data.mkdir()
    train = write_scan(data, "train", 3, rng, ids=["1000092795", "10002456", "1000268201"])
    dev = write_scan(data, "dev", 2, rng)
    test = write_scan(data, "test", 2, rng)
    result = run_cli("import-scan", "--data-dir", str(data), "--out", str(tmp_path / "out"), "--dtype", "float32",
                     "--id-prefix", "f30k_")
    assert result.exit_code == 0, result.output
    records = read_manifest(tmp_path / "out" / "manifest.jsonl")
    assert [(r.id, r.split) for r in records] == [
        ("f30k_1000092795", "train"), ("f30k_10002456", "train"), ("f30k_1000268201", "train"),
        ("f30k_dev_0", "val"), ("f30k_dev_1", "val"), ("f30k_test_0", "test"), ("f30k_test_1", "test")]
    assert records[3].captions == tuple(f"caption {c} of dev image 0" for c in range(5))
    fs = FeatureSet(tmp_path / "out" / "regions.h5")
    assert np.array_equal(fs.read_ids(["f30k_10002456"])[0], train[1])
    assert np.array_equal(fs.read_all(), np.concatenate([train, dev, test]))
    assert (fs.read_all("num_boxes") == 36).all()
    assert verify_feature_set(tmp_path / "out" / "regions.h5") == []
    assert fs.attrs["manifest_sha256"] != "" and "boxes" in fs.attrs["placeholder_datasets"]


def test_import_scan_coco_testall_and_repeated_rows(tmp_path):
    rng = np.random.default_rng(1)
    data = tmp_path / "coco_precomp"
    data.mkdir()
    write_scan(data, "test", 1, rng)
    testall = write_scan(data, "testall", 2, rng)
    # a VSE-style file repeating each image once per caption
    repeated = np.repeat(testall, 5, axis=0)
    np.save(data / "testall_ims.npy", repeated)
    summary = import_scan(data, tmp_path / "out", dtype="float16")
    assert summary.splits == {"test": 2}
    fs = FeatureSet(summary.features)
    assert list(fs.ids) == ["testall_0", "testall_1"]
    assert np.array_equal(fs.read_all(), testall.astype(np.float16))
    with pytest.raises(UserError, match="overlap"):
        import_scan(data, tmp_path / "out2", splits=["test", "testall"])


def test_import_scan_accepts_one_id_per_caption(tmp_path):
    """The released COCO ``{split}_ids.txt`` has one line per caption (25,000 for 5,000 images)."""
    rng = np.random.default_rng(3)
    data = tmp_path / "coco_precomp"
    data.mkdir()
    write_scan(data, "test", 3, rng, ids=[i for i in ("391895", "522418", "184613") for _ in range(5)])
    summary = import_scan(data, tmp_path / "out", dtype="float32")
    assert list(FeatureSet(summary.features).ids) == ["391895", "522418", "184613"]
    write_scan(data, "test", 3, rng, ids=["1"] * 4 + ["2"] * 5 + ["3"] * 6)
    with pytest.raises(UserError, match="lines 1-5 name different images"):
        import_scan(data, tmp_path / "out2")


def test_import_scan_rejects_inconsistent_files(tmp_path):
    rng = np.random.default_rng(2)
    write_scan(tmp_path, "train", 3, rng)
    (tmp_path / "train_caps.txt").write_text("a\nb\nc\nd\ne\nf\ng\nh\ni\nj\n")   # 2 images for 3 rows
    result = run_console_script("import-scan", "--data-dir", str(tmp_path), "--out", str(tmp_path / "out"))
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "describes 2 images" in result.stderr
    assert not (tmp_path / "out" / "regions.h5").exists()


def b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")


def test_import_tsv_original_six_fields(tmp_path):
    rng = np.random.default_rng(3)
    rows = []
    for image_id, n, (w, h) in (("391895", 36, (640, 480)), ("522418", 10, (500, 375))):
        boxes = rng.uniform(0, 300, (n, 4)).astype(np.float32)
        features = rng.random((n, 2048)).astype(np.float32)
        rows.append((image_id, n, (h, w), boxes, features))
    tsv = tmp_path / "genome_36.tsv"
    tsv.write_text("".join(f"{i}\t{w}\t{h}\t{n}\t{b64(bx)}\t{b64(ft)}\n" for i, n, (h, w), bx, ft in rows))
    summary = import_tsv(tsv, tmp_path / "out", dtype="float32", id_prefix="coco_")
    fs = FeatureSet(summary.features)
    assert list(fs.ids) == ["coco_391895", "coco_522418"] and summary.max_boxes == 36
    for row, (_, n, hw, boxes, features) in enumerate(rows):
        assert np.array_equal(fs.read_rows([row])[0, :n], features)
        assert not fs.read_rows([row])[0, n:].any()
        assert np.array_equal(fs.read_rows([row], "boxes")[0, :n], boxes)
        assert fs.read_rows([row], "num_boxes")[0] == n
        assert tuple(fs.read_rows([row], "image_hw")[0]) == hw
    assert verify_feature_set(summary.features) == []


def test_import_tsv_lxmert_ten_fields_with_labels(tmp_path):
    rng = np.random.default_rng(4)
    n = 5
    boxes = rng.uniform(0, 300, (n, 4)).astype(np.float32)
    features = rng.random((n, 2048)).astype(np.float32)
    obj_ids, attr_ids = rng.integers(0, 1600, n).astype(np.int64), rng.integers(0, 400, n).astype(np.int64)
    obj_conf, attr_conf = rng.random(n).astype(np.float32), rng.random(n).astype(np.float32)
    tsv = tmp_path / "lxmert.tsv"
    tsv.write_text(f"COCO_val2014_000000391895\t480\t640\t{b64(obj_ids)}\t{b64(obj_conf)}\t{b64(attr_ids)}\t"
                   f"{b64(attr_conf)}\t{n}\t{b64(boxes)}\t{b64(features)}\n")
    result = run_cli("import-tsv", str(tsv), "--out", str(tmp_path / "out"), "--dtype", "float32", "--quiet")
    assert result.exit_code == 0, result.output
    fs = FeatureSet(tmp_path / "out" / "regions.h5")
    assert np.array_equal(fs.read_all()[0], features)
    assert np.array_equal(fs.read_all("object_ids")[0], obj_ids)
    assert np.array_equal(fs.read_all("attr_ids")[0], attr_ids)
    assert np.array_equal(fs.read_all("object_conf")[0], obj_conf)
    assert np.array_equal(fs.read_all("attr_conf")[0], attr_conf)
    assert tuple(fs.read_all("image_hw")[0]) == (480, 640)


def test_import_tsv_bad_line_is_one_error_and_leaves_nothing(tmp_path):
    tsv = tmp_path / "bad.tsv"
    tsv.write_text(f"1\t10\t10\t2\t{b64(np.zeros((2, 4), np.float32))}\tnot-base64!\n")
    with pytest.raises(UserError, match="line 1: features is not valid base64"):
        import_tsv(tsv, tmp_path / "out")
    assert not any((tmp_path / "out").iterdir())


def test_import_npz_milvlg(tmp_path):
    rng = np.random.default_rng(5)
    folder = tmp_path / "npz"
    folder.mkdir()
    expected = {}
    for image_id, n in (("391895", 12), ("522418", 20)):
        arrays = dict(x=rng.random((n, 2048)).astype(np.float32), bbox=rng.uniform(0, 400, (n, 4)).astype(np.float32),
                      num_bbox=n, image_h=480, image_w=640,
                      info={"objects_id": rng.integers(0, 1600, n), "objects_conf": rng.random(n).astype(np.float32),
                            "attrs_id": rng.integers(0, 400, n), "attrs_conf": rng.random(n).astype(np.float32)})
        np.savez_compressed(folder / f"{image_id}.npz", **arrays)
        expected[image_id] = arrays
    result = run_cli("import-npz", str(folder), "--out", str(tmp_path / "out"), "--dtype", "float32")
    assert result.exit_code == 0, result.output
    fs = FeatureSet(tmp_path / "out" / "regions.h5")
    assert list(fs.ids) == ["391895", "522418"] and fs.feature_shape == (20, 2048)
    for row, (image_id, arrays) in enumerate(expected.items()):
        n = arrays["num_bbox"]
        assert np.array_equal(fs.read_rows([row])[0, :n], arrays["x"])
        assert np.array_equal(fs.read_rows([row], "boxes")[0, :n], arrays["bbox"])
        assert np.array_equal(fs.read_rows([row], "object_ids")[0, :n], arrays["info"]["objects_id"])
        assert np.array_equal(fs.read_rows([row], "attr_conf")[0, :n], arrays["info"]["attrs_conf"])
        assert (fs.read_rows([row], "object_ids")[0, n:] == -1).all()


def test_import_npz_refuses_pickled_objects(tmp_path):
    folder = tmp_path / "npz"
    folder.mkdir()
    np.savez(folder / "1.npz", x=np.zeros((2, 2048), np.float32), bbox=np.zeros((2, 4), np.float32), num_bbox=2,
             image_h=4, image_w=4, info={"objects_id": UserError("not an array")})
    with pytest.raises(UserError, match="beyond arrays"):
        import_npz(folder, tmp_path / "out")


def test_import_scan_takes_its_folder_as_an_argument_like_the_other_importers(tmp_path):
    import click
    from click.testing import CliRunner

    from retr.pipeline.commands import cli as pipeline_cli

    data = tmp_path / "precomp"
    data.mkdir()
    write_scan(data, "train", 2, np.random.default_rng(0))
    result = run_cli("import-scan", str(data), "--out", str(tmp_path / "out"), "--quiet")
    assert result.exit_code == 0, result.output
    assert len(read_manifest(tmp_path / "out" / "manifest.jsonl")) == 2

    command = pipeline_cli.commands["import-scan"]
    assert [p.name for p in command.params if isinstance(p, click.Argument)] == ["data_dir_arg"]
    both = CliRunner().invoke(pipeline_cli, ["import-scan", str(tmp_path), "--data-dir", str(tmp_path),
                                             "--out", str(tmp_path / "o")])
    assert both.exit_code == 2 and "give SCAN's data folder once" in both.output
