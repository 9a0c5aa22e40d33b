"""Extractors (extractors/): image decoding and colour modes, preprocessing, weights, and each network checked
against the library that defines it (torchvision, timm) run directly on the same preprocessed tensor.
"""
from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
import torchvision
from PIL import Image
from safetensors.torch import save_file

from retr.common.errors import MissingResourceError, ParameterError, UserError
from retr.extractors.backbone import resolve_device
from retr.extractors.base import ImageError, available_extractors, build_extractor
from retr.extractors.images import IMAGENET_MEAN, IMAGENET_STD, SquareResize, TenCrop, decode_image, to_rgb
from retr.extractors.tencrop import MIN_CROP_IRV2
from retr.extractors.weights import hub_checkpoint_path, read_state_dict


def _scene(size=(96, 64), seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


@pytest.fixture
def jpeg(tmp_path) -> Path:
    path = tmp_path / "scene.jpg"
    _scene().save(path, quality=95)
    return path


# ---------------------------------------------------------------------------------------------- decoding
def test_every_mode_becomes_rgb(tmp_path):
    cases = {}
    gray = Image.new("L", (8, 6), 77)
    cases["gray.png"] = (gray, (77, 77, 77))
    cases["cmyk.jpg"] = (Image.new("CMYK", (8, 6), (0, 0, 0, 0)), (255, 255, 255))
    palette = Image.new("P", (8, 6), 3)
    palette.putpalette([0, 0, 0] * 3 + [10, 200, 30] + [0, 0, 0] * 252)
    cases["palette.png"] = (palette, (10, 200, 30))
    cases["transparent.png"] = (Image.new("RGBA", (8, 6), (0, 0, 0, 0)), (255, 255, 255))  # over white
    cases["opaque.png"] = (Image.new("RGBA", (8, 6), (200, 10, 10, 255)), (200, 10, 10))
    cases["la.png"] = (Image.new("LA", (8, 6), (0, 0)), (255, 255, 255))
    cases["bilevel.png"] = (Image.new("1", (8, 6), 1), (255, 255, 255))
    sixteen = Image.fromarray(np.full((6, 8), 32896, dtype=np.uint16))  # 32896 / 65535 · 255 = 128
    cases["sixteen.png"] = (sixteen, (128, 128, 128))
    for name, (image, colour) in cases.items():
        image.save(tmp_path / name)
        rgb = decode_image(tmp_path / name)
        assert rgb.mode == "RGB" and rgb.size == (8, 6), name
        assert rgb.getpixel((3, 3)) == pytest.approx(colour, abs=2), name


def test_palette_transparency_and_float_modes():
    palette = Image.new("P", (4, 4), 1)
    palette.putpalette([0, 0, 0, 9, 9, 9] + [0] * 762)
    palette.info["transparency"] = 1
    assert to_rgb(palette).getpixel((0, 0)) == (255, 255, 255)
    assert to_rgb(Image.fromarray(np.full((4, 4), 0.5, dtype=np.float32), "F")).getpixel((0, 0)) == (128, 128, 128)
    assert to_rgb(Image.fromarray(np.full((4, 4), 200, dtype=np.int32), "I")).getpixel((0, 0)) == (200, 200, 200)


def test_exif_orientation_is_optional(tmp_path):
    image = _scene((40, 20))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    path = tmp_path / "rotated.jpg"
    image.save(path, exif=exif.tobytes())
    assert decode_image(path).size == (40, 20)
    assert decode_image(path, exif_orientation=True).size == (20, 40)


@pytest.mark.parametrize("make, reason", [
    (lambda p: None, "file not found"),
    (lambda p: p.write_bytes(b""), "empty file"),
    (lambda p: p.write_text("these are not pixels\n" * 10), "not an image"),
    (lambda p: p.mkdir(), "directory"),
])
def test_unusable_files_raise_image_error(tmp_path, make, reason):
    path = tmp_path / "broken.jpg"
    make(path)
    with pytest.raises(ImageError, match=reason):
        decode_image(path)


def test_truncated_jpeg_raises_image_error(tmp_path):
    buffer = io.BytesIO()
    _scene((200, 150)).save(buffer, "JPEG", quality=95)
    path = tmp_path / "truncated.jpg"
    path.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    with pytest.raises(ImageError, match="cannot decode image: image file is truncated"):
        decode_image(path)


def test_decompression_bomb_and_extreme_aspect(tmp_path, monkeypatch):
    path = tmp_path / "big.png"
    Image.new("RGB", (300, 300)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100 * 100 // 2)  # 300² > 2 × limit → Pillow refuses
    with pytest.raises(ImageError, match="too many pixels"):
        decode_image(path)
    monkeypatch.undo()
    strip = tmp_path / "strip.png"
    Image.new("RGB", (505, 5)).save(strip)
    with pytest.raises(ImageError, match="aspect ratio 101:1"):
        TenCrop()(str(strip))


def test_square_resize_normalises_with_imagenet_statistics(tmp_path):
    path = tmp_path / "flat.png"
    Image.new("RGB", (30, 50), (255, 128, 0)).save(path)
    x = SquareResize(64)(str(path))
    assert x.shape == (3, 64, 64) and x.dtype == torch.float32
    expected = [(255 / 255 - IMAGENET_MEAN[0]) / IMAGENET_STD[0], (128 / 255 - IMAGENET_MEAN[1]) / IMAGENET_STD[1],
                (0 - IMAGENET_MEAN[2]) / IMAGENET_STD[2]]
    np.testing.assert_allclose(x.mean(dim=(1, 2)).numpy(), expected, atol=1e-5)
    tiny = tmp_path / "one-pixel.png"
    Image.new("RGB", (1, 1), (9, 9, 9)).save(tiny)
    assert SquareResize(64)(str(tiny)).shape == (3, 64, 64)
    assert TenCrop(32, 37)(str(tiny)).shape == (10, 3, 32, 32)


def test_ten_crops_are_corners_centre_and_their_mirrors(tmp_path):
    # A 74×37 image resized to short side 37 stays 74×37: crops can be located exactly.
    path = tmp_path / "wide.png"
    _scene((74, 37), seed=3).save(path)
    crops = TenCrop(crop=32, resize=37)(str(path))
    whole = torchvision.transforms.functional.normalize(
        torchvision.transforms.functional.to_tensor(Image.open(path).convert("RGB")), IMAGENET_MEAN, IMAGENET_STD)
    expected = [whole[:, :32, :32], whole[:, :32, -32:], whole[:, -32:, :32], whole[:, -32:, -32:],
                whole[:, 2:34, 21:53]]
    for k, region in enumerate(expected):
        torch.testing.assert_close(crops[k], region)
        torch.testing.assert_close(crops[k + 5], torch.flip(expected[[1, 0, 3, 2, 4][k]], dims=[2]))


# ----------------------------------------------------------------------------------------------- registry
def test_registry_names_and_option_check():
    assert {"resnet152-grid", "vgg16-maps", "tencrop-vgg19", "tencrop-resnet152"} <= set(available_extractors())
    with pytest.raises(ValueError, match="does not take grid_size$"):
        build_extractor("vgg16-maps", weights="random", grid_size=7)
    with pytest.raises(ValueError, match="unknown extractor 'resnet9-grid'"):
        build_extractor("resnet9-grid")
    with pytest.raises(ValueError, match=r"does not pool to 7×7 \(grid_size 7\); use image_size 224"):
        build_extractor("resnet152-grid", weights="random", image_size=320)
    with pytest.raises(ValueError, match="^image_size for vgg16-maps must be one of"):
        build_extractor("vgg16-maps", weights="random", image_size=300)


@pytest.mark.parametrize("name, options, parameters, message", [
    ("resnet152-grid", {"image_size": 100}, ("image_size",), "image_size must be a multiple of 32"),
    ("resnet152-grid", {"grid_size": 5}, ("grid_size",), "grid_size must be one of (7, 14), not 5"),
    ("tencrop-vgg19", {"image_size": 16}, ("image_size",), "image_size (the crop side) must be at least 32"),
    ("vgg16-maps", {"image_size": 300}, ("image_size",), "image_size for vgg16-maps must be one of"),
    ("vgg16-maps", {"grid_size": 7, "exif": True}, ("exif", "grid_size"), "does not take exif, grid_size"),
    ("resnet152-grid", {"weights": "IMAGENET1K_V9"}, ("weights",), "weights 'IMAGENET1K_V9' is not a torchvision"),
    ("resnet152-grid", {"half": True}, ("half", "device"), "half needs device cuda"),
])
def test_bad_argument_values_are_value_errors_naming_the_parameter(name, options, parameters, message):
    """Library calls name the Python parameter (never a command-line flag); the command maps it to its flag."""
    with pytest.raises(ParameterError) as caught:
        build_extractor(name, **{"weights": "random", **options})
    error = caught.value
    assert isinstance(error, ValueError) and not isinstance(error, UserError)
    assert error.parameters == parameters and error.parameter == parameters[0]
    assert message in str(error)
    assert "--" not in str(error)


def test_device_checks():
    assert resolve_device("cpu", False) == torch.device("cpu")
    with pytest.raises(ValueError, match="^half needs device cuda"):
        resolve_device("cpu", True)
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("gpu0", False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda", False)


# ------------------------------------------------------------------------------ networks vs torchvision
def _torchvision_model(arch: str, extractor) -> torch.nn.Module:
    """A fresh torchvision model holding the extractor's weights (only the never-run head is left out)."""
    with torch.device("meta"):  # no random init: every tensor that runs is assigned below
        model = torchvision.models.get_model(arch, weights=None).eval()
    missing, unexpected = model.load_state_dict(extractor.network.state_dict(), strict=False, assign=True)
    assert not unexpected and all(k.startswith(("fc.", "classifier.")) for k in missing)
    return model


def _resnet_res5c(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = m.maxpool(m.relu(m.bn1(m.conv1(x))))
    return m.layer4(m.layer3(m.layer2(m.layer1(x))))


@pytest.mark.slow
def test_resnet152_grid_matches_torchvision(jpeg):
    pooled = build_extractor("resnet152-grid", weights="random")
    raw = build_extractor("resnet152-grid", weights="random", grid_size=14)
    assert pooled.feature_shape == (49, 2048) and raw.feature_shape == (196, 2048)
    x = pooled.load(str(jpeg))
    assert x.shape == (3, 448, 448)
    batch = raw.collate([x])
    out_raw = raw.extract(batch)["features"]  # the network at 448 runs once here and once for the reference
    assert out_raw.shape == (1, 196, 2048) and out_raw.dtype == np.float32
    with torch.no_grad():
        res5c = _resnet_res5c(_torchvision_model("resnet152", raw), batch)  # [1, 2048, 14, 14]
    expected_raw = res5c.permute(0, 2, 3, 1).reshape(1, 196, 2048)  # raster order: row-major cells
    np.testing.assert_allclose(out_raw, expected_raw.numpy(), rtol=1e-4, atol=1e-5)
    # Same seed, same weights: the default extractor is the raw map average-pooled 2×2.
    torch.testing.assert_close(pooled.network.state_dict(), raw.network.state_dict())
    out_pooled = pooled.to_features(res5c, 1).numpy()
    expected_pooled = F.avg_pool2d(res5c, 2).permute(0, 2, 3, 1).reshape(1, 49, 2048)
    np.testing.assert_allclose(out_pooled, expected_pooled.numpy(), rtol=1e-6, atol=1e-7)
    assert out_pooled[0, 8].tolist() == pytest.approx(res5c[0, :, 2:4, 2:4].mean(dim=(1, 2)).tolist(), rel=1e-5)
    assert np.isfinite(out_pooled).all() and 1e-3 < np.abs(out_pooled).max() < 100  # fits float16 usefully
    attrs = pooled.attrs()
    assert attrs["kind"] == "grid" and attrs["backbone"] == "resnet152" and attrs["weights"] == "random"
    assert (attrs["image_size"], attrs["grid_size"], attrs["grid_pool"]) == (448, 7, 2)
    assert attrs["weights_seed"] == 0 and attrs["exif_orientation"] is False


def _precisions() -> tuple:
    """The convolution and matrix-product precisions in force (per-backend on torch >= 2.9, else the flags)."""
    b = torch.backends
    if hasattr(b.cudnn, "conv"):
        return b.cudnn.conv.fp32_precision, b.cuda.matmul.fp32_precision
    return b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32


@pytest.mark.parametrize("name", ["resnet152-grid", "vgg16-maps", "tencrop-vgg19", "tencrop-resnet152"])
def test_backbones_run_exact_float32_unless_tf32_is_asked_for(name, jpeg):
    """PyTorch lets cuDNN's convolutions use TF32 by default, so CUDA's features would differ from the CPU's by
    ~1e-3: every backbone runs its network with TF32 off unless ``tf32`` (seen through the settings in force at its
    first convolution; a CPU ignores them, CUDA follows them), and records ``tf32`` as what ran (CUDA only)."""
    exact = ("ieee", "ieee") if hasattr(torch.backends.cudnn, "conv") else (False, False)
    outside = _precisions()
    seen = {}
    for tf32 in (False, True):
        extractor = build_extractor(name, weights="random", image_size=64 if "tencrop" in name else 224, tf32=tf32)
        first_conv = next(m for m in extractor.network.modules() if isinstance(m, torch.nn.Conv2d))
        hook = first_conv.register_forward_pre_hook(lambda *_, tf32=tf32: seen.setdefault(tf32, _precisions()) and None)
        try:
            extractor.extract(extractor.collate([extractor.load(str(jpeg))]))
        finally:
            hook.remove()
        assert extractor.tf32 is tf32 and extractor.attrs()["tf32"] is False      # no TF32 on a CPU
    assert seen == {False: exact, True: outside} and outside != exact
    assert _precisions() == outside


@pytest.mark.slow
def test_vgg16_maps_matches_torchvision(jpeg):
    extractor = build_extractor("vgg16-maps", weights="random", image_size=224)
    assert extractor.feature_shape == (49, 512)
    batch = extractor.collate([extractor.load(str(jpeg))])
    features = extractor.extract(batch)["features"]
    with torch.no_grad():
        pool5 = _torchvision_model("vgg16", extractor).features(batch)  # all 31 modules, ending with pool5
    np.testing.assert_allclose(features, pool5.permute(0, 2, 3, 1).reshape(1, 49, 512).numpy(), rtol=1e-4, atol=1e-5)
    attrs = extractor.attrs()
    assert (attrs["kind"], attrs["backbone"], attrs["layer"], attrs["image_size"]) == ("maps", "vgg16", "features.30", 224)


@pytest.mark.slow
def test_tencrop_vgg19_is_fc7_after_relu(jpeg):
    extractor = build_extractor("tencrop-vgg19", weights="random", image_size=64)
    sample = extractor.load(str(jpeg))
    assert sample.shape == (10, 3, 64, 64)
    batch = extractor.collate([sample, sample])
    features = extractor.extract(batch)["features"]
    assert features.shape == (2, 10, 4096)
    model = _torchvision_model("vgg19", extractor)
    with torch.no_grad():
        h = torch.flatten(model.avgpool(model.features(batch.flatten(0, 1))), 1)
        fc7 = torch.relu(model.classifier[3](torch.relu(model.classifier[0](h))))  # fc6, ReLU, (dropout), fc7, ReLU
    np.testing.assert_allclose(features, fc7.reshape(2, 10, 4096).numpy(), rtol=1e-4, atol=1e-5)
    assert (features >= 0).all() and (features > 0).any()
    attrs = extractor.attrs()
    assert (attrs["kind"], attrs["image_size"], attrs["resize_short_side"], attrs["num_crops"]) == ("tencrop", 64, 73, 10)


@pytest.mark.slow
def test_tencrop_resnet152_from_a_state_dict_file(jpeg, tmp_path):
    """--weights PATH: real key names, a DDP ``module.`` prefix and no fc (never run) are all accepted."""
    torch.manual_seed(1)
    source = torchvision.models.resnet152(weights=None, zero_init_residual=True).eval()
    state = {f"module.{k}": v for k, v in source.state_dict().items() if not k.startswith("fc.")}
    path = tmp_path / "resnet152.pth"
    torch.save({"state_dict": state}, path)
    assert set(read_state_dict(path)) == {k for k in source.state_dict() if not k.startswith("fc.")}
    extractor = build_extractor("tencrop-resnet152", weights=str(path), image_size=32)
    batch = extractor.collate([extractor.load(str(jpeg))])
    features = extractor.extract(batch)["features"]
    with torch.no_grad():
        pooled = torch.flatten(source.avgpool(_resnet_res5c(source, batch.flatten(0, 1))), 1)
    np.testing.assert_allclose(features, pooled.reshape(1, 10, 2048).numpy(), rtol=1e-4, atol=1e-5)
    import hashlib
    assert extractor.attrs()["weights"] == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    assert extractor.attrs()["weights_file"] == "resnet152.pth"


def test_wrong_architecture_state_dict_is_one_clear_error(tmp_path):
    path = tmp_path / "resnet18.pth"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), path)
    with pytest.raises(UserError) as caught:
        build_extractor("resnet152-grid", weights=str(path))
    message = str(caught.value)
    assert "does not fit resnet152" in message and "missing (e.g. layer1.0.conv3.weight)" in message
    assert "other shapes (e.g. layer1.0.conv1.weight [64, 64, 3, 3] (model [64, 64, 1, 1]))" in message
    assert "\n" not in message
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="cannot read .*junk.pth as a PyTorch state dict"):
        build_extractor("resnet152-grid", weights=str(tmp_path / "junk.pth"))
    with pytest.raises(ValueError, match="^weights '.*absent.pth' is neither 'imagenet', 'random'"):
        build_extractor("resnet152-grid", weights=str(tmp_path / "absent.pth"))


def test_imagenet_weights_missing_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(MissingResourceError) as caught:
        build_extractor("tencrop-vgg19", weights="imagenet")
    message = str(caught.value)
    cache = tmp_path / "torch" / "hub" / "checkpoints"
    assert "VGG19_Weights.IMAGENET1K_V1 (vgg19-dcbb9e9d.pth) not found" in message
    assert f"looked in {cache}" in message
    assert "https://download.pytorch.org/models/vgg19-dcbb9e9d.pth" in message and "\n" not in message
    with pytest.raises(ValueError, match="weights 'IMAGENET1K_V9' is not a torchvision weight name of resnet152"):
        build_extractor("resnet152-grid", weights="IMAGENET1K_V9")


def test_damaged_cached_weights_are_reported(tmp_path, monkeypatch):
    """A file in torchvision's cache is loaded with torchvision's loader, which checks its hash."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cached = hub_checkpoint_path(torchvision.models.ResNet152_Weights.IMAGENET1K_V2.url)
    cached.parent.mkdir(parents=True)
    torch.save({"conv1.weight": torch.zeros(1)}, cached)  # not the file whose hash the name carries
    with pytest.raises(UserError, match=f"cached weights {cached} are damaged"):
        build_extractor("resnet152-grid", weights="ResNet152_Weights.IMAGENET1K_V2")


def test_cpu_passes_of_a_few_images_give_the_whole_batch_features(jpeg, monkeypatch):
    """On CPU a batch runs through the network a few images at a time; the features do not change."""
    import retr.extractors.backbone as backbone
    extractor = build_extractor("tencrop-resnet152", weights="random", image_size=32)
    other = extractor.load(str(jpeg)).flip(-1)
    batch = extractor.collate([extractor.load(str(jpeg)), other, extractor.load(str(jpeg))])   # 30 crops
    calls = []
    network = extractor.network
    monkeypatch.setattr(extractor, "network", lambda x: calls.append(x.shape[0]) or network(x))
    monkeypatch.setattr(backbone, "CPU_PIXELS_PER_PASS", 10**9)
    whole = extractor.extract(batch)["features"]
    assert calls == [30]
    calls.clear()
    monkeypatch.setattr(backbone, "CPU_PIXELS_PER_PASS", 4 * 32 * 32)
    parts = extractor.extract(batch)["features"]
    assert calls == [4] * 7 + [2]
    np.testing.assert_allclose(parts, whole, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ library only
def test_no_extractor_module_imports_click():
    """Command-line options live on the pipeline side (``pipeline/commands/extract.py``); extractors are a library."""
    import ast

    import retr.extractors

    root = Path(retr.extractors.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(root)}: {name}" for name in names if name.split(".")[0] == "click"]
    assert len(list(root.rglob("*.py"))) > 10 and offenders == []


# ------------------------------------------------------------------------------------------------------------------
# ``tencrop-irv2``: timm's Inception-ResNet-v2, globally pooled (1536-d), on ten crops — random weights, weights
# from files (state dict, safetensors, the Hugging Face cache layout timm downloads into), the missing-weights
# error, and the extraction command end to end. Crops are 75 pixels (the smallest the network takes) to stay fast.

CROP = MIN_CROP_IRV2  # 75


@pytest.fixture
def jpegs(noise_jpegs) -> list[Path]:
    return noise_jpegs([(96, 64), (80, 120)])


def _timm_pooled(model: torch.nn.Module, crops: torch.Tensor) -> torch.Tensor:
    """timm's own pooled pre-logits features (``forward_features`` then ``forward_head(pre_logits=True)``)."""
    with torch.no_grad():
        return model.forward_head(model.forward_features(crops), pre_logits=True)


def _source_model(seed: int = 1) -> torch.nn.Module:
    """A full timm Inception-ResNet-v2 (classifier included, as in the released files) in eval mode."""
    torch.manual_seed(seed)
    return timm.create_model("inception_resnet_v2", pretrained=False).eval()


def test_random_weights_give_ten_pooled_1536_vectors(jpegs):
    assert "tencrop-irv2" in available_extractors()
    extractor = build_extractor("tencrop-irv2", weights="random", image_size=CROP)
    assert extractor.feature_shape == (10, 1536)
    samples = [extractor.load(str(p)) for p in jpegs]
    # Preprocessing: short side 86 (= 75·256/224), ten 75 crops, pixels scaled to [-1, 1] (mean = std = 0.5).
    expected = TenCrop(CROP, 86, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))(str(jpegs[0]))
    torch.testing.assert_close(samples[0], expected, rtol=0, atol=0)
    assert samples[0].shape == (10, 3, CROP, CROP) and samples[0].min() >= -1 and samples[0].max() <= 1
    batch = extractor.collate(samples)
    features = extractor.extract(batch)["features"]
    assert features.shape == (2, 10, 1536) and features.dtype == np.float32
    assert np.isfinite(features).all() and np.abs(features).max() > 0
    # --weights random is timm's initialisation under seed 0, and the kept layer is timm's pooled output.
    torch.manual_seed(0)
    fresh = timm.create_model("inception_resnet_v2", pretrained=False, num_classes=0).eval()
    expected = _timm_pooled(fresh, batch.flatten(0, 1)).reshape(2, 10, 1536)
    np.testing.assert_allclose(features, expected.numpy(), rtol=1e-4, atol=1e-6)
    attrs = extractor.attrs()
    assert (attrs["kind"], attrs["extractor"], attrs["backbone"], attrs["layer"]) == (
        "tencrop", "tencrop-irv2", "inception_resnet_v2", "global_pool.flatten")
    assert attrs["normalize_mean"] == [0.5] * 3 and attrs["normalize_std"] == [0.5] * 3
    assert (attrs["weights"], attrs["weights_seed"], attrs["image_size"], attrs["resize_short_side"]) == (
        "random", 0, CROP, 86)
    assert "Inception (mean 0.5, std 0.5) normalisation" in attrs["preprocessing"]


def test_default_size_is_ten_299_crops_of_a_342_short_side(jpegs):
    extractor = build_extractor("tencrop-irv2", weights="random")
    assert (extractor.image_size, extractor.resize) == (299, 342)
    assert extractor.load(str(jpegs[1])).shape == (10, 3, 299, 299)
    with pytest.raises(ParameterError, match="image_size \\(the crop side\\) must be at least 75 for tencrop-irv2"):
        build_extractor("tencrop-irv2", weights="random", image_size=CROP - 1)


def test_weights_files_give_the_features_of_the_model_they_came_from(jpegs, tmp_path, monkeypatch):
    """A torch.save state dict (DDP prefix, classifier included), its safetensors form, and the same file in the
    Hugging Face cache layout (what timm.create_model(..., pretrained=True) leaves) all load to the source model."""
    source = _source_model()
    state = source.state_dict()
    assert "classif.weight" in state
    pth = tmp_path / "irv2.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}}, pth)
    safetensors = tmp_path / "irv2.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(safetensors))
    snapshot = tmp_path / "hub" / "models--timm--inception_resnet_v2.tf_in1k" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abc")
    (snapshot / "model.safetensors").write_bytes(safetensors.read_bytes())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))

    crops = TenCrop(CROP, 86, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))(str(jpegs[0]))
    expected = _timm_pooled(source, crops).reshape(1, 10, 1536).numpy()
    for weights, name, file in [(str(pth), "sha256:" + hashlib.sha256(pth.read_bytes()).hexdigest(), "irv2.pth"),
                                (str(safetensors), "sha256:" + hashlib.sha256(safetensors.read_bytes()).hexdigest(),
                                 "irv2.safetensors"),
                                ("imagenet", "timm/inception_resnet_v2.tf_in1k", "model.safetensors")]:
        extractor = build_extractor("tencrop-irv2", weights=weights, image_size=CROP)
        features = extractor.extract(extractor.collate([extractor.load(str(jpegs[0]))]))["features"]
        np.testing.assert_allclose(features, expected, rtol=1e-4, atol=1e-6, err_msg=weights)
        attrs = extractor.attrs()
        assert (attrs["weights"], attrs["weights_file"]) == (name, file), weights
    assert attrs["weights_revision"] == "0123abc"


def test_missing_weights_are_one_line_with_the_command_that_fetches_them(tmp_path, monkeypatch, run_cli):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(MissingResourceError) as caught:
        build_extractor("tencrop-irv2", weights="imagenet")
    folder = tmp_path / "hub" / "models--timm--inception_resnet_v2.tf_in1k"
    message = str(caught.value)
    assert message == (f"timm weights inception_resnet_v2.tf_in1k (model.safetensors) not found (looked in {folder}); "
                       "run retr-pipeline fetch-weights inception_resnet_v2 on a connected machine (or python -c "
                       "\"import timm; timm.create_model('inception_resnet_v2.tf_in1k', pretrained=True)\") and copy "
                       f"models--timm--inception_resnet_v2.tf_in1k into {tmp_path / 'hub'} (HF_HUB_CACHE or HF_HOME "
                       "name another cache), or pass --weights PATH to its model.safetensors")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(MissingResourceError, match=f"looked in {tmp_path / 'hf' / 'hub'}/models--timm--"):
        build_extractor("tencrop-irv2", weights="tf_ens_adv_in1k")
    # The command: the same line, nothing else, exit status 1.
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text(json.dumps({"id": "a", "path": "a.jpg", "split": "test", "captions": ["x"]}) + "\n")
    code, out, err = run_cli.as_user("pipeline", "extract", "--manifest", manifest, "--extractor", "tencrop-irv2",
                                     "--out", tmp_path / "features")
    assert code == 1 and err.startswith("error: timm weights inception_resnet_v2.tf_in1k (model.safetensors) not "
                                        f"found (looked in {tmp_path / 'hf' / 'hub'}") and err.count("\n") == 1


def test_bad_weights_values_and_files(tmp_path):
    with pytest.raises(ParameterError, match="^weights 'IMAGENET1K_V1' is neither 'imagenet', 'random', a timm "
                                             r"weight tag of inception_resnet_v2 \(tf_ens_adv_in1k, tf_in1k\)") \
            as caught:
        build_extractor("tencrop-irv2", weights="IMAGENET1K_V1")
    assert caught.value.parameter == "weights"
    import torchvision
    wrong = tmp_path / "resnet18.pth"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), wrong)
    with pytest.raises(UserError, match="does not fit inception_resnet_v2 of this extractor: .* missing "
                                        r"\(e.g. conv2d_1a.conv.weight\); .* unexpected \(e.g. conv1.weight\)"):
        build_extractor("tencrop-irv2", weights=str(wrong))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match=f"^cannot read {junk} as a safetensors file"):
        build_extractor("tencrop-irv2", weights=str(junk))


def test_extract_command_writes_a_10x1536_feature_set(jpegs, tmp_path, run_cli):
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("".join(json.dumps({"id": p.stem, "path": p.name, "split": "test", "captions": ["x"]}) + "\n"
                                for p in jpegs))
    shown = run_cli("pipeline", "extract", "--help")
    assert "tencrop-irv2" in shown.output
    run_cli("pipeline", "extract", "--manifest", manifest, "--extractor", "tencrop-irv2", "--weights", "random",
            "--image-size", CROP, "--workers", 0, "--out", tmp_path / "features", "--quiet")
    with h5py.File(tmp_path / "features" / "tencrop-irv2.h5") as f:
        assert f["features"].shape == (2, 10, 1536) and f["features"].dtype == np.float16
        assert [i.decode() for i in f["ids"][:]] == ["img0", "img1"]
        assert f.attrs["kind"] == "tencrop" and f.attrs["backbone"] == "inception_resnet_v2"


def test_only_the_coco_preset_runs_it():
    """SEAM's IRv2 rows are COCO rows (Tables 3-4): `make extract DATASET=coco` extracts it, f30k does not."""
    from retr.manifests.presets import get_preset
    assert get_preset("coco").extractors[-1] == "tencrop-irv2"
    assert "tencrop-irv2" not in get_preset("f30k").extractors + get_preset("synthetic").extractors


def test_random_weights_are_made_once_and_each_build_gets_its_own_copy(monkeypatch):
    """``--weights random`` is the same seeded initialisation every time; a process makes it once per
    architecture (weights.seeded_random_model) and hands out copies, keeping at most RANDOM_MODELS_KEPT."""
    from retr.extractors import weights

    monkeypatch.setattr(weights, "_RANDOM_MODELS", weights.OrderedDict())
    made = []
    real = torchvision.models.resnet18

    def counting(**options):
        made.append(options)
        return real(**options)
    monkeypatch.setattr(weights.tvm, "get_model_builder", lambda arch: counting)
    state = torch.random.get_rng_state()
    first, _ = weights.build_backbone("resnet18", "random")
    second, loaded = weights.build_backbone("resnet18", "random")
    assert len(made) == 1 and loaded.name == "random" and not second.training
    assert torch.equal(torch.random.get_rng_state(), state)              # the caller's random state untouched
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), name  # equal values, separate storage
    with torch.no_grad():
        first.fc.weight.zero_()                                          # one copy changed …
    assert second.fc.weight.abs().sum() > 0                              # … leaves the others alone,
    again, _ = weights.build_backbone("resnet18", "random")
    assert len(made) == 1 and torch.equal(again.fc.weight, second.fc.weight)   # the kept one too
    weights.build_backbone("resnet18", "random", zero_init_residual=True)          # other options: made anew
    assert len(made) == 2 and made[-1] == {"weights": None, "zero_init_residual": True}
    weights.build_backbone("resnet18", "random", zero_init_residual=False)
    assert len(weights._RANDOM_MODELS) == weights.RANDOM_MODELS_KEPT == 2
    weights._RANDOM_MODELS.clear()                                       # a fresh initialisation: the same values
    fresh, _ = weights.build_backbone("resnet18", "random")
    for (name, a), b in zip(fresh.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name
