"""Batched butd-regions (extractors/butd/batching.py) equals one image at a time: padding, per-image masks, RPN,
heads, selection.

Bitwise checks run with oneDNN off: its 1×1 convolutions sum in another order for another spatial size, so with
it on the batched outputs agree to rounding (measured in ``…_agrees_closely``).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from retr.common.errors import ParameterError
from retr.extractors.butd.batching import pad_images, valid_mask
from retr.extractors.butd.model import BottomUpAttention, DetectorSettings, empty_detector, run_detector
from retr.extractors.butd.random_weights import randomize_
from retr.extractors.butd.selection import (choose_boxes, choose_boxes_batched, per_class_max_conf,
                                            per_class_max_conf_batched, select_regions, select_regions_batched)

pytestmark = pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")

# speed settings (30 proposals: the res5 head on every proposal is most of the time); min_boxes 20 > the proposals
# of the 40×52 image (11), so that it yields fewer rows
SETTINGS = DetectorSettings(pre_nms_topk=600, post_nms_topk=30, pooled_size=7, min_boxes=20, max_boxes=30)
# (h, w): landscape, portrait, square, tiny; the batch's largest height and width come from different images;
# width 106 = 16·6 + 10 makes an ROI's last bin reach one res4 cell past the image (clipped there, zero here)
SIZES = [(97, 130), (150, 88), (64, 106), (40, 52)]
SCALES = [0.9, 1.3, 1.0, 0.75]
FIELDS = ("features", "boxes", "cls_prob", "attr_prob", "max_conf")


@pytest.fixture
def one_thread():
    """The bitwise checks hold for one split of each reduction. With several threads ATen splits a convolution's
    work by its tensor's shape (a batch of 4 against 1), so the two forwards differ by rounding (seen in the
    4-thread matrix); their agreement at any thread count is ``…_agrees_closely``'s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def detector() -> BottomUpAttention:
    return randomize_(empty_detector(SETTINGS)).eval()


@pytest.fixture(scope="module")
def images() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    # smooth pseudo-images (upsampled noise) with the spread of mean-subtracted pixels
    out = []
    for h, w in SIZES:
        coarse = torch.randn(1, 3, h // 8 + 2, w // 8 + 2, generator=generator) * 60.0
        out.append(torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear")[0])
    return out


@pytest.fixture(scope="module")
def alone(detector, images) -> list:
    """Each image's one-image forward (the original's path), with oneDNN off and one thread (see
    :func:`one_thread`): what the bitwise checks compare a batch with."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.backends.mkldnn.flags(enabled=False):
            return [detector(image, scale) for image, scale in zip(images, SCALES)]
    finally:
        torch.set_num_threads(threads)


def test_stage_sizes_are_those_of_the_one_image_forward():
    """The masks' sizes follow each layer's own output-size rule (ceil-mode pool, strided 1×1 convs). Real zeros
    on the CPU: these small forwards take 2.7 s, the meta device's Python shape functions 4.3 s."""
    model = BottomUpAttention(SETTINGS).eval()
    sizes = [(h, w) for h in (16, 17, 31, 33, 47, 64) for w in (18, 29, 50, 63, 106)]
    with torch.no_grad():
        _, res4_sizes = model.backbone.forward_padded(torch.zeros(len(sizes), 3, 64, 106), sizes)
        for (h, w), got in zip(sizes, res4_sizes):
            alone = model.backbone(torch.zeros(1, 3, h, w))
            assert got == tuple(alone.shape[-2:]), (h, w)
        assert model.backbone.stem.output_sizes(sizes) == [
            tuple(model.backbone.stem(torch.zeros(1, 3, h, w)).shape[-2:]) for h, w in sizes]


def test_padding_is_zeros_after_mean_subtraction_at_the_right_and_bottom():
    a, b = torch.ones(3, 2, 5), torch.full((3, 4, 3), 2.0)
    batch = pad_images([a, b])
    assert batch.shape == (2, 3, 4, 5)
    assert torch.equal(batch[0, :, :2, :5], a) and batch[0, :, 2:].abs().sum() == 0
    assert torch.equal(batch[1, :, :4, :3], b) and batch[1, :, :, 3:].abs().sum() == 0
    mask = valid_mask([(2, 5), (4, 3)], 4, 5, "cpu")
    assert mask.shape == (2, 1, 4, 5) and mask[0].sum() == 10 and mask[1].sum() == 12


@pytest.mark.usefixtures("one_thread")
def test_masks_are_what_makes_padded_res4_exact(detector, images):
    """Padding alone changes res4 near the image's right/bottom edge; the per-image masks restore it exactly."""
    with torch.backends.mkldnn.flags(enabled=False), torch.no_grad():
        small, large = images[3], images[0]
        alone = detector.backbone(small[None])
        h, w = alone.shape[-2:]
        padded = pad_images([large, small])
        unmasked = detector.backbone(padded)[1:, :, :h, :w]
        masked, sizes = detector.backbone.forward_padded(padded, [tuple(large.shape[-2:]), tuple(small.shape[-2:])])
    assert sizes[1] == (h, w)
    assert not torch.allclose(unmasked, alone, atol=1e-3)                  # the reason for the masks
    assert torch.equal(masked[1:, :, :h, :w], alone)
    assert masked[1, :, h:].abs().sum() == 0 and masked[1, :, :, w:].abs().sum() == 0


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_batched_detector_equals_one_image_at_a_time_bitwise(detector, images, alone):
    """All four images in one padded forward (groups: see the extractor test) against each alone."""
    one = alone
    with torch.backends.mkldnn.flags(enabled=False):
        batched = detector.forward_batch(images, SCALES)
    assert [len(r.boxes) for r in one] == [20, 20, 20, 11]       # min_boxes, and fewer proposals than that
    assert (one[2].boxes[:, 2] == 105).any()                     # kept boxes reach the 16k+10 edge (scale 1)
    for single, together in zip(one, batched):
        for field in FIELDS:
            assert torch.equal(getattr(single, field), getattr(together, field)), field


@pytest.mark.slow
def test_batched_detector_with_default_kernels_agrees_closely(detector, images):
    """oneDNN's kernels (sum order depends on the spatial size): measured on this CPU 2026-11-25 (30 proposals an
    image), max |Δ| of the proposals 3.7e-4 px, features 4.5e-6, class probabilities 1.6e-9, attribute probabilities
    9.3e-10 (with 60 proposals: 8.5e-4, 4.9e-6, 1.4e-9, 9.3e-10); same proposals in the same order. (The selection
    then agrees unless two boxes' ``max_conf`` differ by less than that, which these random weights' flat 1/1600
    probabilities do: one image swaps boxes.)"""
    with torch.no_grad():
        one = [detector.detect(image, scale) for image, scale in zip(images, SCALES)]
        batched = detector.detect_batch(images, SCALES)
    for single, together in zip(one, batched):
        assert [t.shape for t in single] == [t.shape for t in together]
        for a, b, atol in zip(single, together, (1e-2, 1e-4, 1e-7, 1e-7)):
            assert torch.allclose(a, b, rtol=0.0, atol=atol)


def test_batch_of_one_is_the_one_image_path(detector, images):
    with torch.no_grad():
        single = detector(images[1], SCALES[1])
        together = detector.forward_batch([images[1]], [SCALES[1]])[0]
    for field in FIELDS:
        assert torch.equal(getattr(single, field), getattr(together, field)), field


def test_run_detector_moves_images_to_the_models_device_and_dtype(detector, images):
    with torch.backends.mkldnn.flags(enabled=False):
        expected = detector(images[2], SCALES[2])
        got = run_detector(detector, [images[2].double()], [SCALES[2]], batch_size=2)[0]
    assert got.features.device == next(detector.parameters()).device and got.features.dtype == torch.float32
    assert torch.equal(got.features, expected.features)
    with pytest.raises(ValueError, match="batch_size"):
        run_detector(detector, images, SCALES, batch_size=0)


def _tf32_settings() -> tuple:
    """The convolution and matrix-product precisions in force (per-backend on torch >= 2.9, else the flags)."""
    b = torch.backends
    if hasattr(b.cudnn, "conv"):
        return b.cudnn.conv.fp32_precision, b.cuda.matmul.fp32_precision
    return b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32


def test_detection_is_exact_float32_unless_tf32_is_asked_for(detector, images):
    """On an H200, TF32 convolutions (PyTorch's default) made a batch keep other boxes than its images alone, in
    every image; in float32 the two were bitwise equal (docs/butd.md, TF32). So the detector runs with TF32 off
    unless ``tf32``; seen here through the settings in force at its first convolution and its last linear layer
    (a CPU ignores them; CUDA's arithmetic follows them)."""
    exact = ("ieee", "ieee") if hasattr(torch.backends.cudnn, "conv") else (False, False)
    seen: list[tuple] = []
    hooks = [module.register_forward_pre_hook(lambda *_: seen.append(_tf32_settings()))
             for module in (detector.backbone.stem.conv1, detector.roi_heads.box_predictor.attr_linear2)]
    outside = _tf32_settings()
    try:
        for batch_size in (1, 2):
            seen.clear()
            run_detector(detector, [images[3], images[3]], [SCALES[3]] * 2, batch_size=batch_size)
            assert seen and set(seen) == {exact}, batch_size
        seen.clear()
        run_detector(detector, [images[3]], [SCALES[3]], tf32=True)
        assert seen and set(seen) == {outside} and outside != exact
    finally:
        for hook in hooks:
            hook.remove()
    assert _tf32_settings() == outside


def _random_case(rng: np.random.Generator, num_boxes: int, num_classes: int, sharpness: float):
    xy = rng.uniform(0, 150, size=(num_boxes, 2))
    wh = rng.uniform(4, 60, size=(num_boxes, 2))
    boxes = torch.from_numpy(np.concatenate([xy, xy + wh], axis=1).astype(np.float32))
    logits = torch.from_numpy(rng.standard_normal((num_boxes, num_classes + 1)) * sharpness)
    return boxes, torch.softmax(logits, dim=1).float()


@pytest.mark.parametrize("min_boxes, max_boxes", [(36, 36), (10, 100), (5, 8)])
def test_selection_of_a_batch_equals_each_image_alone(min_boxes, max_boxes):
    rng = np.random.default_rng(min_boxes)
    # sharp, few, flat, none, and a tie-rich case (quantised scores)
    cases = [_random_case(rng, 120, 30, 6.0), _random_case(rng, 20, 30, 3.0), _random_case(rng, 90, 30, 0.3),
             _random_case(rng, 0, 30, 1.0)]
    boxes, probs = _random_case(rng, 70, 30, 4.0)
    cases.append((boxes, (probs * 8).round() / 8))
    boxes, probs = [c[0] for c in cases], [c[1] for c in cases]
    order, kept, max_conf = select_regions_batched(boxes, probs, 0.3, 0.2, min_boxes, max_boxes)
    assert max_conf.shape == (len(cases), 120) and order.shape == (len(cases), min(120, max_boxes))
    for b, (image_boxes, image_probs) in enumerate(cases):
        keep, conf = select_regions(image_boxes, image_probs, 0.3, 0.2, min_boxes, max_boxes)
        assert torch.equal(max_conf[b, : len(image_boxes)], conf)
        assert order[b, : int(kept[b])].tolist() == keep.tolist()


def test_batched_max_conf_rows_are_each_images_own():
    rng = np.random.default_rng(3)
    cases = [_random_case(rng, n, 50, 4.0) for n in (64, 17, 40)]
    rows = per_class_max_conf_batched([c[0] for c in cases], [c[1][:, 1:] for c in cases], prune_every=4)
    for b, (boxes, probs) in enumerate(cases):
        assert torch.equal(rows[b, : len(boxes)], per_class_max_conf(boxes, probs[:, 1:], prune_every=4))
        assert rows[b, len(boxes):].abs().sum() == 0


def test_box_choice_of_a_batch_reads_nothing_back_from_the_device():
    """Pure tensor code: it runs on the meta device, where any host read would fail."""
    conf = torch.empty(3, 50, device="meta")
    order, kept = choose_boxes_batched(conf, [50, 20, 0], 0.2, 10, 36)
    assert order.device.type == "meta" and order.shape == (3, 36) and kept.shape == (3,)
    # and on the CPU it is choose_boxes
    values = torch.rand(3, 50)
    order, kept = choose_boxes_batched(values, [50, 20, 0], 0.2, 10, 36)
    for b, n in enumerate([50, 20, 0]):
        assert order[b, : int(kept[b])].tolist() == choose_boxes(values[b, :n], 0.2, 10, 36).tolist()


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_detector_batch_option_default_record_and_refusal(detector, images, alone):
    """The extractor in groups of 3 and 1 gives, bit for bit, the arrays of each image's one-image forward."""
    from retr.extractors.butd.extractor import BottomUpRegionExtractor, build_butd_regions
    from retr.extractors.butd.preprocess import CaffeImage

    fast = dict(weights="random", pre_nms_topk=600, post_nms_topk=30, pooled_size=7, min_boxes=20, max_boxes=30)
    extractor = build_butd_regions(**fast)
    assert extractor.detector_batch == 1 and extractor.attrs()["detector_batch"] == 1     # CPU default
    # tf32 is recorded as what runs: TF32 exists on CUDA only, so a CPU run with it asked for is exact float32
    faster = build_butd_regions(**fast, tf32=True)
    assert extractor.attrs()["tf32"] is False and faster.tf32 and faster.attrs()["tf32"] is False
    faster.device = torch.device("cuda")                    # (the attribute alone: no CUDA needed to read it)
    assert faster.attrs()["tf32"] is True
    batched = build_butd_regions(**fast, detector_batch=3)                 # groups of 3 and 1
    assert batched.attrs()["detector_batch"] == 3
    # the settings and (seeded) random weights of the `detector` fixture, so `alone` is this extractor's own path
    assert batched.settings == SETTINGS
    reference = detector.state_dict()
    assert all(torch.equal(value, reference[key]) for key, value in batched.network.state_dict().items())
    batch = [CaffeImage(image, scale, (int(image.shape[-2] / scale), int(image.shape[-1] / scale)))
             for image, scale in zip(images, SCALES)]
    with torch.backends.mkldnn.flags(enabled=False):
        together = batched.extract(batch)
    assert together["object_ids"].dtype == np.int32 and together["features"].shape == (4, 30, 2048)
    assert together["num_boxes"].tolist() == [len(r.boxes) for r in alone] == [20, 20, 20, 11]
    for i, r in enumerate(alone):
        n = len(r.boxes)
        expected = {"features": r.features, "boxes": r.boxes, "object_conf": r.cls_prob[:, 1:].max(1).values,
                    "object_ids": r.cls_prob[:, 1:].argmax(1), "attr_conf": r.attr_prob[:, 1:].max(1).values,
                    "attr_ids": r.attr_prob[:, 1:].argmax(1)}
        for key, value in expected.items():
            assert np.array_equal(together[key][i, :n], value.numpy()), (i, key)
            assert not together[key][i, n:].any(), (i, key)                # rows past num_boxes are zeros
        assert together["image_hw"][i].tolist() == list(batch[i].original_hw)
    with pytest.raises(ParameterError, match="detector_batch"):
        BottomUpRegionExtractor(weights="random", detector_batch=0)


def test_detector_batch_is_a_command_line_option_with_its_default():
    from click.testing import CliRunner

    from retr.pipeline.commands.extract import extract_command

    result = CliRunner().invoke(extract_command, ["--help"], terminal_width=200)
    assert result.exit_code == 0
    assert "--detector-batch" in result.output and "default 4 on CUDA, 1 on" in " ".join(result.output.split())
    assert "--tf32" in result.output and "default: exact float32" in " ".join(result.output.split())
