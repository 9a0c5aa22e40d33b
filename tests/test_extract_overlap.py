"""The overlap machinery of the extraction loop, on CPU: the device prefetcher (order, content, device handling,
no stream on CPU, one item ahead) and the background shard writer (bitwise the synchronous shard, failures
surfacing in the main thread as the same one-line errors, nothing renamed into place after a failure)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from PIL import Image

from retr.common.errors import UserError
from retr.extractors.base import Extractor
from retr.pipeline.extract import extract_features
from retr.common.prefetch import DevicePrefetcher, tensors_in
from retr.pipeline.write_thread import BackgroundWriter


# -- DevicePrefetcher ---------------------------------------------------------------------------------------------
def test_prefetcher_keeps_order_and_content_on_cpu_without_a_stream():
    items = [torch.full((2, 3), float(i)) for i in range(5)]
    prefetcher = DevicePrefetcher(items, lambda t: t.to("cpu", non_blocking=True) * 2, "cpu")
    assert prefetcher.stream is None and prefetcher.device == torch.device("cpu")
    out = list(prefetcher)
    assert len(out) == 5 and all(torch.equal(o, i * 2) for o, i in zip(out, items))
    assert all(o.device.type == "cpu" for o in out)
    assert list(DevicePrefetcher([], lambda t: t, "cpu")) == []
    assert [x for x in DevicePrefetcher([7], lambda v: v + 1, torch.device("cpu"))] == [8]


def test_prefetcher_moves_the_next_item_before_the_current_one_is_used():
    events = []

    def move(i):
        events.append(f"move {i}")
        return i

    for i in DevicePrefetcher(range(3), move, "cpu"):
        events.append(f"use {i}")
    assert events == ["move 0", "move 1", "use 0", "move 2", "use 1", "use 2"]


def test_prefetcher_passes_structures_through_and_finds_their_tensors():
    @dataclass
    class Moved:
        images: torch.Tensor
        rows: list

    a, b, c = torch.zeros(1), torch.ones(2), torch.arange(3)
    value = (Moved(a, [1, 2]), {"x": [b, "text"]}, c, None)
    assert [t for t in tensors_in(value)] == [a, b, c]
    assert list(DevicePrefetcher([value], lambda v: v, "cpu"))[0] is value


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefetcher_on_cuda_uses_a_side_stream_and_gives_the_same_items():
    items = [torch.randn(4, 3, 32, 32).pin_memory() for _ in range(4)]
    prefetcher = DevicePrefetcher(items, lambda t: t.to("cuda", non_blocking=True), "cuda")
    assert prefetcher.stream is not None and prefetcher.stream != torch.cuda.current_stream()
    out = [(o * 1).cpu() for o in prefetcher]
    assert all(torch.equal(o, i) for o, i in zip(out, items))


# -- BackgroundWriter ---------------------------------------------------------------------------------------------
class Recorder:
    """A writer that records its calls, slowly, from whichever thread runs them."""

    def __init__(self, fail_at: int | None = None):
        self.calls, self.threads, self.fail_at = [], set(), fail_at

    def append(self, ids, features, **extras):
        time.sleep(0.01)
        self.threads.add(threading.get_ident())
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise ValueError("features hold values beyond float16's range; use --dtype float32")
        self.calls.append(("append", ids[0], features.copy()))

    def add_error(self, image_id, reason):
        self.calls.append(("error", image_id, reason))


def test_background_writer_runs_calls_in_order_on_its_thread():
    recorder = Recorder()
    writer = BackgroundWriter(recorder, depth=2)
    for i in range(6):
        writer.append([f"id{i}"], np.full((1, 2, 3), i, np.float32))
        if i % 2:
            writer.add_error(f"bad{i}", "truncated")
    writer.close()
    assert [c[1] for c in recorder.calls] == ["id0", "id1", "bad1", "id2", "id3", "bad3", "id4", "id5", "bad5"]
    assert recorder.threads and threading.get_ident() not in recorder.threads
    synchronous = Recorder()
    BackgroundWriter(synchronous, depth=0).append(["x"], np.zeros((1, 2, 3), np.float32))
    assert synchronous.threads == {threading.get_ident()}


def test_background_writer_failure_surfaces_and_later_calls_are_dropped():
    recorder = Recorder(fail_at=1)
    writer = BackgroundWriter(recorder, depth=4)
    for i in range(4):
        writer.append([f"id{i}"], np.zeros((1, 2, 3), np.float32))
    with pytest.raises(ValueError, match="beyond float16's range"):
        writer.close()
    assert [c[1] for c in recorder.calls] == ["id0"]
    writer.abandon()   # after close: nothing left to stop, and no hang


# -- the stage, threaded writer against synchronous ----------------------------------------------------------------
class TinyExtractor(Extractor):
    """A network-free extractor: features are a fixed function of the image's pixels (``[B, 4, 3]``)."""

    name, kind = "tiny", "grid"

    def __init__(self, poison: int | None = None, **_options):
        self.poison = poison   # the red level (0..255) of the image whose features are NaN (the writer refuses them)
        self.device = torch.device("cpu")

    @property
    def feature_shape(self):
        return (4, 3)

    def attrs(self):
        return {"kind": "grid", "extractor": "tiny", "backbone": "none", "weights": "none", "image_size": 8}

    def load(self, path):
        from retr.extractors.images import SquareResize
        return SquareResize(8, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))(path)

    def extract(self, batch):
        features = batch.reshape(batch.shape[0], 3, 4, 16).mean(-1).transpose(1, 2).contiguous()
        if self.poison is not None:
            features[(batch[:, 0].mean(dim=(1, 2)) * 255).round() == self.poison] = float("nan")
        return {"features": features.numpy()}


def _dataset(folder: Path, count: int = 11) -> Path:
    import json
    (folder / "images").mkdir(parents=True)
    lines = []
    for i in range(count):
        if i == 4:
            (folder / "images" / f"{i}.jpg").write_bytes(b"not a jpeg")
        else:
            Image.new("RGB", (10 + i, 9), (i * 20, 255 - i * 20, 7)).save(folder / "images" / f"{i}.png")
        lines.append(json.dumps({"id": f"img{i}", "path": f"{i}.jpg" if i == 4 else f"{i}.png", "split": "test",
                                 "captions": ["x"]}))
    (folder / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "manifest.jsonl"


def _contents(shard: Path) -> dict:
    with h5py.File(shard, "r") as f:
        out = {name: f[name][:] for name in ("ids", "features", "errors", "checksums")}
        out["attrs"] = {k: f.attrs[k] for k in f.attrs if k != "created"}
    return out


def test_threaded_writer_writes_the_synchronous_shard_bit_for_bit(tmp_path):
    manifest = _dataset(tmp_path)
    shards = {}
    for depth in (0, 1, 3):
        out = tmp_path / f"out{depth}"
        extract_features(manifest, "tiny", out, image_root=tmp_path / "images", batch_size=2, workers=0,
                         num_shards=2, quiet=True, write_queue=depth, build=lambda name, **o: TinyExtractor())
        shards[depth] = [_contents(p) for p in sorted((out / "tiny").glob("shard-*.h5"))]
    reference = shards[0]
    assert sum(len(s["ids"]) for s in reference) == 10 and sum(len(s["errors"]) for s in reference) == 1
    for depth in (1, 3):
        for got, want in zip(shards[depth], reference):
            for name in ("features", "checksums"):
                assert got[name].dtype == want[name].dtype and got[name].tobytes() == want[name].tobytes()
            for name in ("ids", "errors"):
                assert got[name].tolist() == want[name].tolist(), (depth, name)
            assert {k: str(v) for k, v in got["attrs"].items()} == {k: str(v) for k, v in want["attrs"].items()}


def test_writer_thread_failure_is_the_same_one_line_error_and_leaves_no_shard(tmp_path):
    manifest = _dataset(tmp_path)
    poison = 6 * 20   # image 6's red level
    messages = {}
    for depth in (0, 3):
        out = tmp_path / f"out{depth}"
        with pytest.raises(UserError) as caught:
            extract_features(manifest, "tiny", out, image_root=tmp_path / "images", batch_size=2, workers=0,
                             quiet=True, write_queue=depth, build=lambda name, **o: TinyExtractor(poison=poison))
        messages[depth] = str(caught.value)
        assert not list((out / "tiny").glob("shard-*.h5")) and not list((out / "tiny").glob("*.partial"))
    assert messages[0] == messages[3]
    assert "'img6'" in messages[3] and "NaN" in messages[3] and "\n" not in messages[3]
