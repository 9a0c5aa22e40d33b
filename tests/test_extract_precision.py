"""``autocast`` (bfloat16, float16) and ``channels_last`` against float32, on CPU with random weights.

Measured (torch 2.14.1, CPU, random weights, three synthetic 224-px images; least cosine similarity per feature
row against float32, and max |difference| over the largest |feature|):

| extractor | bfloat16 autocast | float16 autocast | channels_last |
| --- | --- | --- | --- |
| vgg16-maps (224) | 0.99997, 0.98 % | 0.9999994, 0.11 % | 0.9999998, 2.4e-6 |
| resnet152-grid (224) | 0.99998, 0.52 % | 0.9999996, 0.074 % | 0.9999998, 7.8e-7 |
| tencrop-resnet152 (64) | 0.99999, 0.44 % | 0.9999996, 0.055 % | 0.9999998, 4.8e-7 |

Asserted: cosine per row > 0.999 and max |difference| ≤ 3 % of the largest |feature| under autocast;
≤ 1e-4 of it with channels_last (a reordering of the same float32 sums).
"""
from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from PIL import Image

from retr.common.cli import run
from retr.common.errors import ParameterError
from retr.extractors.base import build_extractor
from retr.pipeline.commands import cli
from retr.pipeline.commands.extract import _builder_options

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
    images = _inputs(2, size)
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
    crops = _inputs(10, 64).reshape(1, 10, 3, 64, 64)
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
