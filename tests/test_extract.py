"""The extraction stage (pipeline/extract.py, pipeline/write_thread.py, common/prefetch.py) and its commands."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torchvision
from click.testing import CliRunner
from PIL import Image

from retr.common.cli import run
from retr.common.errors import ParameterError, UserError
from retr.common.prefetch import DevicePrefetcher, tensors_in
from retr.extractors.base import Extractor, available_extractors, build_extractor
from retr.manifests.schema import manifest_sha256, outside_root_reason
from retr.manifests.synthetic import generate_synthetic
from retr.pipeline.commands import cli
from retr.pipeline.commands.extract import _builder_options
from retr.pipeline.extract import (DistributedEnv, extract_features, lock_shards, plan_shards, shard_lock_path,
                                   shard_ranges)
from retr.pipeline.verify import verify_feature_set
from retr.pipeline.write_thread import BackgroundWriter
from retr.store.features import ROOT_ATTRS, FeatureSet, decode_str, shard_name


VENV_BIN = Path(sys.executable).parent
#: The cheapest real extractor: ResNet-152 pooled vectors of ten 32-pixel crops (sharding, errors and resume do
#: not depend on which network runs; each network is checked against torchvision in test_extractors.py).
NAME = "tencrop-resnet152"
OPTIONS = {"weights": "random", "image_size": 32}
BROKEN = {"gone": "file not found", "empty": "empty file (0 bytes)",
          "text": "not an image (Pillow cannot identify the file format)",
          "cut": "cannot decode image: image file is truncated"}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, list[str], list[str]]:
    """6 synthetic images with 4 broken files interleaved: (manifest, good ids, broken ids) in manifest order."""
    root = tmp_path_factory.mktemp("synthetic")
    generate_synthetic(root, num_images=6, seed=0)
    lines = (root / "manifest.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    (root / "images" / "empty.jpg").write_bytes(b"")
    (root / "images" / "text.jpg").write_text("not pixels\n")
    full = (root / records[0]["path"]).read_bytes()
    (root / "images" / "cut.jpg").write_bytes(full[: len(full) // 2])
    broken = []
    for k, name in enumerate(BROKEN):
        broken.append({"id": f"broken_{name}", "path": f"images/{name}.jpg", "split": "train",
                       "captions": ["a broken file"]})
    mixed = [records[0], broken[0], records[1], records[2], broken[1], records[3], broken[2], records[4],
             records[5], broken[3]]
    manifest = root / "mixed.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in mixed))
    return manifest, [r["id"] for r in records], [b["id"] for b in broken]


@pytest.fixture(scope="module")
def extractor():
    """One random-weight extractor shared by the in-process runs (building ResNet-152 takes seconds)."""
    return build_extractor(NAME, **OPTIONS)


@pytest.fixture(scope="module")
def single_run(dataset, extractor, tmp_path_factory):
    """The whole mixed manifest extracted by one process, one shard, DataLoader workers on."""
    manifest, _good, _broken = dataset
    out = tmp_path_factory.mktemp("single")
    summary = extract_features(manifest, NAME, out, options=OPTIONS, batch_size=4, workers=2, quiet=True,
                               build=lambda name, **o: extractor)
    return summary


class Counting:
    """Wraps an extractor: counts images sent to the network; optionally interrupts at the n-th batch."""

    def __init__(self, inner, interrupt_at_batch: int | None = None):
        self.inner, self.images, self.batches, self.interrupt_at = inner, 0, 0, interrupt_at_batch

    def __call__(self, name, **options):
        return self

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def extract(self, batch):
        self.batches += 1
        if self.interrupt_at is not None and self.batches == self.interrupt_at:
            raise KeyboardInterrupt
        self.images += batch.shape[0]
        return self.inner.extract(batch)


def _read(index: Path) -> tuple[list[str], np.ndarray, dict[str, str], dict]:
    with h5py.File(index, "r") as f:
        ids = [decode_str(v) for v in f["ids"][:]]
        features = f["features"][:]
        errors = {decode_str(a): decode_str(b) for a, b in f["errors"][:]}
        attrs = {k: f.attrs[k] for k in f.attrs}
    return ids, features, errors, attrs


def test_shard_ranges_are_contiguous_and_balanced():
    assert shard_ranges(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert shard_ranges(2, 4) == [(0, 0), (0, 1), (1, 1), (1, 2)]
    for n, w in [(1000, 7), (5, 5), (0, 2)]:
        ranges = shard_ranges(n, w)
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1


def test_plan_shards_from_flags_and_torchrun_environment():
    alone = DistributedEnv()
    assert plan_shards(None, None, alone) == (1, [0])
    assert plan_shards(4, None, alone) == (4, [0, 1, 2, 3])
    assert plan_shards(4, 2, alone) == (4, [2])
    env = DistributedEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert plan_shards(None, None, env) == (2, [1])
    assert plan_shards(6, None, env) == (6, [1, 3, 5])
    with pytest.raises(ValueError, match="^shard_index under torchrun would make every rank write the same shard"):
        plan_shards(4, 1, env)
    with pytest.raises(ValueError, match="^shard_index 4 is outside 0..3"):
        plan_shards(4, 4, alone)
    with pytest.raises(ValueError, match="^shard_index needs num_shards$"):
        plan_shards(None, 0, alone)


@pytest.mark.slow
def test_extraction_rows_errors_attributes_and_values(dataset, extractor, single_run):
    manifest, good, broken = dataset
    summary = single_run
    index = summary.index_path
    assert summary.index_written and index.name == f"{NAME}.h5" and index.is_file()
    assert (summary.rows, summary.errors, summary.images) == (6, 4, 10)
    assert "10 images in 1 shard" in summary.line() and "6 rows, 4 unreadable images (listed in errors)" in summary.line()
    ids, features, errors, attrs = _read(index)
    assert ids == good  # manifest order, broken files nowhere among the rows
    assert set(errors) == set(broken)
    for name, reason in BROKEN.items():
        assert errors[f"broken_{name}"].startswith(reason)
    assert verify_feature_set(index) == []
    assert all(key in attrs for key in ROOT_ATTRS)
    assert (decode_str(attrs["kind"]), decode_str(attrs["weights"]), int(attrs["image_size"])) == ("tencrop", "random", 32)
    assert decode_str(attrs["manifest_sha256"]) == manifest_sha256(manifest)
    assert decode_str(attrs["dtype"]) == "float16" and features.dtype == np.float16 and features.shape == (6, 10, 2048)
    # The stored rows are torchvision's ResNet-152 pooled features of the same preprocessed crops (to float16).
    with torch.device("meta"):
        model = torchvision.models.resnet152(weights=None).eval()
    model.load_state_dict(extractor.network.state_dict(), strict=False, assign=True)
    root = manifest.parent
    paths = {json.loads(line)["id"]: root / json.loads(line)["path"] for line in manifest.read_text().splitlines()}
    crops = torch.cat([extractor.load(str(paths[i])) for i in good])  # [6·10, 3, 32, 32]
    with torch.no_grad():
        x = model.maxpool(model.relu(model.bn1(model.conv1(crops))))
        pooled = model.avgpool(model.layer4(model.layer3(model.layer2(model.layer1(x))))).flatten(1)
    expected = pooled.reshape(6, 10, 2048).numpy()
    np.testing.assert_allclose(features.astype(np.float32), expected, rtol=2e-3, atol=1e-4)
    assert np.abs(expected.astype(np.float16).astype(np.float32) - expected).max() > 0  # float16 really rounds


@pytest.mark.slow
def test_interrupted_run_resumes_without_redoing_finished_shards(dataset, extractor, single_run, tmp_path):
    manifest, good, broken = dataset
    reference = single_run
    out = tmp_path / "sharded"
    # 3 shards of 3, 3, 4 rows, batch size 3: the network's 2nd call is shard 1's first batch.
    interrupted = Counting(extractor, interrupt_at_batch=2)
    with pytest.raises(KeyboardInterrupt):
        extract_features(manifest, NAME, out, options=OPTIONS, batch_size=3, workers=0, num_shards=3,
                         quiet=True, build=interrupted)
    folder = out / NAME
    first = folder / shard_name(0, 3)
    assert sorted(p.name for p in folder.glob("shard-*")) == [first.name]  # no partial file left behind
    assert not (out / f"{NAME}.h5").exists()
    stamp = (first.stat().st_ino, first.stat().st_mtime_ns)
    resumed = Counting(extractor)
    summary = extract_features(manifest, NAME, out, options=OPTIONS, batch_size=3, workers=0, num_shards=3,
                               quiet=True, build=resumed)
    assert (first.stat().st_ino, first.stat().st_mtime_ns) == stamp
    with h5py.File(first, "r") as f:
        first_rows = f["features"].shape[0]
    assert resumed.images == len(good) - first_rows  # only the unfinished shards' images went through the network
    assert [s.skipped for s in summary.shards] == [True, False, False] and summary.index_written
    ids, features, errors, _ = _read(out / f"{NAME}.h5")
    ref_ids, ref_features, ref_errors, _ = _read(reference.index_path)
    assert ids == ref_ids and errors == ref_errors
    np.testing.assert_allclose(features.astype(np.float32), ref_features.astype(np.float32), rtol=2e-3, atol=1e-4)
    again = extract_features(manifest, NAME, out, options=OPTIONS, num_shards=3, quiet=True,
                             build=Counting(extractor))
    assert all(s.skipped for s in again.shards) and not again.index_written and "index up to date" in again.line()
    # A complete shard made with other settings is never mixed in.
    with pytest.raises(UserError, match="was made with image_size = 32, this run has 64"):
        extract_features(manifest, NAME, out, options={"weights": "random", "image_size": 64}, num_shards=3,
                         quiet=True)
    with pytest.raises(UserError, match="holds shards of a 3-shard run; use num_shards 3"):
        extract_features(manifest, NAME, out, options=OPTIONS, num_shards=2, quiet=True,
                         build=Counting(extractor))


@pytest.mark.slow
def test_torchrun_two_processes_match_one(dataset, single_run, tmp_path):
    manifest, good, broken = dataset
    single = single_run
    command = [str(VENV_BIN / "torchrun"), "--nproc-per-node", "2", "--no-python", str(VENV_BIN / "retr-pipeline"),
               "extract", "--manifest", str(manifest), "--extractor", NAME, "--out",
               str(tmp_path / "torchrun"), "--weights", "random", "--image-size", "32", "--workers", "0", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "torchrun" / NAME).glob("shard-*")) == \
        [shard_name(0, 2), shard_name(1, 2)]
    assert done.stdout.count("index written") == 1  # the rank that finished last wrote it, once
    ids, features, errors, attrs = _read(tmp_path / "torchrun" / f"{NAME}.h5")
    ref_ids, ref_features, ref_errors, _ = _read(single.index_path)
    assert ids == ref_ids and errors == ref_errors and int(attrs["num_shards"]) == 2
    # Other batch compositions and thread counts may flip a float16 rounding, nothing more.
    np.testing.assert_allclose(features.astype(np.float32), ref_features.astype(np.float32), rtol=2e-3, atol=1e-4)
    assert verify_feature_set(tmp_path / "torchrun" / f"{NAME}.h5") == []


def test_command_errors_are_one_line(dataset, tmp_path, monkeypatch, capsys):
    """Through the console script's own entry point (``retr.common.cli.run``), in this process."""
    manifest, _good, _broken = dataset
    path = tmp_path / "resnet18.pth"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), path)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    base = ["extract", "--manifest", str(manifest), "--extractor", NAME, "--out", str(tmp_path / "out")]
    for extra, expected in [(["--weights", str(path)], "does not fit resnet152"),
                            ([], "ImageNet weights ResNet152_Weights.IMAGENET1K_V1 (resnet152-394f9c45.pth) not found"),
                            (["--weights", "random", "--half", "--device", "cpu"],
                             "error: --half needs --device cuda (half-precision"),
                            (["--weights", "random", "--shard-index", "1"],
                             "error: --shard-index needs --num-shards\n"),
                            (["--weights", "random", "--image-size", "16"],
                             "error: --image-size (the crop side) must be at least 32 for tencrop-resnet152, not 16\n"),
                            (["--weights", "random", "--grid-size", "7"],
                             "error: extractor 'tencrop-resnet152' does not take --grid-size\n"),
                            (["--weights", "random", "--batch-size", "0"], "error: --batch-size must be at least 1")]:
        with pytest.raises(SystemExit) as exited:
            run(cli, base + extra)
        stderr = capsys.readouterr().err
        assert exited.value.code == 1, stderr
        assert stderr.count("\n") == 1 and stderr.startswith("error: ") and expected in stderr
        assert "Traceback" not in stderr
    assert not (tmp_path / "out" / NAME).exists()


def test_extractor_is_a_choice_of_the_registered_ones(tmp_path, capsys):
    names = available_extractors()
    write_one_image_manifest(tmp_path / "m.jsonl")            # a manifest that is one: the choice is what is wrong
    with pytest.raises(SystemExit) as exited:
        run(cli, ["extract", "--manifest", str(tmp_path / "m.jsonl"), "--extractor", "nope", "--out", str(tmp_path)])
    stderr = capsys.readouterr().err
    assert exited.value.code == 2 and "Usage: " in stderr and "Traceback" not in stderr
    assert "error: Invalid value for '--extractor': 'nope' is not one of" in stderr
    assert all(repr(name) in stderr for name in names)
    shown = CliRunner().invoke(cli, ["extract", "--help"])
    assert shown.exit_code == 0 and "--extractor [" + "|".join(names) + "]" in shown.output


def write_one_image_manifest(path: Path) -> None:
    path.write_text(json.dumps({"id": "a", "path": "a.jpg", "split": "train", "captions": ["a cat"]}) + "\n")


def test_extract_preset_runs_every_available_extractor(tmp_path, monkeypatch):
    calls = []

    class Summary:
        def __init__(self, name):
            self.name = name

        def line(self):
            return f"{self.name}: done"

    def fake_extract(manifest, name, out, **kwargs):
        calls.append((name, Path(manifest), Path(out), kwargs["image_root"], kwargs["options"]))
        return Summary(name)

    import retr.pipeline.commands.extract as command
    monkeypatch.setattr(command, "extract_features", fake_extract)
    write_one_image_manifest(tmp_path / "m.jsonl")  # read once up front: a bad one is one error, not one each
    monkeypatch.setattr(command, "available_extractors",
                        lambda: ["resnet152-grid", "tencrop-resnet152", "tencrop-vgg19", "vgg16-maps"])
    result = CliRunner().invoke(cli, ["extract-preset", "synthetic", "--manifest", str(tmp_path / "m.jsonl"),
                                      "--image-root", str(tmp_path / "img"), "--out", str(tmp_path / "f"),
                                      "--weights", "random", "--quiet"])
    assert result.exit_code == 0, result.output
    assert [c[0] for c in calls] == ["resnet152-grid", "vgg16-maps", "tencrop-vgg19", "tencrop-resnet152"]
    assert all(c[1:4] == (tmp_path / "m.jsonl", tmp_path / "f", tmp_path / "img") for c in calls)
    # the synthetic preset extracts at the demo's CPU sizes (grid/maps from 224 px, ten 64-px crops)
    device = "cuda" if torch.cuda.is_available() else "cpu"        # --device auto: the GPU where there is one
    assert [c[4] for c in calls] == [{"device": device, "weights": "random", "image_size": size}
                                     for size in (224, 224, 64, 64)]
    assert "butd-regions: not available yet" in result.output and "tencrop-vgg19: done" in result.output


def test_extract_preset_gives_the_image_path_options_to_the_backbones_only(tmp_path, monkeypatch):
    calls = {}

    class Summary:
        def line(self):
            return "done"

    def fake_extract(manifest, name, out, **kwargs):
        calls[name] = kwargs["options"]
        return Summary()

    import retr.pipeline.commands.extract as command
    monkeypatch.setattr(command, "extract_features", fake_extract)
    write_one_image_manifest(tmp_path / "m.jsonl")
    result = CliRunner().invoke(cli, ["extract-preset", "synthetic", "--manifest", str(tmp_path / "m.jsonl"),
                                      "--out", str(tmp_path / "f"), "--weights", "random", "--decode", "cpu",
                                      "--autocast", "bfloat16", "--channels-last", "--tf32",
                                      "--only", "vgg16-maps", "--only", "butd-regions"])
    assert result.exit_code == 0, result.output
    assert {k: calls["vgg16-maps"][k] for k in ("decode", "autocast", "channels_last", "tf32")} == \
        {"decode": "cpu", "autocast": "bfloat16", "channels_last": True, "tf32": True}
    assert not {"decode", "autocast", "channels_last"} & set(calls["butd-regions"])
    assert calls["butd-regions"]["tf32"] is True                   # every extractor takes --tf32
    assert "butd-regions: --autocast, --channels-last, --decode not used by this extractor" in result.output


def test_extract_preset_reports_each_failure_in_flags(tmp_path, monkeypatch):
    from retr.common.errors import ParameterError
    import retr.pipeline.commands.extract as command

    def refuse(manifest, name, out, **kwargs):
        raise ParameterError("half needs device cuda (half-precision convolutions are slow or missing on CPU)",
                             "half", "device")

    monkeypatch.setattr(command, "extract_features", refuse)
    write_one_image_manifest(tmp_path / "m.jsonl")
    monkeypatch.setattr(command, "available_extractors", lambda: ["vgg16-maps", "tencrop-vgg19"])
    result = CliRunner().invoke(cli, ["extract-preset", "synthetic", "--manifest", str(tmp_path / "m.jsonl"),
                                      "--out", str(tmp_path / "f"), "--half", "--only", "vgg16-maps",
                                      "--only", "tencrop-vgg19"])
    assert result.exit_code == 1 and isinstance(result.exception, UserError)
    assert "vgg16-maps: error: --half needs --device cuda (half-precision" in result.output
    assert "tencrop-vgg19: error: --half needs --device cuda" in result.output
    assert str(result.exception) == "2 of 2 extractors failed: vgg16-maps, tencrop-vgg19"


def test_progress_bar_is_off_when_quiet_and_the_summary_is_one_line(dataset, extractor, tmp_path, capsys):
    manifest, good, broken = dataset
    small = tmp_path / "two.jsonl"
    small.write_text("".join(manifest.read_text().splitlines(keepends=True)[:2]))
    summary = extract_features(small, NAME, tmp_path, image_root=manifest.parent, options=OPTIONS,
                               workers=0, quiet=True, build=lambda name, **o: extractor)
    assert capsys.readouterr().err == ""
    assert "\n" not in summary.line() and (summary.rows, summary.errors) == (1, 1)


# ------------------------------------------------------------------------------------------------------------------
# The overlap machinery of the extraction loop, on CPU: the device prefetcher (order, content, device handling,
# no stream on CPU, one item ahead) and the background shard writer (bitwise the synchronous shard, failures
# surfacing in the main thread as the same one-line errors, nothing renamed into place after a failure).

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


# ------------------------------------------------------------------------------------------------------------------
# Two extractions into the same ``--out``: the second stops in one line naming the first (pid, host); the lock
# is the OS's (``fcntl.flock``), so a killed run leaves none behind and the next run goes ahead.


#: A first extraction that blocks inside its first batch (after its shard's .partial file is open) until told to go.
HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import numpy as np, torch
    from retr.extractors.base import Extractor
    from retr.pipeline.extract import extract_features

    manifest, out, started, go = sys.argv[1:5]

    class Blocking(Extractor):
        name, kind = "tencrop-resnet152", "tencrop"

        @property
        def feature_shape(self):
            return (10, 2048)

        def attrs(self):
            return dict(kind="tencrop", extractor="blocking", backbone="none", weights="random", image_size=32)

        def load(self, path):
            return torch.zeros(1)

        def extract(self, batch):
            Path(started).touch()
            while not Path(go).exists():
                time.sleep(0.05)
            return {"features": np.zeros((len(batch), 10, 2048), np.float32)}

    extract_features(manifest, "tencrop-resnet152", out, workers=0, quiet=True, build=lambda name, **o: Blocking())
""")


@pytest.fixture
def holder(tmp_path):
    """Start the blocking first extraction; yields (process, manifest, out, go file) once it is inside a batch."""
    generate_synthetic(tmp_path / "data", num_images=3, seed=0)
    manifest, out = tmp_path / "data" / "manifest.jsonl", tmp_path / "features"
    started, go = tmp_path / "started", tmp_path / "go"
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(manifest), str(out), str(started), str(go)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "the first extraction did not start"
            time.sleep(0.05)
        yield process, manifest, out, go
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()


def test_the_second_extraction_is_refused_in_one_line(holder, run_cli):
    process, manifest, out, go = holder
    assert (out / NAME / (shard_name(0, 1) + ".partial")).exists()
    code, stdout, stderr = run_cli.as_user("pipeline", "extract", "--manifest", manifest, "--extractor", NAME,
                                           "--out", out, "--weights", "random", "--image-size", "32",
                                           "--workers", "0", "--quiet")
    assert code == 1 and stdout == "" and stderr.count("\n") == 1 and "Traceback" not in stderr
    assert stderr.startswith(f"error: another extraction (pid {process.pid} on host {socket.gethostname()}, "
                             f"started ")
    assert stderr.endswith(f") is writing {out / NAME / shard_name(0, 1)}; wait for it to finish (its finished "
                           f"shards are then reused), or give another out folder\n")
    go.touch()
    assert process.wait(timeout=120) == 0
    with h5py.File(out / NAME / shard_name(0, 1), "r") as f:  # the first run's shard, untouched by the second
        assert f.attrs["extractor"] == "blocking" and f["features"].shape[0] == 3


def test_a_killed_extraction_leaves_no_lock_and_the_next_run_goes_ahead(holder, run_cli):
    process, manifest, out, _go = holder
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    assert shard_lock_path(out / NAME, 0, 1).exists()   # the file stays; the lock went with the process
    code, stdout, stderr = run_cli.as_user("pipeline", "extract", "--manifest", manifest, "--extractor", NAME,
                                           "--out", out, "--weights", "random", "--image-size", "32",
                                           "--workers", "0", "--quiet")
    assert code == 0, stderr
    assert "3 images in 1 shard" in stdout and "index written" in stdout
    assert not (out / NAME / (shard_name(0, 1) + ".partial")).exists()


def test_lock_conflicts_inside_one_process_and_an_empty_lock_file(tmp_path):
    folder = tmp_path / NAME
    with contextlib.ExitStack() as first:
        lock_shards(folder, [0, 2], 3, first)
        lock_shards(folder, [1], 3, None)              # another shard: free
        message = rf"another extraction \(pid {os.getpid()} on host .*\) is writing .*shard-00002-of-00003.h5"
        with pytest.raises(UserError, match=message):
            lock_shards(folder, [1, 2], 3, None)       # looking
        with pytest.raises(UserError, match=message), contextlib.ExitStack() as taking:
            lock_shards(folder, [1, 2], 3, taking)     # taking: shard 1's lock goes when the stack closes
    with contextlib.ExitStack() as again:              # released with the first stack
        lock_shards(folder, [0, 1, 2], 3, again)
    assert sorted(p.name for p in folder.iterdir()) == [f".{shard_name(r, 3)}.lock" for r in range(3)]
    # a holder that has the lock but has not written its pid yet
    import fcntl
    path = shard_lock_path(folder, 0, 3)
    path.write_text("")
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        with pytest.raises(UserError, match=r"another extraction \(pid unknown: it has only just started\)"):
            lock_shards(folder, [0], 3, None)
    assert not (tmp_path / "elsewhere").exists()
    lock_shards(tmp_path / "elsewhere", [0], 1, None)  # looking creates nothing
    assert not (tmp_path / "elsewhere").exists()
    assert Path(folder).is_dir()


# ------------------------------------------------------------------------------------------------------------------
# ``autocast`` (bfloat16, float16) and ``channels_last`` against float32, on CPU with random weights.
#
# Measured (torch 2.14.1, CPU, random weights, three synthetic 224-px images; least cosine similarity per feature
# row against float32, and max |difference| over the largest |feature|):
#
# | extractor | bfloat16 autocast | float16 autocast | channels_last |
# | --- | --- | --- | --- |
# | vgg16-maps (224) | 0.99997, 0.98 % | 0.9999994, 0.11 % | 0.9999998, 2.4e-6 |
# | resnet152-grid (224) | 0.99998, 0.52 % | 0.9999996, 0.074 % | 0.9999998, 7.8e-7 |
# | tencrop-resnet152 (64) | 0.99999, 0.44 % | 0.9999996, 0.055 % | 0.9999998, 4.8e-7 |
#
# The test runs one 112-px image through extractors built for 224 px: the networks are convolutional, so the same
# layers run in the same precision on a quarter of the pixels (CPUs without bfloat16 units emulate those
# convolutions: one 224-px image took vgg16-maps 28 s a precision, a 112-px one 3.7 s). Measured so (2026-11-25):
# vgg16-maps 0.99998, 0.80 % (bfloat16), 0.9999996, 0.087 % (float16), 3.5e-6 (channels_last); resnet152-grid
# 0.99998, 0.64 %, 0.9999997, 0.069 %, 6.3e-7 — as at 224 px.
# Asserted: cosine per row > 0.999 and max |difference| ≤ 3 % of the largest |feature| under autocast;
# ≤ 1e-4 of it with channels_last (a reordering of the same float32 sums).

AUTOCAST_MIN_COSINE = 0.999
AUTOCAST_RELATIVE = 0.03
CHANNELS_LAST_RELATIVE = 1e-4


def _inputs(batch: int, size: int, seed: int = 0) -> torch.Tensor:
    """``[B, 3, S, S]``: smooth normalised images (what the preprocessing gives, roughly)."""
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.rand(batch, 3, 8, 8, generator=generator)
    return (torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear") - 0.45) / 0.225


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.reshape(-1, a.shape[-1]).astype(np.float64), b.reshape(-1, b.shape[-1]).astype(np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("name, size", [("vgg16-maps", 224), ("resnet152-grid", 224)])
def test_autocast_and_channels_last_agree_with_float32(name, size):
    images = _inputs(1, size // 2)  # one image: each row is compared alone; half the side (see above)
    reference = build_extractor(name, weights="random", image_size=size).forward_only(images).numpy()
    scale = np.abs(reference).max()
    for autocast in ("bfloat16", "float16"):
        extractor = build_extractor(name, weights="random", image_size=size, autocast=autocast)
        assert extractor.attrs()["autocast"] == autocast
        features = extractor.forward_only(images)
        assert features.dtype == torch.float32
        features = features.numpy()
        assert _cosines(reference, features).min() > AUTOCAST_MIN_COSINE, autocast
        assert np.abs(features - reference).max() <= AUTOCAST_RELATIVE * scale, autocast
        assert not np.array_equal(features, reference), autocast   # autocast did run in the lower precision
    extractor = build_extractor(name, weights="random", image_size=size, channels_last=True)
    weight = next(p for p in extractor.network.parameters() if p.dim() == 4 and p.shape[-1] > 1)
    assert weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous()
    features = extractor.forward_only(images).numpy()
    assert np.abs(features - reference).max() <= CHANNELS_LAST_RELATIVE * scale
    assert extractor.attrs()["channels_last"] is True


def test_tencrop_extract_under_autocast_matches_float32_rows():
    crops = _inputs(10, 32).reshape(1, 10, 3, 32, 32)       # half the side, as above (6.9 s → 1.6 s under bf16)
    reference = build_extractor("tencrop-resnet152", weights="random", image_size=64).extract(crops)["features"]
    features = build_extractor("tencrop-resnet152", weights="random", image_size=64,
                               autocast="bfloat16").extract(crops)["features"]
    assert features.shape == reference.shape == (1, 10, 2048) and features.dtype == np.float32
    assert _cosines(reference, features).min() > AUTOCAST_MIN_COSINE


def test_precision_options_are_checked():
    with pytest.raises(ParameterError, match="autocast must be one of none, bfloat16, float16"):
        build_extractor("vgg16-maps", weights="random", image_size=224, autocast="int8")
    with pytest.raises(ParameterError, match="half needs device cuda"):
        build_extractor("vgg16-maps", weights="random", image_size=224, half=True)
    with pytest.raises(ParameterError, match="exclude each other"):
        build_extractor("vgg16-maps", weights="random", image_size=224, half=True, autocast="bfloat16")
    attrs = build_extractor("vgg16-maps", weights="random", image_size=224).attrs()
    assert (attrs["decode"], attrs["autocast"], attrs["channels_last"], attrs["half_precision"]) == \
        ("cpu", "none", False, False)


def test_cli_passes_only_the_precision_options_given():
    options = _builder_options(None, "cpu", False)
    assert options == {"device": "cpu"}   # butd-regions is never asked for an option it does not take
    options = _builder_options("random", "cpu", False, "device", "bfloat16", True)
    assert options == {"device": "cpu", "weights": "random", "decode": "device", "autocast": "bfloat16",
                       "channels_last": True}


def _one_jpeg_manifest(folder: Path) -> Path:
    (folder / "images").mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(
        folder / "images" / "a.jpg", quality=90)
    (folder / "m.jsonl").write_text(json.dumps({"id": "a", "path": "a.jpg", "split": "test",
                                                "captions": ["x"]}) + "\n")
    return folder / "m.jsonl"


def test_extract_command_records_decode_autocast_and_memory_format(tmp_path, capsys):
    manifest = _one_jpeg_manifest(tmp_path)
    run(cli, ["extract", "--manifest", str(manifest), "--image-root", str(tmp_path / "images"), "--extractor",
              "vgg16-maps", "--out", str(tmp_path / "f"), "--weights", "random", "--image-size", "224",
              "--device", "cpu", "--workers", "0", "--decode", "device", "--autocast", "bfloat16",
              "--channels-last", "--quiet"])
    assert "1 rows" in capsys.readouterr().out
    with h5py.File(tmp_path / "f" / "vgg16-maps.h5", "r") as f:
        attrs = dict(f.attrs)
        assert f["features"].shape == (1, 49, 512)
    assert (attrs["decode"], attrs["autocast"], bool(attrs["channels_last"])) == ("device", "bfloat16", True)


@pytest.mark.parametrize("flags, message", [
    (["--extractor", "vgg16-maps", "--autocast", "float16", "--half", "--device", "cpu"],
     "--half (a float16 network) and --autocast exclude each other"),
    (["--extractor", "butd-regions", "--decode", "device", "--device", "cpu"], "butd-regions does not take --decode"),
    (["--extractor", "vgg16-maps", "--autocast", "int8"], "Invalid value for '--autocast'"),
])
def test_extract_command_refuses_bad_precision_flags_in_one_line(tmp_path, capsys, flags, message):
    manifest = _one_jpeg_manifest(tmp_path)
    with pytest.raises(SystemExit) as exited:
        run(cli, ["extract", "--manifest", str(manifest), "--image-root", str(tmp_path / "images"), "--out",
                  str(tmp_path / "f"), "--weights", "random", "--workers", "0", "--quiet", *flags])
    stderr = capsys.readouterr().err
    assert exited.value.code != 0 and "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], stderr


# ------------------------------------------------------------------------------------------------------------------
# Manifest image paths that leave the image root (absolute, ``..`` above it) are refused by ``manifest check``
# and recorded as errors by extraction — never opened — unless ``--allow-outside-root``.

@pytest.mark.parametrize("path, reason", [
    ("images/a.jpg", None), ("a/../b.jpg", None), ("./a/./b.jpg", None), ("a..b/c.jpg", None),
    ("../secret.jpg", "'..' climbs above the image root"), ("a/../../b.jpg", "'..' climbs above the image root"),
    ("a/..\\..\\b.jpg", "'..' climbs above the image root"),
    ("/etc/passwd", "absolute path"), ("C:\\data\\a.jpg", "absolute path"), ("\\\\server\\share\\a.jpg", "absolute path"),
])
def test_outside_root_reason(path, reason):
    assert outside_root_reason(path) == reason


@pytest.fixture
def layout(tmp_path):
    """A synthetic root with 3 images, one image above it and one elsewhere; a manifest naming all five."""
    generate_synthetic(tmp_path / "root", num_images=3, seed=0)
    records = [json.loads(line) for line in (tmp_path / "root" / "manifest.jsonl").read_text().splitlines()]
    shutil.copy(tmp_path / "root" / records[0]["path"], tmp_path / "secret.png")
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(tmp_path / "root" / records[1]["path"], tmp_path / "elsewhere" / "abs.png")
    records.insert(1, {"id": "climbs", "path": "../secret.png", "split": "train", "captions": ["a secret"]})
    records.append({"id": "absolute", "path": str(tmp_path / "elsewhere" / "abs.png"), "split": "test",
                    "captions": ["an absolute path"]})
    manifest = tmp_path / "root" / "outside.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in records))
    return manifest, [r["id"] for r in records]


def test_manifest_check_refuses_paths_outside_the_root(layout, run_cli, tmp_path):
    manifest, _ids = layout
    root = tmp_path / "root"
    code, out, err = run_cli.as_user("pipeline", "manifest", "check", manifest, "--image-root", root)
    assert code == 1 and "Traceback" not in err and err.count("\n") == 1
    assert err == (f"error: 2 image paths leave the image root: climbs (../secret.png: '..' climbs above the image "
                   f"root), absolute ({tmp_path / 'elsewhere' / 'abs.png'}: absolute path) (--allow-outside-root "
                   f"accepts them)\n")
    code, out, err = run_cli.as_user("pipeline", "manifest", "check", manifest)   # without --image-root too
    assert code == 1 and err.startswith("error: 2 image paths leave the image root")
    code, out, err = run_cli.as_user("pipeline", "manifest", "check", manifest, "--image-root", root,
                                     "--allow-outside-root")
    assert code == 0, err
    assert "note: 2 image paths leave the image root (accepted: --allow-outside-root)" in out
    assert "all 5 image files present" in out


class Recording(Extractor):
    """A network-free extractor that records every path it is asked to open."""

    name, kind = "tencrop-resnet152", "tencrop"

    def __init__(self):
        self.opened: list[str] = []

    @property
    def feature_shape(self):
        return (10, 2048)

    def attrs(self):
        return dict(kind="tencrop", extractor="recording", backbone="none", weights="random", image_size=32)

    def load(self, path):
        self.opened.append(path)
        return torch.zeros(1)

    def extract(self, batch):
        return {"features": np.ones((len(batch), 10, 2048), np.float32)}


def test_extraction_records_outside_paths_as_errors_without_opening_them(layout, tmp_path):
    manifest, ids = layout
    extractor = Recording()
    summary = extract_features(manifest, "tencrop-resnet152", tmp_path / "f", workers=0, quiet=True,
                               build=lambda name, **o: extractor)
    assert (summary.rows, summary.errors) == (3, 2)
    assert all(path.startswith(str(tmp_path / "root")) and ".." not in path for path in extractor.opened)
    assert len(extractor.opened) == 3
    rows, _, errors, attrs = _read(summary.index_path)
    assert rows == [i for i in ids if i not in ("climbs", "absolute")]
    assert errors == {
        "climbs": "path '../secret.png' leaves the image root ('..' climbs above the image root); not read "
                  "(--allow-outside-root reads it)",
        "absolute": f"path '{tmp_path / 'elsewhere' / 'abs.png'}' leaves the image root (absolute path); not read "
                    f"(--allow-outside-root reads it)"}
    assert "images_outside_root" not in attrs

    allowed = Recording()
    summary = extract_features(manifest, "tencrop-resnet152", tmp_path / "g", workers=0, quiet=True,
                               allow_outside_root=True, build=lambda name, **o: allowed)
    assert (summary.rows, summary.errors) == (5, 0) and len(allowed.opened) == 5
    rows, _, errors, attrs = _read(summary.index_path)
    assert rows == ids and attrs["images_outside_root"] == "read"


def test_the_extract_command_takes_the_flag(layout, tmp_path, run_cli):
    manifest, _ids = layout
    base = ["extract", "--manifest", manifest, "--extractor", "tencrop-resnet152", "--weights", "random",
            "--image-size", "32", "--workers", "0", "--quiet"]
    code, out, err = run_cli.as_user("pipeline", *base, "--out", tmp_path / "f")
    assert code == 0, err
    assert "3 rows, 2 unreadable images (listed in errors)" in out
    code, out, err = run_cli.as_user("pipeline", *base, "--out", tmp_path / "g", "--allow-outside-root")
    assert code == 0, err
    assert "5 rows, 0 unreadable images" in out


# ------------------------------------------------------------------------------------------------------------------
# End to end: ``retr-pipeline extract --extractor butd-regions --weights random`` on the synthetic dataset.

# the speed options keep this test fast; the same settings as test_butd_model, so the random weights are reused
FAST_ARGS = ["--short-side", "96", "--max-side", "128", "--pre-nms-topk", "600", "--post-nms-topk", "40",
             "--pooled-size", "7"]


@pytest.mark.slow
def test_extract_command_writes_a_sound_regions_set_and_records_bad_images(tmp_path, run_cli):
    from retr.manifests.synthetic import generate_synthetic

    data = tmp_path / "synthetic"
    generate_synthetic(data, num_images=4, seed=0)
    broken = sorted((data / "images").glob("*.jpg"))[1]
    broken.write_bytes(b"not a jpeg at all")
    args = ["extract", "--manifest", str(data / "manifest.jsonl"), "--extractor", "butd-regions",
            "--weights", "random", "--out", str(tmp_path / "features"), "--workers", "0", "--quiet", *FAST_ARGS]
    run_cli("pipeline", *args)
    path = tmp_path / "features" / "butd-regions.h5"
    assert verify_feature_set(path) == []
    fs = FeatureSet(path)
    assert len(fs) == 3 and fs.feature_shape == (36, 2048) and fs.dtype == np.float16
    assert [e[0] for e in fs.errors] == [broken.stem] and "decode" in fs.errors[0][1]
    features = fs.read_all().astype(np.float32)
    assert np.isfinite(features).all() and features.std() > 0
    assert (fs.read_all("num_boxes") == 36).all()
    boxes = fs.read_all("boxes")
    assert boxes.min() >= 0 and boxes[..., 2:].max() <= 223
    assert fs.attrs["kind"] == "regions" and fs.attrs["weights"] == "random"
    assert fs.attrs["short_side"] == 96 and fs.attrs["detector_settings"]["pooled_size"] == 7
    # a second run resumes: the complete shard is kept as is
    before = path.with_suffix("").joinpath("shard-00000-of-00001.h5").stat().st_mtime_ns
    run_cli("pipeline", *args)
    assert path.with_suffix("").joinpath("shard-00000-of-00001.h5").stat().st_mtime_ns == before
