"""butd-regions network: MILVLG key layout, checkpoint loaders (incl. the airsplay mapping), extraction."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from retr.common.errors import MissingResourceError, ParameterError, UserError
from retr.extractors.base import build_extractor
from retr.extractors.butd.checkpoint import airsplay_to_caffe, load_into, load_weights
from retr.extractors.butd.model import BottomUpAttention, DetectorSettings, empty_detector
from retr.extractors.butd.random_weights import randomize_

class TrainingConfig:
    """Stands in for the argparse Namespace / yacs config some checkpoints carry."""


# Small, fast settings for the tests; the defaults (600/1000, 6000/300, 14×14) stay the original's.
FAST = dict(short_side=96, max_side=128, pre_nms_topk=600, post_nms_topk=40, pooled_size=7)


def _norm(prefix: str, channels: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.norm.{name}": (channels,) for name in ("weight", "bias", "running_mean", "running_var")}


def _conv(prefix: str, out_c: int, in_c: int, k: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.weight": (out_c, in_c, k, k), **_norm(prefix, out_c)}


def milvlg_layout() -> dict[str, tuple[int, ...]]:
    """Every key of ``bua-caffe-frcn-r101-k36.pth`` and its shape, written from the published layout."""
    keys = _conv("backbone.stem.conv1", 64, 3, 7)
    stages = [("backbone.res2", 3, 64, 64, 256), ("backbone.res3", 4, 256, 128, 512),
              ("backbone.res4", 23, 512, 256, 1024), ("roi_heads.res5", 3, 1024, 512, 2048)]
    for prefix, blocks, in_c, mid, out_c in stages:
        for b in range(blocks):
            block_in = in_c if b == 0 else out_c
            if b == 0:
                keys |= _conv(f"{prefix}.{b}.shortcut", out_c, block_in, 1)
            keys |= _conv(f"{prefix}.{b}.conv1", mid, block_in, 1)
            keys |= _conv(f"{prefix}.{b}.conv2", mid, mid, 3)
            keys |= _conv(f"{prefix}.{b}.conv3", out_c, mid, 1)
    rpn = "proposal_generator.rpn_head"
    keys |= {f"{rpn}.conv.weight": (512, 1024, 3, 3), f"{rpn}.conv.bias": (512,),
             f"{rpn}.objectness_logits.weight": (24, 512, 1, 1), f"{rpn}.objectness_logits.bias": (24,),
             f"{rpn}.anchor_deltas.weight": (48, 512, 1, 1), f"{rpn}.anchor_deltas.bias": (48,)}
    p = "roi_heads.box_predictor"
    keys |= {f"{p}.cls_score.weight": (1601, 2048), f"{p}.cls_score.bias": (1601,),
             f"{p}.bbox_pred.weight": (6404, 2048), f"{p}.bbox_pred.bias": (6404,),
             f"{p}.cls_embed.weight": (1601, 256),
             f"{p}.attr_linear1.weight": (512, 2304), f"{p}.attr_linear1.bias": (512,),
             f"{p}.attr_linear2.weight": (401, 512), f"{p}.attr_linear2.bias": (401,)}
    return keys


@pytest.fixture(scope="module")
def random_state() -> dict[str, torch.Tensor]:
    """A randomly initialised (calibrated) detector's state dict, as the MILVLG file would hold it."""
    settings = DetectorSettings(pre_nms_topk=FAST["pre_nms_topk"], post_nms_topk=FAST["post_nms_topk"],
                                pooled_size=FAST["pooled_size"])
    return {k: v.clone() for k, v in randomize_(empty_detector(settings)).state_dict().items()}


@pytest.fixture(scope="module")
def milvlg_file(tmp_path_factory, random_state):
    """The state dict saved as the MILVLG release does (under "model", plus detectron2's extra buffers)."""
    path = tmp_path_factory.mktemp("weights") / "bua-caffe-frcn-r101-k36.pth"
    extra = {"pixel_mean": torch.tensor([102.9801, 115.9465, 122.7717]).reshape(3, 1, 1),
             "proposal_generator.anchor_generator.cell_anchors.0": torch.zeros(12, 4)}
    torch.save({"model": {**random_state, **extra}}, path)
    return path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    from retr.manifests.synthetic import generate_synthetic
    out = tmp_path_factory.mktemp("synth")
    generate_synthetic(out, num_images=4, seed=0)
    return out


def test_model_names_and_shapes_follow_the_milvlg_layout():
    with torch.device("meta"):
        own = {k: tuple(v.shape) for k, v in BottomUpAttention().state_dict().items()}
    assert own == milvlg_layout()


def test_random_layout_state_dict_loads_with_no_missing_or_unexpected_keys(milvlg_file, random_state):
    model = empty_detector()
    report = load_weights(model, milvlg_file)
    assert report.missing == [] and report.unexpected == []
    assert report.loaded == len(milvlg_layout())
    assert sorted(report.ignored) == ["pixel_mean", "proposal_generator.anchor_generator.cell_anchors.0"]
    for key, value in model.state_dict().items():
        assert torch.equal(value, random_state[key]), key


def test_partial_or_mismatched_loads_are_refused_unless_asked(random_state):
    partial = {k: v for k, v in random_state.items() if not k.startswith("roi_heads.box_predictor.attr")}
    with pytest.raises(UserError, match=r"4 missing .*; set allow_partial to load it anyway") as caught:
        load_into(empty_detector(), partial)
    assert caught.value.parameters == ("allow_partial",)  # a command shows its flag (--allow-partial) instead
    report = load_into(empty_detector(), {**partial, "extra.weight": torch.zeros(1)}, allow_partial=True)
    assert len(report.missing) == 4 and report.unexpected == ["extra.weight"]
    wrong = dict(random_state)
    wrong["roi_heads.box_predictor.cls_score.weight"] = torch.zeros(81, 2048)
    with pytest.raises(UserError, match="wrong shape"):
        load_into(empty_detector(), wrong, allow_partial=True)


def test_missing_weights_file_is_one_line(tmp_path):
    with pytest.raises(MissingResourceError) as info:
        load_weights(empty_detector(), tmp_path / "bua-caffe-frcn-r101-k36.pth")
    message = str(info.value)
    assert "\n" not in message and str(tmp_path) in message and "MILVLG" in message


def test_pth_with_python_objects_needs_the_trust_flag(tmp_path, random_state):
    path = tmp_path / "with_config.pth"
    torch.save({"model": {"x": torch.zeros(1)}, "cfg": TrainingConfig()}, path)
    with pytest.raises(UserError, match="if you trust the file, set trust_checkpoint$") as caught:
        load_weights(empty_detector(), path)
    assert caught.value.parameters == ("trust_checkpoint",)


def caffe_to_airsplay(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The inverse mapping, written here independently: Caffe layout → detectron2/airsplay layout."""
    out = {}
    caffe_anchor_of_d2 = [r * 4 + s for s in range(4) for r in range(3)]  # d2 index s·3+r ← Caffe r·4+s
    for name, value in state.items():
        value = value.numpy()
        p = "roi_heads.box_predictor."
        if name.startswith(p + "cls_score.") or name.startswith(p + "cls_embed."):
            value = np.concatenate([value[1:], value[:1]])
            name = name.replace("cls_embed.", "cls_embedding.")
        elif name.startswith(p + "bbox_pred."):
            value = value[4:]
        elif name.startswith(p + "attr_linear1."):
            name = name.replace("attr_linear1.", "fc_attr.")
        elif name.startswith(p + "attr_linear2."):
            value = np.concatenate([value[1:], value[:1]])
            name = name.replace("attr_linear2.", "attr_score.")
        elif name.startswith("proposal_generator.rpn_head.objectness_logits."):
            value = (value[12:] - value[:12])[caffe_anchor_of_d2]        # fg − bg, size-major
        elif name.startswith("proposal_generator.rpn_head.anchor_deltas."):
            value = value.reshape(12, 4, *value.shape[1:])[caffe_anchor_of_d2].reshape(value.shape)
        out[name] = value
    return out


def test_airsplay_layout_maps_back_exactly(tmp_path, random_state):
    state = {k: v.clone() for k, v in random_state.items()}
    # what the detectron2 layout cannot hold: background box regression, a separate background logit
    state["roi_heads.box_predictor.bbox_pred.weight"][:4] = 0
    state["roi_heads.box_predictor.bbox_pred.bias"][:4] = 0
    for suffix in ("weight", "bias"):
        state[f"proposal_generator.rpn_head.objectness_logits.{suffix}"][:12] = 0
    airsplay = caffe_to_airsplay(state)
    assert airsplay["roi_heads.box_predictor.bbox_pred.weight"].shape == (6400, 2048)
    assert airsplay["proposal_generator.rpn_head.objectness_logits.weight"].shape == (12, 512, 1, 1)
    mapped = airsplay_to_caffe(airsplay)
    assert mapped.keys() == state.keys()
    for key in state:
        assert torch.equal(mapped[key], state[key]), key
    # and through the file format, with the restricted unpickler
    path = tmp_path / "faster_rcnn_from_caffe_attr.pkl"
    with open(path, "wb") as handle:
        pickle.dump({"model": airsplay, "__author__": "test"}, handle)
    model = empty_detector()
    report = load_weights(model, path)
    assert report.missing == [] and report.unexpected == []
    assert torch.equal(model.state_dict()["roi_heads.box_predictor.cls_score.weight"],
                       state["roi_heads.box_predictor.cls_score.weight"])


def test_airsplay_rpn_mapping_preserves_foreground_probability():
    rng = np.random.default_rng(0)
    d2_logits = rng.standard_normal(12).astype(np.float32)
    mapped = airsplay_to_caffe({"proposal_generator.rpn_head.objectness_logits.bias": d2_logits})
    two_way = mapped["proposal_generator.rpn_head.objectness_logits.bias"].reshape(2, 12)
    fg = torch.softmax(two_way, dim=0)[1]
    # Caffe anchor (ratio r, scale s) = detectron2 anchor (size s, ratio r)
    for r in range(3):
        for s in range(4):
            assert torch.isclose(fg[r * 4 + s], torch.sigmoid(torch.tensor(d2_logits[s * 3 + r])))


def test_pickle_with_objects_needs_the_trust_flag(tmp_path):
    path = tmp_path / "odd.pkl"
    with open(path, "wb") as handle:
        pickle.dump({"model": {"x": np.zeros(2)}, "cfg": UserError("an object")}, handle)
    with pytest.raises(UserError, match="if you trust the file, set trust_checkpoint$"):
        load_weights(empty_detector(), path)


def _load_batch(extractor, manifest_dir, count=2):
    paths = sorted((manifest_dir / "images").glob("*.jpg"))[:count]
    return extractor.collate([extractor.load(str(p)) for p in paths])


def test_extraction_from_a_checkpoint_gives_36_boxes_inside_the_image(milvlg_file, synthetic):
    extractor = build_extractor("butd-regions", weights=str(milvlg_file), **FAST)
    out = extractor.extract(_load_batch(extractor, synthetic))
    assert out["features"].shape == (2, 36, 2048) and out["features"].dtype == np.float32
    assert np.isfinite(out["features"]).all()
    assert 0.01 < np.abs(out["features"]).mean() < 100      # well scaled: fits float16 with room to spare
    assert (out["num_boxes"] == 36).all()
    assert (out["image_hw"] == [224, 224]).all()
    boxes = out["boxes"]
    assert (boxes[..., 0] >= 0).all() and (boxes[..., 1] >= 0).all()
    assert (boxes[..., 2] <= 223).all() and (boxes[..., 3] <= 223).all()
    assert (boxes[..., 2] >= boxes[..., 0]).all() and (boxes[..., 3] >= boxes[..., 1]).all()
    assert ((out["object_ids"] >= 0) & (out["object_ids"] < 1600)).all()
    assert ((out["attr_ids"] >= 0) & (out["attr_ids"] < 400)).all()
    assert ((out["object_conf"] > 0) & (out["object_conf"] <= 1)).all()
    assert set(out) == {"features", *extractor.extras}
    attrs = extractor.attrs()
    assert attrs["kind"] == "regions" and attrs["weights"].startswith(milvlg_file.name + " sha256:")
    # the same weights as random init give the same features: the file loaded exactly
    random_extractor = build_extractor("butd-regions", weights="random", **FAST)
    again = random_extractor.extract(_load_batch(random_extractor, synthetic))
    assert np.allclose(again["features"], out["features"], atol=1e-5)


def test_images_with_few_proposals_are_padded(synthetic):
    extractor = build_extractor("butd-regions", weights="random", **{**FAST, "post_nms_topk": 40})
    image = extractor.load(str(sorted((synthetic / "images").glob("*.jpg"))[0]))
    extractor.network.proposal_generator.post_nms_topk = 12     # as if only 12 proposals survived
    out = extractor.extract([image])
    assert out["num_boxes"].tolist() == [12]
    assert not out["features"][0, 12:].any() and not out["boxes"][0, 12:].any()
    assert out["features"][0, :12].any()


def test_vocabularies_are_recorded(tmp_path):
    objects = tmp_path / "objects_vocab.txt"
    objects.write_text("\n".join(f"object{i},thing{i}" for i in range(1600)) + "\n")
    attributes = tmp_path / "attributes_vocab.txt"
    attributes.write_text("\n".join(f"attr{i}" for i in range(400)))
    extractor = build_extractor("butd-regions", weights="random", object_vocab=str(objects),
                                attr_vocab=str(attributes), **FAST)
    attrs = extractor.attrs()
    assert attrs["object_vocab"][0] == "object0,thing0" and len(attrs["object_vocab"]) == 1600
    assert attrs["attr_vocab"][399] == "attr399"
    attributes.write_text("red\nblue\n")
    with pytest.raises(UserError, match="expected 400"):
        build_extractor("butd-regions", weights="random", attr_vocab=str(attributes), **FAST)


def test_bad_options_are_value_errors_naming_the_parameters():
    with pytest.raises(ParameterError, match=r"^post_nms_topk \(10\) must be at least max_boxes \(36\)$") as caught:
        build_extractor("butd-regions", weights="random", post_nms_topk=10)
    assert caught.value.parameters == ("post_nms_topk", "max_boxes")
    with pytest.raises(ValueError, match="^butd-regions does not take image_size$"):
        build_extractor("butd-regions", weights="random", image_size=448)
    with pytest.raises(ValueError, match="^need 1 ≤ min_boxes ≤ max_boxes, got 10 and 5$"):
        build_extractor("butd-regions", weights="random", min_boxes=10, max_boxes=5)
    with pytest.raises(ValueError, match="^need 16 ≤ short_side ≤ max_side, got 600 and 500$"):
        build_extractor("butd-regions", weights="random", max_side=500)


def test_default_weights_are_never_silently_random(tmp_path, monkeypatch):
    """Without --weights, the default checkpoint is looked up; when absent the error says where and how."""
    from retr.common.errors import MissingResourceError
    from retr.extractors.butd.extractor import DEFAULT_CHECKPOINT, default_checkpoint_candidates

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RETR_WEIGHTS", str(tmp_path / "w"))
    monkeypatch.delenv("RETR_BUTD_WEIGHTS", raising=False)
    with pytest.raises(MissingResourceError) as info:
        build_extractor("butd-regions", **FAST)
    message = str(info.value)
    assert DEFAULT_CHECKPOINT in message and str(tmp_path / "w" / DEFAULT_CHECKPOINT) in message
    assert "--weights PATH" in message and "\n" not in message
    assert default_checkpoint_candidates()[0] == tmp_path / "w" / DEFAULT_CHECKPOINT
