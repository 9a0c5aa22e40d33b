"""The ``clip-*`` extractors (open_clip): shapes of every family member (ViT-B/32 built; the others from
open_clip's configs, since building ViT-L on a 2-core CPU takes minutes), row 0 = ``encode_image`` and rows
1..P = the projected final-layer patch tokens, determinism, the recorded attributes, weights from a file and
from the Hugging Face cache layout, and the offline missing-weights line. Everything runs on random weights:
no CLIP weights can be downloaded here."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch
from safetensors.torch import save_file

from retr.common.downloads import SOURCES
from retr.common.errors import MissingResourceError, ParameterError, UserError
from retr.extractors.base import available_extractors, build_extractor, declared_options
from retr.extractors.clip import FAMILY, clip_from_attrs, geometry
from retr.extractors.images import decode_image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)


@pytest.fixture
def jpegs(noise_jpegs) -> list[Path]:
    return noise_jpegs([(96, 64), (70, 120)])


def _model(seed: int = 0) -> torch.nn.Module:
    """A whole open_clip ViT-B-32 (OpenAI's QuickGELU architecture) initialised under ``seed``."""
    torch.manual_seed(seed)
    return open_clip.create_model("ViT-B-32", pretrained=None, force_quick_gelu=True).eval()


def _all_tokens(model: torch.nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(encode_image [B, 512], every token of the final layer after ln_post, projected [B, 50, 512]), the tokens
    caught by a hook on ln_post: independent of the extractor's own token path."""
    caught = []
    handle = model.visual.ln_post.register_forward_hook(lambda module, args, out: caught.append(out))
    with torch.no_grad():
        pooled = model.encode_image(images)
        handle.remove()
        return pooled, caught[0] @ model.visual.proj


def test_every_family_member_is_registered_with_its_grid():
    """[1 + P, D]: ViT-B/32 7×7 patches of 512-d, B/16 14×14, L/14 16×16 and L/14@336px 24×24 of 768-d."""
    expected = {"clip-vit-b-32": (224, 50, 512), "clip-vit-b-16": (224, 197, 512), "clip-vit-l-14": (224, 257, 768),
                "clip-vit-l-14-336": (336, 577, 768)}
    assert set(FAMILY) <= set(available_extractors())
    for name, (size, tokens, dim) in expected.items():
        g = geometry(FAMILY[name])
        assert (g["image_size"], g["tokens"], g["embed_dim"]) == (size, tokens, dim), name
        assert "image_size" not in declared_options(name)            # fixed by the position embeddings
        repo = open_clip.get_pretrained_cfg(FAMILY[name], "openai")["hf_hub"].strip("/")
        assert SOURCES[name].url == f"https://huggingface.co/{repo}/resolve/main/open_clip_model.safetensors"


@pytest.mark.numerical
def test_random_weights_give_the_embedding_then_the_patch_tokens(jpegs):
    extractor = build_extractor("clip-vit-b-32", weights="random")
    assert extractor.feature_shape == (50, 512)
    samples = [extractor.load(str(p)) for p in jpegs]
    # CLIP's own preprocessing (open_clip's eval transform) on the same decoded image: the same tensor
    reference = open_clip.image_transform(224, is_train=False, mean=CLIP_MEAN,
                                          std=(0.26862954, 0.26130258, 0.27577711))
    for path, sample in zip(jpegs, samples):
        torch.testing.assert_close(sample, reference(decode_image(path)), rtol=0, atol=0)
    batch = extractor.collate(samples)
    features = extractor.extract(batch)["features"]
    assert features.shape == (2, 50, 512) and features.dtype == np.float32
    # --weights random is open_clip's initialisation under seed 0; row 0 is encode_image, rows 1.. the patches.
    # Tolerance: the same float32 arithmetic in two batchings (1e-5 relative covers BLAS blocking differences).
    pooled, tokens = _all_tokens(_model(0), batch)
    np.testing.assert_allclose(features[:, 0], pooled.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(features[:, 1:], tokens[:, 1:].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tokens[:, 0].numpy(), pooled.numpy(), rtol=1e-5, atol=1e-5)  # CLS row = pooled
    again = build_extractor("clip-vit-b-32", weights="random").extract(batch)["features"]
    np.testing.assert_array_equal(features, again)                                        # deterministic
    attrs = extractor.attrs()
    assert {k: attrs[k] for k in ("kind", "extractor", "backbone", "clip_model", "weights", "weights_seed",
                                  "quick_gelu", "image_size", "patch_size", "grid_size", "tokens", "embed_dim")} == {
        "kind": "clip", "extractor": "clip-vit-b-32", "backbone": "ViT-B-32", "clip_model": "ViT-B-32",
        "weights": "random", "weights_seed": 0, "quick_gelu": True, "image_size": 224, "patch_size": 32,
        "grid_size": 7, "tokens": 50, "embed_dim": 512}
    assert attrs["normalize_mean"] == list(CLIP_MEAN) and "bicubic" in attrs["preprocessing"]
    assert attrs["token_layout"].startswith("row 0: projected image embedding")
    # the text tower the zero-shot evaluation rebuilds from these attributes is the same random model's
    rebuilt = clip_from_attrs(attrs)
    for name, value in _model(0).state_dict().items():
        torch.testing.assert_close(rebuilt.state_dict()[name], value, rtol=0, atol=0)
    with pytest.raises(ParameterError, match="extractor 'clip-vit-b-32' does not take image_size"):
        build_extractor("clip-vit-b-32", weights="random", image_size=112)


@pytest.mark.numerical
def test_device_decoding_matches_the_pillow_path(jpegs):
    """--decode device (decode_jpeg + tensor ops, here on the CPU) against Pillow: bicubic on uint8 tensors rounds
    at other points than Pillow's, so pixels differ by a few levels (~0.05 after CLIP's normalisation)."""
    from torchvision.io import decode_jpeg

    preprocess = build_extractor("clip-vit-b-32", weights="random", decode="device")._preprocess
    for path in jpegs:
        decoded = decode_jpeg(torch.from_numpy(np.frombuffer(path.read_bytes(), dtype=np.uint8).copy()))
        difference = (preprocess.from_decoded(decoded) - preprocess(str(path))).abs()
        assert difference.shape == (3, 224, 224) and difference.mean() < 0.02 and difference.max() < 0.3


@pytest.mark.numerical
def test_weights_from_a_file_and_from_the_hub_cache(jpegs, tmp_path, monkeypatch):
    source = _model(1)
    snapshot = tmp_path / "hub" / "models--timm--vit_base_patch32_clip_224.openai" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abc")
    file = snapshot / "open_clip_model.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(file))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    sha = "sha256:" + hashlib.sha256(file.read_bytes()).hexdigest()
    for weights, name in (("openai", "timm/vit_base_patch32_clip_224.openai"), (str(file), sha)):
        extractor = build_extractor("clip-vit-b-32", weights=weights)
        batch = extractor.collate([extractor.load(str(jpegs[0]))])
        pooled, _ = _all_tokens(source, batch)
        np.testing.assert_allclose(extractor.extract(batch)["features"][:, 0], pooled.numpy(), rtol=1e-5, atol=1e-5)
        assert extractor.attrs()["weights"] == name
    attrs = build_extractor("clip-vit-b-32", weights="openai").attrs()
    assert (attrs["weights_revision"], attrs["clip_pretrained"], attrs["quick_gelu"]) == ("0123abc", "openai", True)
    # the recorded identity is itself a weights value (what rebuilding an extractor from a set's attributes passes)
    assert build_extractor("clip-vit-b-32", weights=attrs["weights"]).attrs()["clip_pretrained"] == "openai"
    # a set extracted from a file is rebuilt only with that file
    file_attrs = extractor.attrs()
    with pytest.raises(UserError, match="extracted with the weights file open_clip_model.safetensors .*pass it as "
                                        "--weights"):
        clip_from_attrs(file_attrs)
    other = tmp_path / "other.safetensors"
    save_file({k: v.contiguous() for k, v in _model(2).state_dict().items()}, str(other))
    with pytest.raises(UserError, match=f"{other} is not the weights file the features were extracted with"):
        clip_from_attrs(file_attrs, str(other))
    assert torch.equal(clip_from_attrs(file_attrs, str(file)).text_projection, source.text_projection)


def test_bad_weights_are_one_line(tmp_path):
    with pytest.raises(ParameterError, match=r"^weights 'nope' is neither 'random', an open_clip pretrained tag of "
                                             r"ViT-B-32 \(openai, laion400m_e31"):
        build_extractor("clip-vit-b-32", weights="nope")
    import torchvision
    wrong = tmp_path / "resnet18.pth"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), wrong)
    with pytest.raises(UserError, match="does not fit ViT-B-32 of this extractor: .* missing"):
        build_extractor("clip-vit-b-32", weights=str(wrong))


def test_missing_weights_offline_name_the_command_that_fetches_them(tmp_path, monkeypatch, run_cli):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    folder = tmp_path / "hub" / "models--timm--vit_large_patch14_clip_336.openai"
    with pytest.raises(MissingResourceError) as caught:
        build_extractor("clip-vit-l-14-336")
    assert str(caught.value).startswith(
        f"open_clip weights ViT-L-14-336 openai (open_clip_model.safetensors) not found (looked in {folder}); run "
        "retr-pipeline fetch-weights clip-vit-l-14-336 on a connected machine")
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text(json.dumps({"id": "a", "path": "a.jpg", "split": "test", "captions": ["x"]}) + "\n")
    code, out, err = run_cli.as_user("pipeline", "extract", "--manifest", manifest, "--extractor", "clip-vit-b-16",
                                     "--out", tmp_path / "features")
    assert code == 1 and err.count("\n") == 1 and "fetch-weights clip-vit-b-16" in err
    code, out, err = run_cli.as_user("pipeline", "fetch-weights", "clip", "--offline")
    assert code == 1 and err == (f"error: weights clip-vit-b-32, clip-vit-b-16, clip-vit-l-14, clip-vit-l-14-336 not "
                                 f"found (looked in {tmp_path / 'hub'}); run retr-pipeline fetch-weights clip-vit-b-32 "
                                 "clip-vit-b-16 clip-vit-l-14 clip-vit-l-14-336 on a connected machine and copy what it "
                                 "downloads to those folders (RETR_OFFLINE is set, so retr does not download here)\n")
