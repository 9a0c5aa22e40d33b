"""Reading a feature set's rows at their byte offsets (store/row_reader.py): the same bytes as h5py for every
layout the fast path takes, h5py for every layout it must not take, counted reads, and worker processes."""
from __future__ import annotations

import os
import pickle

import h5py
import numpy as np
import pytest

from retr.common.errors import UserError
from retr.store.features import REGION_DATASETS, FeatureSet, ShardWriter, shard_name, write_index
from tests.conftest import grid_attrs

SHAPE = (6, 8)            # a row: K × D, small so the tests stay small


def random_rows(count: int, seed: int = 0) -> np.ndarray:
    """Row numbers to read: any order, repeats, neighbours (a shuffled batch has all three)."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, count, size=3 * count)
    return np.concatenate([rows, [0, 1, 2, count - 1, count - 1, 5, 4, 3]])


def assert_same_bytes_as_h5py(path, names=None) -> FeatureSet:
    """Every per-row dataset read through :meth:`FeatureSet.read_rows` (random rows, all rows) is the bytes h5py's
    own reading gives, in the same dtype."""
    fs = FeatureSet(path)
    rows = random_rows(len(fs))
    with h5py.File(path, "r") as f:
        for name in names or fs.datasets:
            everything = f[name][...]
            got = fs.read_rows(rows, name)
            assert got.dtype == everything.dtype and got.shape == (len(rows), *everything.shape[1:])
            assert got.tobytes() == everything[rows].tobytes(), name
            assert fs.read_all(name).tobytes() == everything.tobytes(), name
            out = np.empty_like(everything[:7])
            assert fs.read_rows(rows[:7], name, out=out) is out and out.tobytes() == everything[rows[:7]].tobytes()
    return fs


def write_set(path, rows: int = 23, dtype="float16", seed: int = 0, **dataset_options) -> np.ndarray:
    """A one-file feature set written with h5py itself, ``features`` created with ``dataset_options`` (chunks,
    compression, …); returns the features."""
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((rows, *SHAPE)).astype(dtype)
    with h5py.File(path, "w") as f:
        f.attrs.update({**grid_attrs(), "complete": True, "format_version": 1, "dtype": str(np.dtype(dtype))})
        f.create_dataset("ids", data=np.array([f"img_{i}" for i in range(rows)], dtype=object),
                         dtype=h5py.string_dtype("utf-8"))
        f.create_dataset("features", data=features, **dataset_options)
    return features


def regions_shards(folder, shards: int = 3, rows: int = 7, seed: int = 0, **writer_options) -> list:
    """``shards`` region shards written by :class:`ShardWriter` (every per-row dataset a regions set has),
    appended in uneven batches."""
    rng = np.random.default_rng(seed)
    extras = {name: ((SHAPE[0], *shape), dtype) for name, (shape, dtype) in REGION_DATASETS.items()}
    extras.update({"num_boxes": ((), "int32"), "image_hw": ((2,), "int32")})
    paths = []
    for s in range(shards):
        path = folder / shard_name(s, shards)
        with ShardWriter(path, grid_attrs(kind="regions"), SHAPE, shard_index=s, num_shards=shards, extras=extras,
                         **writer_options) as writer:
            for start, stop in ((0, 3), (3, 4), (4, rows)):
                n = stop - start
                writer.append([f"img_{s}_{i}" for i in range(start, stop)],
                              np.abs(rng.standard_normal((n, *SHAPE))),
                              **{name: (rng.random((n, *shape)) * 30).astype(dtype)
                                 for name, (shape, dtype) in extras.items()})
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------------------------ the fast path

def test_shards_and_an_index_over_several_read_every_dataset_at_offsets(tmp_path):
    shards = regions_shards(tmp_path / "regions")
    index = write_index(tmp_path / "regions.h5", shards)
    for path in (shards[1], index):
        fs = assert_same_bytes_as_h5py(path)
        for name in fs.datasets:
            assert fs.how_read(name)[0] == "pread", (name, fs.how_read(name))
    assert FeatureSet(index).how_read() == ("pread", "uncompressed rows at known offsets in 3 files")


def test_an_index_moved_with_its_shards_still_reads_at_offsets(tmp_path):
    index = write_index(tmp_path / "a" / "regions.h5", regions_shards(tmp_path / "a" / "regions", shards=2))
    (tmp_path / "a").rename(tmp_path / "b")
    fs = assert_same_bytes_as_h5py(tmp_path / "b" / index.name, ["features"])
    assert fs.how_read()[0] == "pread"


def test_a_set_written_by_import_scan_reads_at_offsets(tmp_path):
    from click.testing import CliRunner

    from retr.pipeline.commands import cli
    rng = np.random.default_rng(3)
    data = tmp_path / "f30k_precomp"
    data.mkdir()
    for split, n in (("train", 9), ("dev", 3), ("test", 4)):
        np.save(data / f"{split}_ims.npy", np.abs(rng.standard_normal((n, 36, 2048))).astype(np.float32))
        (data / f"{split}_caps.txt").write_text("".join(f"a caption {c} of image {i}\n"
                                                        for i in range(n) for c in range(5)))
    result = CliRunner().invoke(cli, ["import-scan", "--data-dir", str(data), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    fs = assert_same_bytes_as_h5py(tmp_path / "out" / "regions.h5", ["features", "num_boxes", "boxes"])
    assert fs.how_read()[0] == "pread" and fs.how_read("num_boxes")[0] == "pread"


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("chunk_rows", [1, 5, 64])          # 64 > the 23 rows: one partly filled chunk
def test_chunks_of_several_whole_rows_read_at_offsets(tmp_path, chunk_rows, dtype):
    write_set(tmp_path / "s.h5", dtype=dtype, chunks=(chunk_rows, *SHAPE), maxshape=(None, *SHAPE))
    assert assert_same_bytes_as_h5py(tmp_path / "s.h5").how_read()[0] == "pread"


def test_a_contiguous_dataset_reads_at_offsets(tmp_path):
    write_set(tmp_path / "s.h5")                           # no chunks: one contiguous block
    with h5py.File(tmp_path / "s.h5", "r") as f:
        assert f["features"].chunks is None
    assert assert_same_bytes_as_h5py(tmp_path / "s.h5").how_read()[0] == "pread"


def test_neighbours_on_disk_are_one_read_and_the_rest_one_read_each(tmp_path, monkeypatch):
    write_set(tmp_path / "s.h5", rows=40)                  # contiguous: row r + 1 follows row r on disk
    fs = FeatureSet(tmp_path / "s.h5")
    assert fs.how_read()[0] == "pread"
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: calls.append(len(buffers)) or real(fd, buffers,
                                                                                                      offset))
    fs.read_rows([7, 3, 4, 5, 30, 6])                      # 3..7 adjacent on disk (out of order here), and 30
    assert calls == [3, 1]      # rows 3..7: one read into 3 places of the batch (3..5 lie together there too); 30
    calls.clear()
    fs.read_rows(np.arange(10, 20))                        # in order in the batch too: one read into one buffer
    assert calls == [1]
    calls.clear()
    fs.read_rows([9, 9, 9])                                # a repeated row is read once
    assert calls == [1]


def test_a_file_shortened_under_the_reader_is_a_one_line_error(tmp_path):
    write_set(tmp_path / "s.h5", rows=40)
    fs = FeatureSet(tmp_path / "s.h5")
    assert fs.how_read()[0] == "pread"
    fs.read_rows([0])                                      # the file is open: shortening it is seen on reading
    with h5py.File(tmp_path / "s.h5", "r") as f:
        end = f["features"].id.get_offset() + 20 * int(np.prod(SHAPE)) * 2
    os.truncate(tmp_path / "s.h5", end)
    with pytest.raises(UserError, match="ends before byte"):
        fs.read_rows([35])


# ------------------------------------------------------------------------------------------------ h5py's path

@pytest.mark.parametrize("options, why", [
    ({"compression": "gzip"}, "filtered (gzip)"),
    ({"compression": "lzf"}, "filtered (lzf)"),
    ({"chunks": (2, *SHAPE), "shuffle": True}, "filtered (shuffle)"),
    ({"chunks": (2, *SHAPE), "fletcher32": True}, "filtered (fletcher32)"),
    ({"chunks": (1, SHAPE[0], SHAPE[1] // 2)}, "cut its rows"),
    ({"dtype": ">f4"}, "byte order"),
])
def test_filtered_cut_or_foreign_layouts_are_read_by_h5py(tmp_path, options, why):
    write_set(tmp_path / "s.h5", **options)
    fs = assert_same_bytes_as_h5py(tmp_path / "s.h5")
    how, reason = fs.how_read()
    assert how == "h5py" and why in reason


def test_a_compressed_index_is_read_by_h5py(tmp_path):
    index = write_index(tmp_path / "regions.h5", regions_shards(tmp_path / "regions", shards=2, compression="gzip"))
    fs = assert_same_bytes_as_h5py(index, ["features"])
    assert fs.how_read() == ("h5py", "/features is filtered (gzip)")
    assert fs.how_read("num_boxes")[0] == "pread"          # only features are compressed by the writer


def test_chunks_never_written_are_read_by_h5py(tmp_path):
    path = tmp_path / "s.h5"
    write_set(path, chunks=(1, *SHAPE), maxshape=(None, *SHAPE))
    with h5py.File(path, "a") as f:                        # grow the dataset without writing its new rows
        f["features"].resize(30, axis=0)
        del f["ids"]
        f.create_dataset("ids", data=np.array([f"img_{i}" for i in range(30)], dtype=object),
                         dtype=h5py.string_dtype("utf-8"))
    fs = assert_same_bytes_as_h5py(path)
    assert fs.how_read()[0] == "h5py" and "not written" in fs.how_read()[1]


def test_an_index_with_an_unmapped_row_is_read_by_h5py(tmp_path):
    shards = regions_shards(tmp_path / "regions", shards=2, rows=7)
    path = tmp_path / "gap.h5"
    with h5py.File(path, "w") as f:                        # 15 rows, the shards map 14: row 7 is the fill value
        f.attrs.update({**grid_attrs(kind="regions"), "complete": True})
        f.create_dataset("ids", data=np.array([f"img_{i}" for i in range(15)], dtype=object),
                         dtype=h5py.string_dtype("utf-8"))
        layout = h5py.VirtualLayout(shape=(15, *SHAPE), dtype="float16")
        layout[0:7] = h5py.VirtualSource(os.path.relpath(shards[0], tmp_path), "features", shape=(7, *SHAPE))
        layout[8:15] = h5py.VirtualSource(os.path.relpath(shards[1], tmp_path), "features", shape=(7, *SHAPE))
        f.create_virtual_dataset("features", layout, fillvalue=np.nan)
    fs = assert_same_bytes_as_h5py(path)
    assert fs.how_read() == ("h5py", "/features has rows no source maps (they read as the fill value)")


# ------------------------------------------------------------------------------------------------ processes

class RowPairs:
    """Item ``i``: rows ``i`` and ``N - 1 - i`` of a feature set (a map-style dataset for DataLoader workers)."""

    def __init__(self, fs: FeatureSet):
        self.fs = fs

    def __len__(self):
        return len(self.fs)

    def __getitem__(self, i):
        import torch
        return torch.from_numpy(self.fs.read_rows([i, len(self.fs) - 1 - i]))


def test_the_reader_pickles_without_its_descriptors_and_reads_in_workers(tmp_path):
    torch = pytest.importorskip("torch")
    index = write_index(tmp_path / "regions.h5", regions_shards(tmp_path / "regions"))
    fs = FeatureSet(index)
    expected = fs.read_all()                               # descriptors open in the parent before the fork
    clone = pickle.loads(pickle.dumps(fs))
    assert all(reader is None or not reader._fds for reader, _ in clone._direct.values())
    assert clone.read_rows([4, 1]).tobytes() == expected[[4, 1]].tobytes()
    for context in ("fork", "spawn"):
        loader = torch.utils.data.DataLoader(RowPairs(fs), batch_size=None, num_workers=2,
                                             multiprocessing_context=context)
        got = torch.stack(list(loader)).numpy()
        assert got[:, 0].tobytes() == expected.tobytes() and got[:, 1].tobytes() == expected[::-1].tobytes()


def test_a_file_replaced_after_its_offsets_were_found_is_refused(tmp_path):
    write_set(tmp_path / "s.h5", rows=40)
    fs = FeatureSet(tmp_path / "s.h5")
    assert fs.how_read()[0] == "pread"                     # offsets found; no descriptor open in this copy:
    clone = pickle.loads(pickle.dumps(fs))                 # a worker opens the file on its first read
    write_set(tmp_path / "t.h5", rows=40, seed=1, chunks=(1, *SHAPE))    # same rows, other places in the file
    os.replace(tmp_path / "t.h5", tmp_path / "s.h5")
    with pytest.raises(UserError, match="replaced or changed after the feature set was opened"):
        clone.read_rows([3])
