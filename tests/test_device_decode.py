"""``--decode device`` (batched ``decode_jpeg`` + tensor resize/normalise) against the Pillow path, on CPU.

The device path runs here with ``device="cpu"``: the same ``decode_jpeg`` call (libjpeg-turbo instead of nvJPEG)
and the same ``torchvision.transforms.v2.functional`` ops that run on CUDA.

Measured on this project's synthetic JPEGs (torch 2.14.1 / torchvision 0.29.1, CPU), stated as the tolerances
asserted below:

* decoding: ``decode_jpeg`` on CPU and Pillow give identical pixels (both are libjpeg-turbo); nvJPEG on CUDA may
  differ by a few 8-bit levels (other IDCT and chroma upsampling) — not measured here;
* normalised input: max |difference| 0.0175 = one 8-bit level divided by the smallest ImageNet std
  (1/255/0.225): the antialiased bilinear resizes of Pillow and torchvision round some pixels the other way —
  0.01 % to 23 % of the values (most where one side is enlarged and the other reduced, e.g. 257×511 → 448×448).
  Asserted: ≤ 1.01/255/min(std), on fewer than 30 % of the values;
* features (random weights, 224-px inputs): vgg16-maps max |difference| 0.0042 at a feature scale of 0.90
  (0.47 %), least cosine per row 0.99994; resnet152-grid 0.63 %, 0.9993; tencrop-resnet152 (64-px crops)
  0.03 %, 0.9999998. Asserted: max |difference| ≤ 2 % of the largest |feature|, cosine per row > 0.999.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

from retr.common.errors import ParameterError, UserError
from retr.extractors.base import ImageError, build_extractor
from retr.extractors.device_decode import (EncodedBatch, EncodedJpeg, EncodedReader, collate_encoded, decode_batch,
                                           decode_jpegs, device_decodable, resolve_decode)
from retr.extractors.images import IMAGENET_STD, SquareResize, TenCrop
from retr.pipeline.extract import extract_features, extract_paths

INPUT_TOLERANCE = 1.01 / 255 / min(IMAGENET_STD)
FEATURE_RELATIVE_TOLERANCE = 0.02
FEATURE_MIN_COSINE = 0.999


def _picture(width: int, height: int, seed: int) -> np.ndarray:
    """``[H, W, 3]`` uint8: gradients, a pattern and noise (JPEG artefacts on every kind of content)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    image = np.stack([xx * 255 / width, yy * 255 / height, ((xx + yy) % 64) * 4], -1)
    return (image + rng.normal(0, 20, (height, width, 3))).clip(0, 255).astype(np.uint8)


def _save(path: Path, image: Image.Image, **kwargs) -> str:
    image.save(path, **kwargs)
    return str(path)


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory) -> dict[str, str]:
    """RGB (4:2:0 and 4:4:4), grayscale, odd sizes."""
    folder = tmp_path_factory.mktemp("jpegs")
    return {
        "rgb": _save(folder / "rgb.jpg", Image.fromarray(_picture(300, 200, 0)), quality=85),
        "rgb444": _save(folder / "rgb444.jpg", Image.fromarray(_picture(123, 97, 1)), quality=95, subsampling=0),
        "gray": _save(folder / "gray.jpg", Image.fromarray(_picture(180, 261, 2)).convert("L"), quality=80),
        "tall": _save(folder / "tall.jpg", Image.fromarray(_picture(257, 511, 3)), quality=60),
    }


def _bytes(path: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.reshape(-1, a.shape[-1]).astype(np.float64), b.reshape(-1, b.shape[-1]).astype(np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


# -- decoding and the tensor ops --------------------------------------------------------------------------------
def test_decode_jpeg_on_cpu_gives_pillows_pixels_grayscale_expanded_to_rgb(jpegs):
    for name, path in jpegs.items():
        decoded = decode_jpeg(_bytes(path), mode=ImageReadMode.RGB)
        pillow = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)
        assert decoded.shape == pillow.shape and decoded.dtype == torch.uint8, name
        assert torch.equal(decoded, pillow), name
    gray = decode_jpeg(_bytes(jpegs["gray"]), mode=ImageReadMode.RGB)
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2])


@pytest.mark.parametrize("preprocess", [SquareResize(448), SquareResize(224), TenCrop(224, 256),
                                        TenCrop(64, 73, (0.5,) * 3, (0.5,) * 3)],
                         ids=["square448", "square224", "tencrop224", "tencrop64-inception"])
def test_tensor_preprocessing_equals_pillow_within_one_level(jpegs, preprocess):
    tolerance = 1.01 / 255 / min(preprocess.std)
    for name, path in jpegs.items():
        reference = preprocess(path)
        tensor = preprocess.from_decoded(decode_jpeg(_bytes(path), mode=ImageReadMode.RGB))
        assert tensor.shape == reference.shape and tensor.dtype == torch.float32, name
        difference = (tensor - reference).abs()
        assert difference.max().item() <= tolerance, name
        assert (difference > 1e-6).float().mean().item() < 0.3, name   # rounding flips (measured ≤ 23 %)


def test_tensor_preprocessing_runs_on_the_images_device_batch_of_different_sizes(jpegs):
    datas = [_bytes(p) for p in jpegs.values()]
    decoded = decode_jpegs(datas, torch.device("cpu"))
    assert [tuple(d.shape[1:]) for d in decoded] == [(200, 300), (97, 123), (261, 180), (511, 257)]
    assert all(torch.equal(a, decode_jpeg(b, mode=ImageReadMode.RGB)) for a, b in zip(decoded, datas))


# -- which files go to the device -------------------------------------------------------------------------------
def test_reader_sends_rgb_and_gray_jpegs_as_bytes_and_the_rest_to_pillow(jpegs, tmp_path):
    square = SquareResize(64)
    reader = EncodedReader(square)
    for path in jpegs.values():
        sample = reader(path)
        assert isinstance(sample, EncodedJpeg) and sample.path == path
        assert torch.equal(sample.data, _bytes(path))
    png = _save(tmp_path / "a.png", Image.fromarray(_picture(50, 40, 4)))
    cmyk = _save(tmp_path / "cmyk.jpg", Image.fromarray(_picture(50, 40, 5)).convert("CMYK"), quality=90)
    for path in (png, cmyk):
        sample = reader(path)
        assert isinstance(sample, torch.Tensor) and torch.equal(sample, square(path))  # Pillow's colour rules
    assert Image.open(cmyk).mode == "CMYK"


def test_reader_refuses_what_pillow_refuses_with_the_same_reason(jpegs, tmp_path):
    square = SquareResize(64)
    reader = EncodedReader(square)
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(Path(jpegs["rgb"]).read_bytes()[:2000])
    strip = _save(tmp_path / "strip.jpg", Image.fromarray(_picture(500, 3, 6)), quality=90)
    for path in (str(truncated), strip, str(tmp_path / "missing.jpg"), str(tmp_path)):
        with pytest.raises(ImageError) as pillow:
            square(path)
        with pytest.raises(ImageError) as device:
            reader(path)
        assert str(device.value) == str(pillow.value) and "\n" not in str(device.value)


def test_exif_rotated_jpeg_goes_to_pillow_only_when_orientation_is_applied(tmp_path):
    image = Image.fromarray(_picture(60, 40, 7))
    exif = image.getexif()
    exif[0x0112] = 6
    path = _save(tmp_path / "rotated.jpg", image, quality=90, exif=exif)
    assert isinstance(EncodedReader(SquareResize(64), False)(path), EncodedJpeg)
    rotated = SquareResize(64, exif_orientation=True)
    sample = EncodedReader(rotated, True)(path)
    assert isinstance(sample, torch.Tensor) and torch.equal(sample, rotated(path))


def test_device_decodable_needs_the_end_marker():
    buffer = io.BytesIO()
    Image.fromarray(_picture(32, 32, 8)).save(buffer, "JPEG")
    data = buffer.getvalue()
    assert device_decodable(data, False)
    assert not device_decodable(data[:-2], False)
    assert not device_decodable(b"\x89PNG" + data[4:], False)


# -- the main-process batch --------------------------------------------------------------------------------------
def _corrupt_huffman(path: Path) -> str:
    """A JPEG whose header Pillow reads and which ends with the end marker, but whose Huffman table is broken:
    ``decode_jpeg`` raises, and Pillow says 'broken data stream'."""
    buffer = io.BytesIO()
    Image.fromarray(_picture(80, 64, 9)).save(buffer, "JPEG")
    data = bytearray(buffer.getvalue())
    table = data.index(b"\xff\xc4")
    data[table + 4:table + 20] = b"\xff" * 16
    path.write_bytes(bytes(data))
    return str(path)


def test_decoder_rejections_are_decoded_again_by_pillow(jpegs, tmp_path):
    square = SquareResize(64)
    corrupt = _corrupt_huffman(tmp_path / "corrupt.jpg")
    reader = EncodedReader(square)
    items = [reader(jpegs["rgb"]), reader(corrupt), reader(jpegs["gray"])]
    assert all(isinstance(item, EncodedJpeg) for item in items)  # the header passes: the decoder finds out
    with pytest.raises(ImageError) as pillow:
        square(corrupt)
    inputs, failures = decode_batch(collate_encoded(items), torch.device("cpu"), square.from_decoded, square)
    assert failures == [(1, str(pillow.value))] and "broken data stream" in failures[0][1]
    assert inputs.shape == (2, 3, 64, 64)
    assert torch.equal(inputs[0], square.from_decoded(decode_jpeg(_bytes(jpegs["rgb"]), mode=ImageReadMode.RGB)))

    # a decoder that rejects a good file (as nvJPEG may): Pillow's result stands in for it
    def picky(datas, device):
        return [None if torch.equal(d, _bytes(jpegs["gray"])) else decode_jpeg(d, mode=ImageReadMode.RGB)
                for d in datas]
    inputs, failures = decode_batch(EncodedBatch([items[0], items[2]]), torch.device("cpu"), square.from_decoded,
                                    square, decoder=picky)
    assert failures == [] and torch.equal(inputs[1], square(jpegs["gray"]))


def test_decode_batch_keeps_batch_order_with_pillow_samples_mixed_in(jpegs, tmp_path):
    square = SquareResize(32)
    png = _save(tmp_path / "b.png", Image.fromarray(_picture(40, 50, 10)))
    reader = EncodedReader(square)
    batch = collate_encoded([reader(png), reader(jpegs["rgb"]), reader(png)])
    inputs, failures = decode_batch(batch, torch.device("cpu"), square.from_decoded, square)
    assert failures == [] and inputs.shape == (3, 3, 32, 32)
    assert torch.equal(inputs[0], square(png)) and torch.equal(inputs[2], square(png))
    assert (inputs[1] - square(jpegs["rgb"])).abs().max() <= INPUT_TOLERANCE
    assert decode_batch(EncodedBatch([]), torch.device("cpu"), square.from_decoded, square) == (None, [])


def test_auto_decode_is_device_on_cuda_only():
    assert resolve_decode("auto", torch.device("cpu")) == "cpu"
    assert resolve_decode("auto", torch.device("cuda", 0)) == "device"
    assert resolve_decode("device", torch.device("cpu")) == "device"
    with pytest.raises(ParameterError, match="decode must be one of auto, cpu, device"):
        resolve_decode("gpu", torch.device("cpu"))


# -- features through the real extractors -----------------------------------------------------------------------
@pytest.mark.parametrize("name, options", [("vgg16-maps", {"image_size": 224}),
                                           ("tencrop-resnet152", {"image_size": 64})])
def test_device_decoded_features_equal_pillow_features_within_tolerance(jpegs, name, options):
    paths = [jpegs["rgb"], jpegs["gray"], jpegs["tall"]]
    extractor = build_extractor(name, weights="random", decode="cpu", **options)
    reference, failures = extract_paths(extractor, paths, batch_size=2, workers=0)
    assert failures == []
    extractor = build_extractor(name, weights="random", decode="device", **options)
    assert extractor.attrs()["decode"] == "device"
    assert isinstance(extractor.preprocessor()(paths[0]), EncodedJpeg)
    device, failures = extract_paths(extractor, paths, batch_size=2, workers=0)
    assert failures == [] and device["features"].shape == reference["features"].shape
    ref, dev = reference["features"], device["features"]
    assert np.abs(dev - ref).max() <= FEATURE_RELATIVE_TOLERANCE * np.abs(ref).max()
    assert _cosines(ref, dev).min() > FEATURE_MIN_COSINE


def _manifest(folder: Path, files: dict[str, str]) -> Path:
    manifest = folder / "manifest.jsonl"
    manifest.write_text("".join(json.dumps({"id": key, "path": path, "split": "test", "captions": ["a"]}) + "\n"
                                for key, path in files.items()))
    return manifest


def test_stage_with_device_decoding_records_the_same_errors_and_the_decode_path(jpegs, tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    for key, path in jpegs.items():
        (images / f"{key}.jpg").write_bytes(Path(path).read_bytes())
    (images / "truncated.jpg").write_bytes(Path(jpegs["rgb"]).read_bytes()[:1500])
    _corrupt_huffman(images / "corrupt.jpg")
    _save(images / "c.png", Image.fromarray(_picture(70, 50, 11)))
    files = {"rgb": "rgb.jpg", "truncated": "truncated.jpg", "gray": "gray.jpg", "corrupt": "corrupt.jpg",
             "png": "c.png", "tall": "tall.jpg"}
    manifest = _manifest(tmp_path, files)
    results = {}
    for decode in ("cpu", "device"):
        out = tmp_path / decode
        options = {"weights": "random", "decode": decode, "image_size": 224}
        extract_features(manifest, "vgg16-maps", out, image_root=images, options=options, batch_size=4,
                         workers=1, quiet=True)
        with h5py.File(out / "vgg16-maps.h5", "r") as f:
            results[decode] = ([v.decode() for v in f["ids"][:]], f["features"][:].astype(np.float32),
                               {a.decode(): b.decode() for a, b in f["errors"][:]}, f.attrs["decode"])
    (cpu_ids, cpu_features, cpu_errors, cpu_attr), (dev_ids, dev_features, dev_errors, dev_attr) = results.values()
    assert cpu_attr == "cpu" and dev_attr == "device"
    assert dev_ids == cpu_ids == ["rgb", "gray", "png", "tall"]
    assert dev_errors == cpu_errors and set(dev_errors) == {"truncated", "corrupt"}
    assert np.abs(dev_features - cpu_features).max() <= FEATURE_RELATIVE_TOLERANCE * np.abs(cpu_features).max()
    assert np.array_equal(dev_features[2], cpu_features[2])   # the PNG took the Pillow path in both

    # a resumed shard never mixes the decode paths
    shard = next((tmp_path / "device" / "vgg16-maps").glob("shard-*.h5"))
    with pytest.raises(UserError, match="decode = 'device', this run has 'cpu'"):
        extract_features(manifest, "vgg16-maps", tmp_path / "device", image_root=images,
                         options={"weights": "random", "decode": "cpu", "image_size": 224}, workers=0, quiet=True)
    assert shard.exists()


def test_shard_written_before_the_decode_attributes_counts_as_pillow_float32(tmp_path):
    from retr.pipeline.extract import check_existing_shard
    from retr.store.features import ShardWriter

    old = {"kind": "maps", "extractor": "vgg16-maps", "backbone": "vgg16", "weights": "random", "image_size": 224,
           "manifest_sha256": "0" * 64}
    path = tmp_path / "shard-00000-of-00001.h5"
    with ShardWriter(path, old, (49, 512), shard_index=0, num_shards=1) as writer:
        writer.append(["a"], np.zeros((1, 49, 512), np.float32))
    now = {**old, "decode": "cpu", "autocast": "none", "channels_last": False}
    check_existing_shard(path, now, "float16", ["a"])   # what it was made with: reused
    for key, value in (("decode", "device"), ("autocast", "bfloat16"), ("channels_last", True)):
        with pytest.raises(UserError, match=f"made with {key} = "):
            check_existing_shard(path, {**now, key: value}, "float16", ["a"])
