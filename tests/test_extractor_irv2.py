"""``tencrop-irv2``: timm's Inception-ResNet-v2, globally pooled (1536-d), on ten crops — random weights, weights
from files (state dict, safetensors, the Hugging Face cache layout timm downloads into), the missing-weights
error, and the extraction command end to end. Crops are 75 pixels (the smallest the network takes) to stay fast."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file  # a dependency of timm

from retr.common.errors import MissingResourceError, ParameterError, UserError
from retr.extractors.base import available_extractors, build_extractor
from retr.extractors.images import TenCrop
from retr.extractors.tencrop import MIN_CROP_IRV2

CROP = MIN_CROP_IRV2  # 75


@pytest.fixture
def jpegs(tmp_path) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for k, (w, h) in enumerate([(96, 64), (80, 120)]):
        path = tmp_path / f"img{k}.jpg"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB").save(path, quality=95)
        paths.append(path)
    return paths


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
