"""Where the trainer holds a split's features (``preload``): auto's choice between the GPU, host memory and the
file from the memory free, the one line that says so, preloading in slices, and reading per batch in workers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import retr.trainers.data.splits as splits
from retr.store.features import FeatureSet
from retr.store.vocab import Vocabulary
from retr.trainers.data.splits import CaptionBatches, EpochBatchSampler, ImageFeatures, load_split, place_features

GIB = 1 << 30
MIB = 1 << 20


@pytest.fixture(scope="module")
def synthetic(synthetic_data):
    """(manifest, features) of the 40-image synthetic set (shared: read-only)."""
    return synthetic_data(images=40)


# ------------------------------------------------------------------------------------------------ the rule

@pytest.mark.parametrize("nbytes, host, device, device_memory, processes, where", [
    # host memory: held while it leaves max(4 GiB, 25 % of what is available) free
    (4.3 * GIB, 18 * GIB, "cpu", None, 1, "host"),          # leaves 13.7 ≥ 4.5
    (4.3 * GIB, 12.1 * GIB, "cpu", None, 1, "host"),        # leaves 7.8 ≥ 4
    (4.3 * GIB, 8 * GIB, "cpu", None, 1, "file"),           # would leave 3.7 < 4
    (15.6 * GIB, 21 * GIB, "cpu", None, 1, "host"),         # COCO train on a 24 GB box: leaves 5.4 ≥ 5.25
    (15.6 * GIB, 20 * GIB, "cpu", None, 1, "file"),         # would leave 4.4 < 5
    (12 * GIB, 64 * GIB, "cpu", None, 1, "host"),           # leaves 52 ≥ 16
    (50 * GIB, 64 * GIB, "cpu", None, 1, "file"),           # would leave 14 < 16
    (12 * GIB, 64 * GIB, "cpu", None, 4, "host"),           # a quarter each: leaves 4 ≥ 4
    (12.5 * GIB, 64 * GIB, "cpu", None, 4, "file"),         # would leave 3.5 < 4
    (2 * GIB, 64 * GIB, "cpu", None, 4, "host"),            # 16 each: leaves 14 ≥ 4
    # small sets are always held, even when memory is short or unknown
    (100 * MIB, 1 * GIB, "cpu", None, 1, "host"),
    (256 * MIB, None, "cpu", None, 1, "host"),
    (257 * MIB, None, "cpu", None, 1, "file"),              # unknown free memory: larger sets stay in the file
    # CUDA: on the device while 25 % of its memory stays free, else as on a CPU
    (4.3 * GIB, 18 * GIB, "cuda:0", (70 * GIB, 80 * GIB), 1, "gpu"),
    (16.7 * GIB, 18 * GIB, "cuda:0", (22 * GIB, 24 * GIB), 1, "file"),   # 22 − 6 < 16.7; host 18 − 4.5 < 16.7
    (16.7 * GIB, 64 * GIB, "cuda:0", (22 * GIB, 24 * GIB), 1, "host"),
    (100 * MIB, 1 * GIB, "cuda:0", (1 * GIB, 80 * GIB), 1, "host"),      # small, the GPU full: host
    (100 * MIB, 1 * GIB, "cuda:0", (40 * GIB, 80 * GIB), 1, "gpu"),
    (4.3 * GIB, 18 * GIB, "cpu", (70 * GIB, 80 * GIB), 1, "host"),       # device memory counts only on CUDA
])
def test_auto_places_features_by_the_memory_free(nbytes, host, device, device_memory, processes, where):
    got, why = place_features(int(nbytes), None if host is None else int(host), device, device_memory, processes)
    assert got == where, why
    assert "\n" not in why and why


def test_the_reason_says_what_was_free_and_what_auto_keeps():
    where, why = place_features(int(4.3 * GIB), int(6.4 * GIB))
    assert where == "file"
    assert why == "holding them would leave 2.1 GiB of the 6.4 GiB available, under the 4.0 GiB auto keeps free"
    where, why = place_features(int(4.3 * GIB), int(18 * GIB))
    assert (where, why) == ("host", "18.0 GiB available: 13.7 GiB stay free, over the 4.5 GiB auto keeps")
    where, why = place_features(int(4.3 * GIB), int(18 * GIB), "cuda:0", (70 * GIB, 80 * GIB))
    assert (where, why) == ("gpu", "cuda:0 has 70.0 GiB free: 65.7 GiB stay free, over the 20.0 GiB auto keeps")
    where, why = place_features(int(16.7 * GIB), 64 * GIB, "cuda:1", (22 * GIB, 24 * GIB))
    assert where == "host" and why.endswith("; cuda:1 has 22.0 GiB free, too little to keep 6.0 GiB free")
    where, why = place_features(2 * GIB, 64 * GIB, processes=4)
    assert why.startswith("16.0 GiB available to each of 4 processes: 14.0 GiB stay free")


def test_processes_on_this_host_come_from_torchrun(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert splits.processes_on_this_host() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert splits.processes_on_this_host() == 4


# ------------------------------------------------------------------------------------------------ ImageFeatures

def test_auto_reads_the_memory_free_and_says_in_one_line_where_the_features_are(synthetic, monkeypatch):
    _, path = synthetic
    fs = FeatureSet(path)
    ids = list(fs.ids)
    size = splits.size_text(ImageFeatures(fs, ids, "off").nbytes)
    assert [splits.size_text(n) for n in (4.3 * GIB, 12.5 * MIB, 40 << 10)] == ["4.3 GiB", "12.5 MiB", "40.0 KiB"]
    held = ImageFeatures(fs, ids, "auto")                   # a small set: always held
    assert (held.where, held.reader) == ("host", "host")
    assert held.decision == f"features: {size}, held in host memory (under 256.0 MiB: always held)"
    monkeypatch.setattr(splits, "ALWAYS_HELD_BYTES", 0)
    monkeypatch.setattr(splits, "host_memory_available", lambda: 2 * GIB)
    on_file = ImageFeatures(fs, ids, "auto")
    assert (on_file.where, on_file.reader, on_file.preloaded) == ("file", "pread", False)
    assert on_file.decision == (f"features: {size}, read from the file per batch with pread (holding them would "
                                "leave 2.0 GiB of the 2.0 GiB available, under the 4.0 GiB auto keeps free)")
    monkeypatch.setattr(splits, "host_memory_available", lambda: 64 * GIB)
    assert ImageFeatures(fs, ids, "auto").decision.startswith(f"features: {size}, held in host memory (64.0 GiB "
                                                              "available: 64.0 GiB stay free")
    for preload, where, says in (("host", "host", "held in host memory (as asked)"),
                                 ("off", "file", "read from the file per batch with pread (as asked)"),
                                 ("gpu", "gpu", "held on cpu (as asked)")):
        chosen = ImageFeatures(fs, ids, preload)
        assert (chosen.where, chosen.decision) == (where, f"features: {size}, {says}")


def test_a_compressed_set_read_per_batch_says_h5py_reads_it(tmp_path, synthetic):
    from retr.store.features import ShardWriter
    _, path = synthetic
    fs = FeatureSet(path)
    squeezed = tmp_path / "squeezed.h5"
    with ShardWriter(squeezed, {k: fs.attrs[k] for k in ("kind", "extractor", "backbone", "weights", "image_size",
                                                          "manifest_sha256")},
                     fs.feature_shape, dtype=str(fs.dtype), compression="gzip") as writer:
        writer.append(list(fs.ids), fs.read_all())
    compressed = FeatureSet(squeezed)
    feats = ImageFeatures(compressed, list(fs.ids)[::-1], "off")
    assert feats.reader == "h5py"
    assert feats.decision.endswith("(as asked); h5py reads them: /features is filtered (gzip)")
    images = np.array([3, 0, 3, 17])
    plain = ImageFeatures(fs, list(fs.ids)[::-1], "off")
    assert plain.reader == "pread"
    assert torch.equal(feats.get(images)[0], plain.get(images)[0])


def test_preloading_reads_in_slices_with_a_progress_bar(synthetic, monkeypatch, capsys):
    _, path = synthetic
    fs = FeatureSet(path)
    ids = list(fs.ids)[::-1][:37]                           # in reverse file order, not all rows
    row_bytes = ImageFeatures(fs, ids[:1], "off").nbytes
    monkeypatch.setattr(splits, "PRELOAD_SLICE_BYTES", 10 * row_bytes)
    monkeypatch.setattr(splits, "ALWAYS_HELD_BYTES", 0)            # a "large" set: the bar shows
    monkeypatch.setenv("RETR_PROGRESS_SECONDS", "0")
    slices = []
    real = FeatureSet.read_rows
    monkeypatch.setattr(FeatureSet, "read_rows", lambda self, rows, name="features", out=None: (
        slices.append(len(rows)) if name == "features" else None) or real(self, rows, name, out))
    expected = real(fs, fs.rows_of(ids))
    for preload in ("host", "gpu"):                          # "gpu" on the CPU: one tensor, filled the same way
        slices.clear()
        feats = ImageFeatures(fs, ids, preload)
        assert slices == [10, 10, 10, 7]
        held = feats._memory if preload == "host" else feats._on_device[0].numpy()
        assert held.tobytes() == expected.tobytes()
    assert "load features" in capsys.readouterr().err
    slices.clear()                   # a device other than the CPU gets each slice through one staging slice
    feats._preload(torch.empty((len(ids), *feats.feature_shape), dtype=torch.float16, device="meta"), quiet=True)
    assert slices == [10, 10, 10, 7]
    ImageFeatures(fs, ids, "host", quiet=True)
    assert "load features" not in capsys.readouterr().err


def test_batches_read_per_batch_in_two_workers_equal_those_held_in_memory(synthetic):
    manifest, path = synthetic
    fs = FeatureSet(path)
    data, _ = load_split(manifest, ["train"], Vocabulary(["a"]), fs)
    on_file = ImageFeatures(fs, data.image_ids, "off")
    held = ImageFeatures(fs, data.image_ids, "host")
    assert on_file.reader == "pread"
    sampler = EpochBatchSampler(data.num_captions, 16, seed=0)
    loader = torch.utils.data.DataLoader(CaptionBatches(data, on_file, as_stored=True), sampler=sampler,
                                         batch_size=None, num_workers=2)
    batches = list(loader)
    assert len(batches) == len(sampler) > 2
    for batch, captions in zip(batches, sampler):
        reference = CaptionBatches(data, held, as_stored=True)[captions]
        assert torch.equal(batch["features"], reference["features"]) and torch.equal(batch["mask"], reference["mask"])


# ------------------------------------------------------------------------------------------------ host memory

def test_host_memory_is_memavailable_capped_by_the_control_groups_room(tmp_path, monkeypatch):
    from retr.common import memory
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684084 kB\nMemFree:        15946428 kB\nMemAvailable:   22409220 kB\n")
    assert memory._meminfo_available(meminfo) == 22409220 * 1024
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir()
    v1.mkdir()
    assert memory._cgroup_room(v2, v1) is None                               # no controller to read
    (v2 / "memory.max").write_text("max\n")
    (v2 / "memory.current").write_text("1000\n")
    assert memory._cgroup_room(v2, v1) is None                               # no limit
    (v2 / "memory.max").write_text(f"{8 * GIB}\n")
    (v2 / "memory.current").write_text(f"{6 * GIB}\n")
    (v2 / "memory.stat").write_text(f"anon {4 * GIB}\nfile {2 * GIB}\ninactive_file {GIB}\nactive_file {GIB}\n")
    assert memory._cgroup_room(v2, v1) == 3 * GIB                            # 8 − 6 + the inactive file pages
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")      # v1's "no limit"
    (v1 / "memory.usage_in_bytes").write_text("7302737920\n")
    assert memory._cgroup_room(tmp_path / "none", v1) is None
    (v1 / "memory.limit_in_bytes").write_text(f"{4 * GIB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    assert memory._cgroup_room(tmp_path / "none", v1) == 3 * GIB            # no memory.stat: nothing added
    (v1 / "memory.usage_in_bytes").write_text(f"{5 * GIB}\n")
    assert memory._cgroup_room(tmp_path / "none", v1) == 0                   # over its limit: nothing left
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 20 * GIB)
    monkeypatch.setattr(memory, "_cgroup_room", lambda: 3 * GIB)
    assert memory.host_memory_available() == 3 * GIB                        # a job's limit under what is free
    monkeypatch.setattr(memory, "_cgroup_room", lambda: None)
    assert memory.host_memory_available() == 20 * GIB
