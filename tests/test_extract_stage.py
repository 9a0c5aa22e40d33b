"""The extraction stage end to end: rows, errors, shards, resume, torchrun, the commands and their errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torchvision
from click.testing import CliRunner

from retr.common.cli import run
from retr.common.errors import UserError
from retr.extractors.base import available_extractors, build_extractor
from retr.manifests.schema import manifest_sha256
from retr.manifests.synthetic import generate_synthetic
from retr.pipeline.commands import cli
from retr.pipeline.extract import DistributedEnv, extract_features, plan_shards, shard_ranges
from retr.store.features import ROOT_ATTRS, decode_str, shard_name
from retr.pipeline.verify import verify_feature_set

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
                            (["--weights", "random", "--half"], "error: --half needs --device cuda (half-precision"),
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
    assert [c[4] for c in calls] == [{"device": "cpu", "weights": "random", "image_size": size}
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
                                      "--autocast", "bfloat16", "--channels-last",
                                      "--only", "vgg16-maps", "--only", "butd-regions"])
    assert result.exit_code == 0, result.output
    assert {k: calls["vgg16-maps"][k] for k in ("decode", "autocast", "channels_last")} == \
        {"decode": "cpu", "autocast": "bfloat16", "channels_last": True}
    assert not {"decode", "autocast", "channels_last"} & set(calls["butd-regions"])
    assert "butd-regions: --autocast, --channels-last, --decode not used (backbone extractors only)" \
        in result.output


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
