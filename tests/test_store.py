"""The HDF5 feature store: writer, index, reader, atomicity."""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

from retr.common.errors import UserError
from retr.store.features import (REGION_DATASETS, FeatureSet, ShardWriter, index_shard_folder, is_complete,
                                 shard_name, shard_status, write_index)
from tests.conftest import grid_attrs


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_round_trip_through_index(make_feature_set, dtype):
    index, expected = make_feature_set(num_shards=3, rows_per_shard=4, dtype=dtype)
    fs = FeatureSet(index)
    assert len(fs) == 12
    assert fs.dtype == np.dtype(dtype)
    assert fs.feature_shape == (49, 2048)
    assert fs.attrs["kind"] == "grid" and fs.attrs["num_shards"] == 3
    assert list(fs.ids) == [f"img_{s}_{i}" for s in range(3) for i in range(4)]
    ids = ["img_2_3", "img_0_0", "img_1_2", "img_2_3"]  # unsorted, across shards, with a repeat
    got = fs.read_ids(ids)
    tol = 1e-3 if dtype == "float16" else 0
    for row, image_id in zip(got, ids):
        want = expected[image_id].astype(dtype)
        assert row.dtype == np.dtype(dtype)
        np.testing.assert_allclose(row.astype(np.float32), want.astype(np.float32), rtol=tol, atol=tol)
    # by row: contiguous, scattered, single
    np.testing.assert_array_equal(fs.read_rows([4, 5, 6]), fs.read_ids(["img_1_0", "img_1_1", "img_1_2"]))
    np.testing.assert_array_equal(fs.read_rows([11, 0])[0], fs.read_ids(["img_2_3"])[0])
    assert fs.read_rows([]).shape == (0, 49, 2048)
    assert fs.read_all().shape == (12, 49, 2048)
    assert sorted(fs.errors) == [(f"broken_{s}", "cannot identify image file") for s in range(3)]


def test_unknown_id_and_bad_row(make_feature_set):
    index, _ = make_feature_set(num_shards=1)
    fs = FeatureSet(index)
    with pytest.raises(KeyError, match="nope"):
        fs.read_ids(["img_0_0", "nope"])
    with pytest.raises(IndexError):
        fs.read_rows([99])


def test_single_shard_is_readable_on_its_own(make_feature_set, tmp_path):
    index, expected = make_feature_set(num_shards=2, rows_per_shard=3)
    shard = tmp_path / "features" / "resnet152-grid" / shard_name(1, 2)
    fs = FeatureSet(shard)
    assert list(fs.ids) == ["img_1_0", "img_1_1", "img_1_2"]
    np.testing.assert_allclose(fs.read_ids(["img_1_1"])[0].astype(np.float32),
                               expected["img_1_1"], atol=1e-2, rtol=1e-3)


def test_index_survives_moving_the_folder(make_feature_set, tmp_path):
    index, expected = make_feature_set(num_shards=2)
    moved = tmp_path / "elsewhere"
    (tmp_path / "features").rename(moved)
    fs = FeatureSet(moved / index.name)
    np.testing.assert_allclose(fs.read_ids(["img_1_2"])[0].astype(np.float32), expected["img_1_2"],
                               atol=1e-2, rtol=1e-3)


def test_reader_pickles_for_dataloader_workers(make_feature_set):
    index, _ = make_feature_set(num_shards=2)
    fs = FeatureSet(index)
    before = fs.read_rows([1, 5])  # opens the handle in this process
    clone = pickle.loads(pickle.dumps(fs))
    assert clone._file is None  # a worker re-opens lazily
    np.testing.assert_array_equal(clone.read_rows([1, 5]), before)


def test_dataloader_workers_read_the_same_rows(make_feature_set):
    torch = pytest.importorskip("torch")
    index, _ = make_feature_set(num_shards=2, rows_per_shard=4)
    fs = FeatureSet(index)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(fs)

        def __getitem__(self, i):
            return torch.from_numpy(fs.read_rows([i])[0].astype(np.float32))

    fs.read_rows([0])  # a handle is open in the parent before the fork
    loader = torch.utils.data.DataLoader(Rows(), batch_size=3, num_workers=2)
    got = torch.cat(list(loader)).numpy()
    np.testing.assert_array_equal(got, fs.read_all().astype(np.float32))


def test_writer_rejects_wrong_shapes_duplicates_and_float16_overflow(tmp_path):
    with ShardWriter(tmp_path / "s.h5", grid_attrs(), (49, 2048)) as writer:
        with pytest.raises(ValueError, match="shape"):
            writer.append(["a"], np.zeros((1, 49, 512)))
        writer.append(["a"], np.zeros((1, 49, 2048)))
        with pytest.raises(ValueError, match="twice"):
            writer.append(["a"], np.zeros((1, 49, 2048)))
        with pytest.raises(ValueError, match="float16"):
            writer.append(["b"], np.full((1, 49, 2048), 1e6))
    assert FeatureSet(tmp_path / "s.h5").ids.tolist() == ["a"]


def test_writer_requires_attributes_and_known_kind(tmp_path):
    attrs = grid_attrs()
    del attrs["weights"]
    with pytest.raises(UserError, match="weights"):
        ShardWriter(tmp_path / "s.h5", attrs, (49, 2048))
    with pytest.raises(UserError, match="kind"):
        ShardWriter(tmp_path / "t.h5", grid_attrs(kind="pixels"), (49, 2048))
    assert not list(tmp_path.iterdir())


def test_exception_inside_writer_leaves_nothing(tmp_path):
    path = tmp_path / shard_name(0, 1)
    with pytest.raises(RuntimeError):
        with ShardWriter(path, grid_attrs(), (49, 2048)) as writer:
            writer.append(["a"], np.zeros((1, 49, 2048)))
            raise RuntimeError("boom")
    assert not list(tmp_path.iterdir())


def test_killed_writer_leaves_no_finished_looking_file(tmp_path):
    folder = tmp_path / "resnet152-grid"
    script = textwrap.dedent(f"""
        import os, signal, numpy as np
        from retr.store.features import ShardWriter, shard_name
        from tests.conftest import grid_attrs
        w = ShardWriter({str(folder)!r} + "/" + shard_name(0, 2), grid_attrs(), (49, 2048), shard_index=0, num_shards=2)
        w.append(["a", "b"], np.ones((2, 49, 2048)))
        w._file.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == -signal.SIGKILL
    final = folder / shard_name(0, 2)
    assert not final.exists()
    partial = folder / (shard_name(0, 2) + ".partial")
    assert partial.exists() and not is_complete(partial)
    count, complete, partials = shard_status(folder)
    assert count is None and complete == {} and partials == [partial]
    # and a finished sibling shard alone is not enough for an index
    with ShardWriter(folder / shard_name(1, 2), grid_attrs(), (49, 2048), shard_index=1, num_shards=2) as w:
        w.append(["c"], np.ones((1, 49, 2048)))
    with pytest.raises(UserError, match="1 of 2 shards missing.*partial"):
        index_shard_folder(folder)


def test_index_shard_folder_writes_sibling_index(tmp_path):
    folder = tmp_path / "vgg16-maps"
    for s in range(2):
        attrs = grid_attrs(kind="maps", extractor="vgg16-maps", backbone="vgg16")
        with ShardWriter(folder / shard_name(s, 2), attrs, (196, 512), shard_index=s, num_shards=2) as w:
            w.append([f"x{s}"], np.full((1, 196, 512), s, dtype=np.float32))
    path = index_shard_folder(folder)
    assert path == tmp_path / "vgg16-maps.h5"
    fs = FeatureSet(path)
    assert fs.read_ids(["x1"])[0].mean() == 1.0


def test_index_refuses_inconsistent_shards(tmp_path):
    paths = []
    for s, weights in enumerate(["random", "IMAGENET1K_V2"]):
        path = tmp_path / "g" / shard_name(s, 2)
        with ShardWriter(path, grid_attrs(weights=weights), (49, 2048), shard_index=s, num_shards=2) as w:
            w.append([f"x{s}"], np.zeros((1, 49, 2048)))
        paths.append(path)
    with pytest.raises(UserError, match="weights"):
        write_index(tmp_path / "g.h5", paths)


def test_regions_extras_round_trip(tmp_path):
    attrs = grid_attrs(kind="regions", extractor="butd-regions", backbone="resnet101-c4", image_size="600/1000")
    extras = {name: ((36, *shape), dtype) for name, (shape, dtype) in REGION_DATASETS.items()}
    extras.update(num_boxes=((), "int32"), image_hw=((2,), "int32"))
    rng = np.random.default_rng(1)
    boxes = rng.uniform(0, 100, (2, 36, 4)).astype(np.float32)
    with ShardWriter(tmp_path / "r" / shard_name(0, 1), attrs, (36, 2048), extras=extras) as w:
        w.append(["p", "q"], rng.standard_normal((2, 36, 2048)), boxes=boxes, object_ids=np.ones((2, 36)),
                 object_conf=np.ones((2, 36)), attr_ids=np.zeros((2, 36)), attr_conf=np.zeros((2, 36)),
                 num_boxes=[36, 20], image_hw=[[480, 640], [10, 20]])
    fs = FeatureSet(index_shard_folder(tmp_path / "r"))
    np.testing.assert_array_equal(fs.read_ids(["q", "p"], "boxes"), boxes[::-1])
    assert fs.read_ids(["q"], "num_boxes").tolist() == [20]
    assert fs.read_ids(["q"], "image_hw").tolist() == [[10, 20]]
    assert fs.read_rows([0], "object_ids").dtype == np.int32


def test_reader_refuses_index_with_missing_shard(make_feature_set, tmp_path):
    index, _ = make_feature_set(num_shards=2)
    (tmp_path / "features" / "resnet152-grid" / shard_name(1, 2)).unlink()
    with pytest.raises(UserError, match="shard-00001-of-00002.h5 is missing"):
        FeatureSet(index)


def test_chunks_hold_one_sample(make_feature_set):
    index, _ = make_feature_set(num_shards=1)
    shard = index.parent / "resnet152-grid" / shard_name(0, 1)
    with h5py.File(shard) as f:
        assert f["features"].chunks == (1, 49, 2048)
        assert f["features"].dtype == np.float16
        assert f.attrs["complete"]
