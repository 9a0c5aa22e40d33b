"""``import-scan`` streams ``{split}_ims.npy`` in blocks (memory near one block, not the file's size), and every
importer refuses NaN/inf rows in one line that names the row and gives advice that works."""
from __future__ import annotations

import base64
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from retr.common.errors import UserError
from retr.pipeline.importers import NpyRows, import_scan, import_tsv
from retr.store.features import FeatureSet


def write_scan(folder, features: np.ndarray, rows_per_image: int = 1):
    """``train_ims.npy`` and five captions per image (``rows_per_image`` 5: the file repeats each image)."""
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "train_ims.npy", features)
    images = len(features) // rows_per_image
    (folder / "train_caps.txt").write_text("".join(f"caption {c} of image {i}\n" for i in range(images)
                                                   for c in range(5)))


def test_npy_rows_reads_blocks_like_numpy(tmp_path):
    rng = np.random.default_rng(0)
    data = rng.standard_normal((11, 3, 2048)).astype(np.float32)
    np.save(tmp_path / "c.npy", data)
    rows = NpyRows(tmp_path / "c.npy", np.load(tmp_path / "c.npy", mmap_mode="r"))
    assert rows.shape == (11, 3, 2048)
    assert np.array_equal(rows.read(2, 7), data[2:7])
    assert np.array_equal(rows.read(0, 11, 5), data[0:11:5])   # one row per image of a 5-per-caption file
    assert np.array_equal(rows.read(9, 20), data[9:])
    np.save(tmp_path / "big_endian.npy", data.astype(">f8"))
    rows = NpyRows(tmp_path / "big_endian.npy", np.load(tmp_path / "big_endian.npy", mmap_mode="r"))
    assert rows.read(1, 4).dtype == np.float32 and np.array_equal(rows.read(1, 4), data[1:4])
    np.save(tmp_path / "fortran.npy", np.asfortranarray(data))
    rows = NpyRows(tmp_path / "fortran.npy", np.load(tmp_path / "fortran.npy", mmap_mode="r"))
    assert np.array_equal(rows.read(3, 9, 2), data[3:9:2])


def test_a_file_cut_short_is_one_error(tmp_path):
    np.save(tmp_path / "train_ims.npy", np.zeros((4, 2, 2048), np.float32))
    (tmp_path / "train_caps.txt").write_text("".join(f"c{i}\n" for i in range(20)))
    raw = (tmp_path / "train_ims.npy").read_bytes()
    (tmp_path / "train_ims.npy").write_bytes(raw[:-100])
    with pytest.raises(UserError, match="train_ims.npy is not a plain .npy array"):
        import_scan(tmp_path, tmp_path / "out")


def test_import_scan_reproduces_every_block(tmp_path):
    """More images than one block, and a file with one row per caption (read every fifth row)."""
    rng = np.random.default_rng(1)
    data = rng.standard_normal((150, 4, 2048)).astype(np.float32)
    write_scan(tmp_path / "a", data)
    summary = import_scan(tmp_path / "a", tmp_path / "out_a", dtype="float32")
    assert summary.rows == 150
    assert np.array_equal(FeatureSet(summary.features).read_all(), data)
    repeated = np.repeat(data[:70], 5, axis=0)   # [350, 4, 2048]: each image once per caption
    write_scan(tmp_path / "b", repeated, rows_per_image=5)
    summary = import_scan(tmp_path / "b", tmp_path / "out_b", dtype="float32")
    assert summary.rows == 70 and np.array_equal(FeatureSet(summary.features).read_all(), data[:70])


#: Peak RSS is read from /proc/self/status (VmHWM): ``ru_maxrss`` of a child started by exec starts at its
#: parent's resident size (Linux keeps it across exec), which would hide the import's growth under pytest's.
PEAK_SCRIPT = textwrap.dedent("""
    import json, re, sys
    from retr.pipeline.importers import import_scan
    def peak_kb():
        return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
    before = peak_kb()
    import_scan(sys.argv[1], sys.argv[2], dtype="float16")
    print(json.dumps({"growth_mb": (peak_kb() - before) / 1024}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak RSS from /proc/self/status")
def test_import_scan_memory_stays_near_one_block(tmp_path):
    """A 150 MB ``train_ims.npy``: the importer's peak resident memory grows by far less than the file.

    Before streaming, the pages of the memory map stayed resident: the peak grew by the file's size.
    """
    images = 500
    (tmp_path / "scan").mkdir()
    data = np.lib.format.open_memmap(tmp_path / "scan" / "train_ims.npy", mode="w+", dtype=np.float32,
                                     shape=(images, 36, 2048))
    rng = np.random.default_rng(2)
    for start in range(0, images, 100):
        data[start:start + 100] = rng.standard_normal((100, 36, 2048), dtype=np.float32)
    data.flush()
    del data
    (tmp_path / "scan" / "train_caps.txt").write_text("".join(f"c {i}\n" for i in range(images * 5)))
    size_mb = (tmp_path / "scan" / "train_ims.npy").stat().st_size / 2**20
    result = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path / "scan"), str(tmp_path / "out")],
                            capture_output=True, text=True, check=True)
    growth = json.loads(result.stdout)["growth_mb"]
    assert size_mb > 140
    # blocks of 64 images (19 MB as float32) and their float16 copies: about 60-80 MB whatever the file's size;
    # through the memory map the growth was the file's size plus those blocks (~200 MB here)
    assert growth < 110, f"peak RSS grew {growth:.0f} MB importing a {size_mb:.0f} MB file"


def b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")


def nan_tsv(path, bad_row: int = 1):
    lines = []
    for i in range(3):
        features = np.ones((2, 2048), np.float32)
        if i == bad_row:
            features[1, 5] = np.nan
        lines.append(f"{100 + i}\t10\t10\t2\t{b64(np.zeros((2, 4), np.float32))}\t{b64(features)}\n")
    path.write_text("".join(lines))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_import_tsv_refuses_nan_rows_in_any_dtype(tmp_path, run_cli, dtype):
    nan_tsv(tmp_path / "x.tsv")
    code, out, err = run_cli.as_user("pipeline", "import-tsv", tmp_path / "x.tsv", "--out", tmp_path / "out",
                                     "--dtype", dtype, "--id-prefix", "coco_")
    assert code == 1 and out == ""
    assert err == (f"error: {tmp_path / 'x.tsv'} line 2: features of id 'coco_101' hold NaN or infinite values; "
                   "retr stores no NaN or infinite values in any dtype (--dtype float32 would not help): that row of "
                   "the input is damaged; re-export it, or leave the image out of the input\n")
    assert not (tmp_path / "out" / "regions.h5").exists()
    assert list((tmp_path / "out").iterdir()) == []   # no partial file left either


def test_import_scan_refuses_an_infinite_row_naming_it(tmp_path):
    data = np.ones((3, 2, 2048), np.float32)
    data[2, 0, 7] = np.inf
    write_scan(tmp_path / "scan", data)
    with pytest.raises(UserError, match=r"train_ims.npy row 2: features of id 'train_2' hold NaN or infinite "
                                        r"values; retr stores no NaN"):
        import_scan(tmp_path / "scan", tmp_path / "out", dtype="float32")
    assert not (tmp_path / "out" / "regions.h5").exists()


def test_the_shard_writer_refuses_non_finite_values_in_every_dtype(tmp_path):
    from retr.store.features import NonFiniteError, ShardWriter, shard_name
    from tests.conftest import grid_attrs

    for dtype in ("float16", "float32"):
        path = tmp_path / dtype / shard_name(0, 1)
        with ShardWriter(path, grid_attrs(), (49, 2048), dtype=dtype) as writer:
            features = np.zeros((3, 49, 2048), np.float32)
            features[2, 0, 0] = -np.inf
            features[1, 0, 0] = np.nan
            with pytest.raises(NonFiniteError, match=r"features of id 'b' \(2 rows of this batch\) hold NaN or "
                                                     r"infinite values, which shard-00000-of-00001.h5 does not "
                                                     r"store in any dtype"):
                writer.append(["a", "b", "c"], features)
            writer.append(["a", "b", "c"], np.zeros((3, 49, 2048)))  # nothing of the refused batch was kept
        assert FeatureSet(path).ids.tolist() == ["a", "b", "c"]
    with ShardWriter(tmp_path / "e" / shard_name(0, 1), grid_attrs(), (49, 2048),
                     extras={"boxes": ((4,), "float32")}) as writer:
        with pytest.raises(NonFiniteError, match="boxes of id 'a'"):
            writer.append(["a"], np.zeros((1, 49, 2048)), boxes=np.array([[0, 0, np.nan, 1]]))
        writer.append(["a"], np.zeros((1, 49, 2048)), boxes=np.zeros((1, 4)))
