"""butd-regions arithmetic: the Caffe anchor table, "+1" boxes and NMS, generate_tsv's selection, preprocessing."""
from __future__ import annotations

import io

import cv2
import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.ops import nms

from retr.extractors.base import ImageError
from retr.extractors.butd.anchors import caffe_cell_anchors, shift_anchors
from retr.extractors.butd.boxes import clip_boxes, decode_deltas, keep_min_size, legacy_nms
from retr.extractors.butd.preprocess import PIXEL_MEANS_BGR, caffe_scale, load_caffe_image, read_bgr
from retr.extractors.butd.selection import choose_boxes, per_class_max_conf, select_regions

# The table of reference/butd.md, ratio-major (0.5, 1, 2) × scales (4, 8, 16, 32).
CAFFE_ANCHORS = [
    [-38, -16, 53, 31], [-84, -40, 99, 55], [-176, -88, 191, 103], [-360, -184, 375, 199],
    [-24, -24, 39, 39], [-56, -56, 71, 71], [-120, -120, 135, 135], [-248, -248, 263, 263],
    [-14, -36, 29, 51], [-36, -80, 51, 95], [-80, -168, 95, 183], [-168, -344, 183, 359],
]


def test_anchor_table_is_the_caffe_one():
    assert caffe_cell_anchors().tolist() == CAFFE_ANCHORS


def test_shifted_anchors_are_in_height_width_anchor_order():
    cell = caffe_cell_anchors()
    anchors = shift_anchors(cell, height=2, width=3).reshape(2, 3, 12, 4)
    assert torch.equal(anchors[0, 0], cell)
    assert torch.equal(anchors[1, 2], cell + torch.tensor([32.0, 16.0, 32.0, 16.0]))
    assert torch.equal(anchors[0, 1, 5], cell[5] + torch.tensor([16.0, 0.0, 16.0, 0.0]))


def test_decode_uses_plus_one_widths():
    anchors = torch.tensor([[0.0, 0.0, 15.0, 15.0]])  # 16×16, centre 8
    assert decode_deltas(anchors, torch.zeros(1, 4)).tolist() == [[0.0, 0.0, 16.0, 16.0]]
    moved = decode_deltas(anchors, torch.tensor([[0.5, -0.25, float(np.log(2.0)), 0.0]]))
    assert torch.allclose(moved, torch.tensor([[0.0, -4.0, 32.0, 12.0]]))  # centre (16, 4), size 32×16


def test_clip_and_min_size():
    boxes = torch.tensor([[-5.0, -3.0, 120.0, 60.0], [10.0, 10.0, 24.0, 40.0], [10.0, 10.0, 25.0, 25.0]])
    assert clip_boxes(boxes, height=50, width=100)[0].tolist() == [0.0, 0.0, 99.0, 49.0]
    assert keep_min_size(boxes, 16.0).tolist() == [0, 2]  # box 1 is 15 wide ("+1")


def reference_legacy_nms(boxes: np.ndarray, scores: np.ndarray, threshold: float) -> list[int]:
    """py-faster-rcnn's ``py_cpu_nms``, written out plainly."""
    x1, y1, x2, y2 = boxes.T
    areas = (x2 - x1 + 1) * (y2 - y1 + 1)
    order = list(np.argsort(-scores, kind="stable"))
    keep = []
    while order:
        i = order.pop(0)
        keep.append(int(i))
        remaining = []
        for j in order:
            w = max(0.0, min(x2[i], x2[j]) - max(x1[i], x1[j]) + 1)
            h = max(0.0, min(y2[i], y2[j]) - max(y1[i], y1[j]) + 1)
            inter = w * h
            if inter / (areas[i] + areas[j] - inter) <= threshold:
                remaining.append(j)
        order = remaining
    return keep


def random_boxes(rng: np.random.Generator, n: int, extent: float = 300.0) -> np.ndarray:
    xy = rng.uniform(0, extent, size=(n, 2))
    wh = rng.uniform(1, extent / 2, size=(n, 2))
    return np.concatenate([xy, xy + wh], axis=1).astype(np.float32)


@pytest.mark.parametrize("threshold", [0.3, 0.7])
def test_legacy_nms_equals_the_plain_reference(threshold):
    rng = np.random.default_rng(1)
    for _ in range(5):
        boxes = random_boxes(rng, 200)
        scores = rng.random(200).astype(np.float32)
        got = legacy_nms(torch.from_numpy(boxes), torch.from_numpy(scores), threshold).tolist()
        assert got == reference_legacy_nms(boxes, scores, threshold)


def test_legacy_nms_differs_from_plain_nms_on_small_boxes():
    # Two boxes [0, 4] and [3, 7] (5 px wide with "+1"): IoU 10/40 = 0.25 with +1 areas, 4/28 = 0.14 without.
    boxes = torch.tensor([[0.0, 0.0, 4.0, 4.0], [3.0, 0.0, 7.0, 4.0]])
    scores = torch.tensor([0.9, 0.8])
    assert legacy_nms(boxes, scores, 0.2).tolist() == [0]
    assert nms(boxes, scores, 0.2).tolist() == [0, 1]


def reference_selection(boxes, cls_prob, nms_threshold=0.3, conf_threshold=0.2, min_boxes=36, max_boxes=36):
    """generate_tsv's loop: NMS per class on the shared boxes, max_conf, threshold, MIN/MAX boxes."""
    boxes = np.asarray(boxes, dtype=np.float32)
    scores = np.asarray(cls_prob, dtype=np.float32)
    max_conf = np.zeros(len(boxes), dtype=np.float32)
    for c in range(1, scores.shape[1]):
        keep = reference_legacy_nms(boxes, scores[:, c], nms_threshold) if len(boxes) else []
        for i in keep:
            if scores[i, c] > max_conf[i]:
                max_conf[i] = scores[i, c]
    keep_boxes = [i for i in range(len(boxes)) if max_conf[i] >= conf_threshold]
    by_conf = sorted(range(len(boxes)), key=lambda i: (-max_conf[i], i))
    if len(keep_boxes) < min_boxes:
        keep_boxes = by_conf[:min_boxes]
    elif len(keep_boxes) > max_boxes:
        keep_boxes = by_conf[:max_boxes]
    return keep_boxes, max_conf


@pytest.mark.parametrize("num_boxes, num_classes, sharpness, min_boxes, max_boxes", [
    (120, 40, 3.0, 36, 36),   # usual case
    (20, 30, 3.0, 36, 36),    # fewer proposals than 36: every box, by confidence
    (150, 25, 0.3, 36, 36),   # flat scores: nothing reaches 0.2 → top 36 by max_conf
    (150, 25, 6.0, 10, 100),  # in range: kept in proposal order
    (150, 25, 6.0, 5, 8),     # above MAX: top MAX by confidence
])
def test_batched_selection_equals_the_per_class_loop(num_boxes, num_classes, sharpness, min_boxes, max_boxes):
    rng = np.random.default_rng(num_boxes + num_classes)
    boxes = random_boxes(rng, num_boxes, extent=200.0)
    logits = rng.standard_normal((num_boxes, num_classes + 1)) * sharpness
    cls_prob = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    expected_keep, expected_conf = reference_selection(boxes, cls_prob, min_boxes=min_boxes, max_boxes=max_boxes)
    keep, max_conf = select_regions(torch.from_numpy(boxes), torch.from_numpy(cls_prob.astype(np.float32)),
                                    min_boxes=min_boxes, max_boxes=max_boxes)
    assert np.array_equal(max_conf.numpy(), expected_conf)
    assert keep.tolist() == expected_keep
    assert len(keep) == min(num_boxes, max(min_boxes, min(max_boxes, int((expected_conf >= 0.2).sum()))))


def test_batched_max_conf_equals_torchvision_per_class_loop_on_1600_classes():
    rng = np.random.default_rng(7)
    boxes = torch.from_numpy(random_boxes(rng, 120, extent=400.0))
    scores = torch.softmax(torch.from_numpy(rng.standard_normal((120, 1600)).astype(np.float32)) * 4, dim=1)
    expected = torch.zeros(120)
    for c in range(1600):
        keep = nms(boxes + torch.tensor([0.0, 0.0, 1.0, 1.0]), scores[:, c], 0.3)
        expected[keep] = torch.maximum(expected[keep], scores[keep, c])
    assert torch.equal(per_class_max_conf(boxes, scores), expected)
    assert torch.equal(per_class_max_conf(boxes, scores, prune_every=10_000), expected)  # no pruning


def test_choose_boxes_with_ties_prefers_lower_index():
    conf = torch.tensor([0.1, 0.5, 0.1, 0.1, 0.5])
    assert choose_boxes(conf, conf_threshold=0.2, min_boxes=3, max_boxes=3).tolist() == [1, 4, 0]


# -- preprocessing -----------------------------------------------------------------------------------------
def test_caffe_scale_600_1000():
    assert caffe_scale(480, 640) == 600 / 480
    assert caffe_scale(300, 1000) == 1000 / 1000          # 600/300·1000 = 2000 > 1000
    assert caffe_scale(375, 500) == 600 / 375
    assert caffe_scale(1, 1) == 600.0


def _write(path, image: Image.Image, **save):
    image.save(path, **save)
    return path


def test_preprocess_is_bgr_mean_subtracted_and_scaled(tmp_path):
    path = _write(tmp_path / "red.png", Image.new("RGB", (40, 30), (200, 10, 50)))
    image = load_caffe_image(path)
    assert image.scale == 600 / 30
    assert image.original_hw == (30, 40)
    assert tuple(image.pixels.shape) == (3, 600, 800)
    expected = np.array([50, 10, 200], np.float32) - np.array(PIXEL_MEANS_BGR, np.float32)
    assert np.allclose(image.pixels.mean(dim=(1, 2)).numpy(), expected, atol=1e-3)


def test_resize_happens_after_mean_subtraction_with_opencv_bilinear(tmp_path):
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, size=(37, 53, 3), dtype=np.uint8)
    path = _write(tmp_path / "noise.png", Image.fromarray(rgb))
    image = load_caffe_image(path, short_side=50, max_side=1000)
    bgr = rgb[:, :, ::-1].astype(np.float32) - np.array(PIXEL_MEANS_BGR, np.float32)
    expected = cv2.resize(bgr, None, None, fx=50 / 37, fy=50 / 37, interpolation=cv2.INTER_LINEAR)
    assert np.array_equal(image.pixels.numpy(), expected.transpose(2, 0, 1))


def test_exif_orientation_is_an_explicit_choice(tmp_path):
    image = Image.new("RGB", (60, 20), (0, 0, 255))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° when displayed
    path = tmp_path / "rotated.jpg"
    image.save(path, exif=exif.tobytes(), quality=95)
    assert read_bgr(path, exif=False).shape == (20, 60, 3)
    assert read_bgr(path, exif=True).shape == (60, 20, 3)


@pytest.mark.parametrize("content, reason", [
    (b"", "empty file"),
    (b"this is not an image", "cannot decode"),
])
def test_unusable_files_raise_image_error(tmp_path, content, reason):
    path = tmp_path / "bad.jpg"
    path.write_bytes(content)
    with pytest.raises(ImageError, match=reason):
        read_bgr(path)


def test_truncated_jpeg_and_missing_file(tmp_path):
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 200, 30)).save(buffer, format="JPEG")
    path = tmp_path / "cut.jpg"
    path.write_bytes(buffer.getvalue()[:-200])
    with pytest.raises(ImageError, match="truncated"):
        read_bgr(path)
    with pytest.raises(ImageError, match="not found"):
        read_bgr(tmp_path / "absent.jpg")


def test_grayscale_cmyk_and_one_pixel_images_decode_to_bgr(tmp_path):
    gray = read_bgr(_write(tmp_path / "g.png", Image.new("L", (5, 4), 77)))
    assert gray.shape == (4, 5, 3) and (gray == 77).all()
    cmyk = read_bgr(_write(tmp_path / "c.jpg", Image.new("CMYK", (8, 8), (0, 255, 255, 0))))
    assert cmyk.shape == (8, 8, 3)
    one = load_caffe_image(_write(tmp_path / "one.png", Image.new("RGB", (1, 1), (1, 2, 3))))
    assert tuple(one.pixels.shape) == (3, 600, 600)
