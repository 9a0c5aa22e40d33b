"""Golden figures of the bottom-up-attention detector computed by MILVLG's port; run by hand, never by CI.

MILVLG/bottom-up-attention.pytorch runs the Caffe model on detectron2 v0.2.1 (its ``detectron2`` submodule,
commit be792b959bca9af0aacfa04799537856c7a92802 = tag v0.2.1). Both need C++ extensions built against the torch
in use, on the CPU only. Usage (scratch checkouts and a separate virtual environment outside this repository;
the figures were made at the commits in provenance.json)::

    git clone https://github.com/MILVLG/bottom-up-attention.pytorch /tmp/authors/bua
    git clone https://github.com/facebookresearch/detectron2 /tmp/authors/detectron2
    git -C /tmp/authors/detectron2 checkout v0.2.1
    python3.11 -m venv /tmp/d2venv          # torch, torchvision, numpy, OpenCV: the project's, via a .pth
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/d2venv/lib/python3.11/site-packages/zz_retr.pth
    /tmp/d2venv/bin/pip install -c constraints.txt fvcore yacs tabulate termcolor cloudpickle iopath pycocotools
    OMP_NUM_THREADS=1 MAX_JOBS=1 nice -n 10 /tmp/d2venv/bin/python tools/golden/butd.py \\
        /tmp/authors/bua /tmp/authors/detectron2 [--build-cache /tmp/butd-build-cache]

It copies both checkouts to temporary folders, applies :data:`BUA_PATCHES` / :data:`D2_PATCHES`, builds their
extensions in place (``setup.py build_ext --inplace``, CPU only: ``FORCE_CUDA`` unset, CUDA hidden; with
``--build-cache`` the built ``.so`` files are kept and reused while the commits, patches and torch are the same)
and runs their extraction path for the fix-36 model on the CPU:

* their ``utils/extract_features_singlegpu.py``: ``setup(args)`` with ``--mode caffe --extract-mode roi_feats
  --min-max-boxes 36,36 --config-file configs/caffe/test-caffe-r101-fix36.yaml MODEL.DEVICE cpu
  MODEL.WEIGHTS <the seeded weights written as a .pth>``, then ``extract_feat_singlegpu`` over a folder holding
  the two stored images as PNG (lossless: ``cv2.imread`` gives back the stored pixels): ``DefaultTrainer.build_model``,
  ``DetectionCheckpointer(...).resume_or_load``, ``get_image_blob`` (mean subtraction, 600/1000 scale, bilinear
  resize), ``GeneralizedBUARCNN`` (BUARPN 6000/300 — here 6000/50, :data:`POST_NMS_TOPK` — ROIPool 14×14, res5
  dilation 2, attribute head) and
  ``save_roi_features`` (class NMS 0.3 for every class, conf 0.2, 36/36), whose ``.npz`` files are read back;
* a forward hook on their model (added at run time, not a source patch) records what ``model([dataset_dict])``
  returned to their loop: all 50 proposals, their class and attribute probabilities.

Weights: no checkpoint can be downloaded here, and a 250 MB state dict is not stored. :func:`golden_state` makes
a deterministic random state dict in MILVLG's key layout from a seed (each tensor from its own generator seeded
by the seed and the key's CRC-32, so neither key order nor thread count matters); ``tests/test_golden_butd.py``
imports this module to make the same dict. The scales are chosen so that the network is far from degenerate:
activations of order 1 (random BN statistics, He fan-in convolutions, residual branches scaled by 0.2; the stem
norm's variance matches the mean-subtracted pixels'), foreground − background objectness logits of spread ~1
(foreground probabilities 0.67–0.99 over the top 6,000: none saturates at 1.0, where float32 ties would leave the
proposals to the sort's tie order — a first recipe with 4× larger objectness weights did exactly that), and class
logits spread enough that each box's best class has probability 0.3–0.9 and ~80 boxes per image pass the 0.2
threshold (distinct ``max_conf``, so the kept boxes and their order are decided by the scores, not by ties).
Per-tensor sums and absolute sums are stored, so a changed recipe is caught before any comparison.

Writes ``tests/data/golden/butd/``:

* ``inputs.npz`` — ``image.a`` [120, 160, 3] and ``image.b`` [96, 210, 3] uint8 BGR (smooth seeded noise with
  rectangles; ``b`` hits the 1000-pixel cap: scale 1000/210), ``post_nms_topk``, ``weights.seed``, ``weights.names``,
  ``weights.sum``, ``weights.abs_sum`` (float64, per key);
* ``figures.npz`` — per image ``x`` in (a, b): ``x.scale``, ``x.proposals`` [50, 4] (resized pixels, their order),
  ``x.proposal_object_{ids,conf}`` / ``x.proposal_attr_{ids,conf}`` [50] (argmax / max over classes 1… of the
  probabilities their model returned, 0-based), and from their ``.npz``: ``x.features`` [36, 2048] float32,
  ``x.boxes`` [36, 4] (original pixels), ``x.object_ids``, ``x.object_conf``, ``x.attr_ids``, ``x.attr_conf``
  (``info``), ``x.num_boxes``, and ``x.keep`` [36] (the index in ``x.proposals`` of each kept box, found by
  matching their boxes to their proposals).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Patch, patched_copy, write_figures  # noqa: E402

REPOSITORY = "https://github.com/MILVLG/bottom-up-attention.pytorch"
DETECTRON2 = "https://github.com/facebookresearch/detectron2"
DETECTRON2_COMMIT = "be792b959bca9af0aacfa04799537856c7a92802"   # v0.2.1, MILVLG's submodule pointer

WEIGHTS_SEED = 20261125
IMAGE_SEED = 7
IMAGE_SHAPES = {"a": (120, 160), "b": (96, 210)}
IMAGES = tuple(IMAGE_SHAPES)
MIN_MAX_BOXES = 36
#: proposals kept after the RPN's NMS: the config's 300, lowered with their own option
#: (``MODEL.RPN.POST_NMS_TOPK_TEST``) because res5 on every proposal is the test's cost (300: 65 s of the suite's CPU
#: time, 100: 25 s, 50: 19 s). The same code runs per proposal; their top 50 are the first 50 of their 100 and 300,
#: in the same order, and all 50 pass the 0.2 threshold, so 36 of them are chosen by confidence.
POST_NMS_TOPK = 50

BUA_PATCHES = [
    Patch("bua/caffe/modeling/layers/csrc/nms/nms_cpu.cpp",
          'AT_DISPATCH_FLOATING_TYPES(dets.type(), "nms", [&] {',
          'AT_DISPATCH_FLOATING_TYPES(dets.scalar_type(), "nms", [&] {',
          "current torch's AT_DISPATCH macros take a ScalarType; the DeprecatedTypeProperties overload is gone "
          "(compile error). Same dispatch on the same dtype"),
    Patch("bua/caffe/modeling/layers/nms.py",
          "from apex import amp\nimport torch\n\n# Only valid with fp32 inputs - give AMP the hint\n"
          "nms = amp.float_function(_C.nms)",
          "import torch\n\n# Only valid with fp32 inputs - give AMP the hint\nnms = _C.nms",
          "NVIDIA apex is not installed (a CUDA build); amp.float_function only casts half inputs to float when "
          "AMP is active, and every input here is float32, so it is the bare _C.nms"),
    Patch("utils/__init__.py",
          "from .utils import save_features\nfrom .extract_features_faster import extract_feat_faster_start\n"
          "from .extract_features_multigpu import extract_feat_multigpu_start\n"
          "from .extract_features_singlegpu import extract_feat_singlegpu_start\n"
          "from .extract_d2features import extract_feat_d2_start",
          "from .utils import save_features\n"
          "from .extract_features_singlegpu import extract_feat_singlegpu_start",
          "the package imports its ray-based multi-process extractors (faster, multigpu, d2) on import; ray is "
          "not installed and those paths are not run (the single-GPU script is the one used)"),
    Patch("utils/extract_features_singlegpu.py",
          "from utils.progress_bar import ProgressBar\n", "",
          "progress_bar.py imports ray at module level; ProgressBar is imported but never used by this script"),
]

D2_PATCHES = [
    Patch("detectron2/data/transforms/transform.py",
          "def __init__(self, src_rect, output_size, interp=Image.LINEAR, fill=0):",
          "def __init__(self, src_rect, output_size, interp=Image.BILINEAR, fill=0):",
          "Pillow 10 removed the alias Image.LINEAR (= Image.BILINEAR, the same constant 2); the default argument "
          "is evaluated when detectron2.data is imported (AttributeError). ExtentTransform is not on the "
          "extraction path"),
]


# -- the shared inputs (also imported by tests/test_golden_butd.py) ----------------------------------------------
def golden_images(seed: int = IMAGE_SEED) -> dict[str, np.ndarray]:
    """Two small BGR uint8 images: smooth noise around the pixel means plus a few flat rectangles."""
    rng = np.random.default_rng(seed)
    images = {}
    for name, (h, w) in IMAGE_SHAPES.items():
        coarse = rng.normal(0.0, 1.0, (h // 8 + 2, w // 8 + 2, 3))
        ys, xs = np.linspace(0, coarse.shape[0] - 1.001, h), np.linspace(0, coarse.shape[1] - 1.001, w)
        y0, x0 = ys.astype(int), xs.astype(int)
        fy, fx = (ys - y0)[:, None, None], (xs - x0)[None, :, None]
        smooth = (coarse[y0][:, x0] * (1 - fy) * (1 - fx) + coarse[y0 + 1][:, x0] * fy * (1 - fx)
                  + coarse[y0][:, x0 + 1] * (1 - fy) * fx + coarse[y0 + 1][:, x0 + 1] * fy * fx)
        image = np.array([110.0, 118.0, 124.0]) + 45.0 * smooth + rng.normal(0.0, 6.0, (h, w, 3))
        for _ in range(4):
            y1, x1 = rng.integers(0, h - 20), rng.integers(0, w - 20)
            y2, x2 = y1 + rng.integers(12, h // 2), x1 + rng.integers(12, w // 2)
            image[y1:y2, x1:x2] = rng.uniform(20, 235, 3)
        images[name] = np.clip(np.rint(image), 0, 255).astype(np.uint8)
    return images


#: ``proposal_generator.anchor_generator.cell_anchors.0`` as MILVLG's converted checkpoints carry it: the Caffe
#: ``generate_anchors()`` table (base 16, ratios 0.5/1/2 × scales 4/8/16/32, ratio-major, centre 7.5). Their code
#: depends on the file for it: the config's ``ANCHOR_GENERATOR.SIZES [[4, 8, 16, 32]]`` makes detectron2's
#: ``DefaultAnchorGenerator`` build 4–32-pixel, size-major anchors, and the checkpoint's buffer replaces them on
#: load (the only order consistent with the converted Caffe RPN weights is Caffe's own). retr ignores the key.
CAFFE_ANCHORS = np.array([
    [-38, -16, 53, 31], [-84, -40, 99, 55], [-176, -88, 191, 103], [-360, -184, 375, 199],
    [-24, -24, 39, 39], [-56, -56, 71, 71], [-120, -120, 135, 135], [-248, -248, 263, 263],
    [-14, -36, 29, 51], [-36, -80, 51, 95], [-80, -168, 95, 183], [-168, -344, 183, 359]], dtype=np.float32)
ANCHORS_KEY = "proposal_generator.anchor_generator.cell_anchors.0"


def _fan_in(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape[1:]))


def golden_tensor(name: str, shape: tuple[int, ...], seed: int = WEIGHTS_SEED):
    """One tensor of the seeded state dict (float32, CPU); depends only on ``seed``, ``name`` and ``shape``."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    n = lambda std: torch.randn(shape, generator=g) * std                          # noqa: E731
    u = lambda lo, hi: lo + (hi - lo) * torch.rand(shape, generator=g)             # noqa: E731
    branch_end = ".conv3.norm." in name        # the last norm of a residual branch: scaled down (33 branches add)
    stem = name.startswith("backbone.stem.")
    if name.endswith(".norm.weight"):
        return u(0.8, 1.2) * (0.2 if branch_end else 1.0)
    if name.endswith(".norm.bias"):
        return n(0.05) * (0.2 if branch_end else 1.0)
    if name.endswith(".norm.running_mean"):
        return n(10.0 if stem else 0.1)
    if name.endswith(".norm.running_var"):
        return u(0.5, 1.5) * (6e3 if stem else 1.0)          # stem: He conv of ±60-pixel inputs has variance ~6e3
    head = name.rsplit(".", 1)[0]
    if name.endswith(".weight") and len(shape) == 4:            # convolutions
        if head.endswith("objectness_logits"):     # foreground − background logits ~N(0, 1): no saturated 1.0s
            return n(0.35 / np.sqrt(_fan_in(shape)))
        if head.endswith("anchor_deltas"):
            return n(0.1 / np.sqrt(_fan_in(shape)))
        return n(np.sqrt(2.0 / _fan_in(shape)))
    if name.endswith(".bias") and len(shape) == 1 and "rpn_head" in name:
        return n(0.2 if head.endswith("objectness_logits") else 0.05)
    if head.endswith("cls_embed"):
        return n(1.0)
    if head.endswith("cls_score"):
        return n(3.0 / np.sqrt(shape[-1])) if name.endswith(".weight") else n(0.5)
    if head.endswith("attr_linear2"):
        return n(3.0 / np.sqrt(shape[-1])) if name.endswith(".weight") else n(0.5)
    if head.endswith("attr_linear1"):
        return n(np.sqrt(2.0 / shape[-1])) if name.endswith(".weight") else n(0.1)
    if head.endswith("bbox_pred"):
        return n(0.001) if name.endswith(".weight") else torch.zeros(shape)
    raise KeyError(f"no recipe for {name} {tuple(shape)}")


def golden_state(shapes: dict[str, tuple[int, ...]], seed: int = WEIGHTS_SEED) -> dict:
    """The seeded state dict for the given key → shape map (MILVLG's key layout)."""
    return {name: golden_tensor(name, tuple(shape), seed) for name, shape in shapes.items()}


def state_checksums(state: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    names = sorted(state)
    sums = np.array([state[k].double().sum().item() for k in names])
    abs_sums = np.array([state[k].double().abs().sum().item() for k in names])
    return np.array(names), sums, abs_sums


# -- building their extensions -----------------------------------------------------------------------------------
def _build(copy: Path, products: list[str], cache: Path | None, key: str) -> None:
    """``setup.py build_ext --inplace`` in ``copy`` (CPU only), or the cached products of the same key."""
    cached = cache / key if cache else None
    if cached and all((cached / p).is_file() for p in products):
        for p in products:
            shutil.copy2(cached / p, copy / p)
        print(f"reusing built extensions from {cached}")
        return
    env = {k: v for k, v in os.environ.items() if k != "FORCE_CUDA"}
    env.update(CUDA_VISIBLE_DEVICES="", MAX_JOBS=env.get("MAX_JOBS", "1"))
    subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=copy, env=env, check=True)
    if cached:
        for p in products:
            (cached / p).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(copy / p, cached / p)


def _build_key(source: Path, patches: list[Patch]) -> str:
    """What the built extension depends on: the commit, the patches of its C++ sources, torch and Python."""
    import torch
    from common import commit_of

    native = [p.__dict__ for p in patches if p.path.endswith((".cpp", ".h", ".cu", "setup.py"))]
    parts = [commit_of(source), json.dumps(native), torch.__version__, sys.version]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


# -- running their extraction ------------------------------------------------------------------------------------
def run_authors(bua: Path, d2: Path, cache: Path | None) -> tuple[dict, dict, dict]:
    import torch

    bua_copy, d2_copy = patched_copy(bua, BUA_PATCHES), patched_copy(d2, D2_PATCHES)
    from common import commit_of
    d2_products = ["detectron2/_C" + _ext_suffix()]
    bua_products = ["bua/caffe/modeling/_C" + _ext_suffix()]
    _build(d2_copy, d2_products, cache / "detectron2" if cache else None, _build_key(d2, D2_PATCHES))
    _build(bua_copy, bua_products, cache / "bua" if cache else None, _build_key(bua, BUA_PATCHES))

    sys.path[:0] = [str(bua_copy), str(d2_copy)]
    os.chdir(bua_copy)                        # their scripts use paths relative to the repository root
    import detectron2
    assert Path(detectron2.__file__).resolve().is_relative_to(d2_copy.resolve()), detectron2.__file__
    import utils.extract_features_singlegpu as single   # their single-GPU extraction script

    work = Path(tempfile.mkdtemp(prefix="butd-golden-"))
    images = golden_images()
    image_dir, out_dir = work / "images", work / "features"
    image_dir.mkdir()
    out_dir.mkdir()
    import cv2
    for name, image in images.items():
        assert cv2.imwrite(str(image_dir / f"{name}.png"), image)

    # build their model once to learn its keys (the seeded state is made for exactly the learned ones)
    argv = ["--mode", "caffe", "--extract-mode", "roi_feats", "--min-max-boxes", f"{MIN_MAX_BOXES},{MIN_MAX_BOXES}",
            "--config-file", "configs/caffe/test-caffe-r101-fix36.yaml", "--image-dir", str(image_dir),
            "--out-dir", str(out_dir), "--gpus", "", "MODEL.DEVICE", "cpu", "OUTPUT_DIR", str(work / "output"),
            "MODEL.WEIGHTS", str(work / "golden-weights.pth"), "MODEL.RPN.POST_NMS_TOPK_TEST", str(POST_NMS_TOPK)]
    args = _their_args(single, argv)
    cfg = single.setup(args)
    model = single.DefaultTrainer.build_model(cfg)
    # not learned: the config's pixel mean/std and BatchNorm's batch counters (absent from MILVLG's files), and
    # the anchors (written below as the Caffe table, CAFFE_ANCHORS)
    unlearned = ("pixel_mean", "pixel_std", "num_batches_tracked", ANCHORS_KEY)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if not any(u in k for u in unlearned)}
    print("not in the seeded state:", [k for k in model.state_dict() if k not in shapes and
                                       not k.endswith("num_batches_tracked")])
    del model
    state = golden_state(shapes)
    torch.save({"model": {**state, ANCHORS_KEY: torch.from_numpy(CAFFE_ANCHORS)}}, work / "golden-weights.pth")
    names, sums, abs_sums = state_checksums(state)

    returned: list = []
    build_model = single.DefaultTrainer.build_model

    def build_and_record(config):
        built = build_model(config)
        built.register_forward_hook(lambda module, inputs, output: returned.append(
            (inputs[0][0]["im_scale"], [t.detach().clone() for t in _flat(output)])))
        return built

    single.DefaultTrainer.build_model = build_and_record
    order = sorted(os.listdir(image_dir))
    single.extract_feat_singlegpu(0, order, cfg, args)      # their loop (it disables gradients itself)
    assert len(returned) == len(order)

    figures = {}
    for file, (scale, (proposals, probs, features, attr_probs)) in zip(order, returned):
        x = Path(file).stem
        saved = np.load(out_dir / f"{x}.npz", allow_pickle=True)   # their own output; info is a pickled dict
        info = saved["info"].item()
        boxes = saved["bbox"]
        dets = (proposals / scale).numpy()
        keep = np.array([int(np.flatnonzero((dets == b).all(axis=1))[0]) for b in boxes])
        figures.update({
            f"{x}.scale": np.float64(scale), f"{x}.proposals": proposals.numpy().astype(np.float32),
            f"{x}.proposal_object_ids": probs[:, 1:].argmax(1).numpy().astype(np.int32),
            f"{x}.proposal_object_conf": probs[:, 1:].max(1).values.numpy().astype(np.float32),
            f"{x}.proposal_attr_ids": attr_probs[:, 1:].argmax(1).numpy().astype(np.int32),
            f"{x}.proposal_attr_conf": attr_probs[:, 1:].max(1).values.numpy().astype(np.float32),
            f"{x}.features": np.asarray(saved["x"], np.float32), f"{x}.boxes": np.asarray(boxes, np.float32),
            f"{x}.object_ids": np.asarray(info["objects_id"], np.int32),
            f"{x}.object_conf": np.asarray(info["objects_conf"], np.float32),
            f"{x}.attr_ids": np.asarray(info["attrs_id"], np.int32),
            f"{x}.attr_conf": np.asarray(info["attrs_conf"], np.float32),
            f"{x}.num_boxes": np.int32(saved["num_bbox"]), f"{x}.keep": keep.astype(np.int32),
        })
        assert np.array_equal(features[keep].numpy(), saved["x"])
    inputs = {f"image.{k}": v for k, v in images.items()}
    inputs.update({"anchors": CAFFE_ANCHORS, "post_nms_topk": np.int64(POST_NMS_TOPK), "weights.seed": np.int64(WEIGHTS_SEED), "weights.names": names, "weights.sum": sums,
                   "weights.abs_sum": abs_sums})
    notes = {"detectron2": DETECTRON2, "detectron2_commit": commit_of(d2), "their_argv": argv,
             "threads": torch.get_num_threads(), "weights": "golden_state(seed) in tools/golden/butd.py"}
    return inputs, figures, notes


def _flat(output):
    boxes, scores, features, attrs = output
    return [boxes[0].tensor, scores[0], features[0], attrs[0]]


def _ext_suffix() -> str:
    import sysconfig
    return sysconfig.get_config_var("EXT_SUFFIX")


def _their_args(single, argv: list[str]) -> argparse.Namespace:
    """Their ``main()``'s argument parser, on ``argv`` (the parser is built inside main: rebuilt here from it)."""
    saved = sys.argv
    sys.argv = ["extract_features_singlegpu.py", *argv]
    captured = {}
    original = single.extract_feat_singlegpu_start
    original_setup = single.setup
    single.extract_feat_singlegpu_start = lambda args, cfg: captured.setdefault("args", args)
    single.setup = lambda args: captured.setdefault("args", args)
    try:
        single.main()
    finally:
        sys.argv = saved
        single.extract_feat_singlegpu_start = original
        single.setup = original_setup
    return captured["args"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("bua", type=Path, help="checkout of MILVLG/bottom-up-attention.pytorch")
    parser.add_argument("detectron2", type=Path, help="checkout of facebookresearch/detectron2 at v0.2.1")
    parser.add_argument("--build-cache", type=Path, default=None, help="keep/reuse the built extensions here")
    args = parser.parse_args()
    from common import commit_of
    if commit_of(args.detectron2) not in (DETECTRON2_COMMIT, "unknown (not a git checkout)"):
        raise SystemExit(f"detectron2 must be at v0.2.1 ({DETECTRON2_COMMIT}), not {commit_of(args.detectron2)}")
    bua, d2 = args.bua.resolve(), args.detectron2.resolve()
    inputs, figures, notes = run_authors(bua, d2, args.build_cache.resolve() if args.build_cache else None)
    folder = write_figures("butd", repository=REPOSITORY, source=bua, patches=BUA_PATCHES + D2_PATCHES,
                           inputs=inputs, figures=figures, notes=json.dumps(notes))
    print(f"wrote {folder}")


if __name__ == "__main__":
    main()
