"""The registered ``butd-regions`` extractor: 36 bottom-up-attention regions per image.

Per image: ``features`` [36, 2048], ``boxes`` [36, 4] float32 (x1, y1, x2, y2, original pixels),
``object_ids``/``object_conf`` [36] (0-based over 1,600), ``attr_ids``/``attr_conf`` [36] (over 400), ``num_boxes``,
``image_hw``; rows past ``num_boxes`` are zeros."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from retr.common.downloads import is_offline
from retr.common.errors import MissingResourceError, ParameterError
from retr.common.hashing import sha256_file
from retr.extractors.backbone import resolve_device
from retr.extractors.base import Extractor, register_extractor
from retr.extractors.butd.checkpoint import BUTD_WEIGHTS, LoadReport, fetch_checkpoint, load_weights
from retr.extractors.butd.heads import FEATURE_DIM
from retr.extractors.butd.model import BottomUpAttention, DetectorSettings, Regions, empty_detector, run_detector
from retr.extractors.butd.preprocess import MAX_SIDE, SHORT_SIDE, CaffeImage, load_caffe_image, opencv
from retr.extractors.butd.random_weights import RANDOM, randomize_
from retr.extractors.butd.vocab import NUM_ATTRIBUTES, NUM_OBJECTS, read_vocab
from retr.extractors.spec import ExtractorSpec

#: images per detector forward when ``detector_batch`` is not given, by device type (see docs/butd.md, Batching)
DEFAULT_DETECTOR_BATCH = {"cuda": 4, "cpu": 1}

BACKBONE = "resnet101-c4-caffe (bottom-up-attention Faster R-CNN, Visual Genome)"
#: The checkpoint SCAN's features came from (MILVLG's conversion of the Caffe "fix36" model).
DEFAULT_CHECKPOINT = BUTD_WEIGHTS.entry.filename


def default_checkpoint_candidates() -> list[Path]:
    """Where ``weights=None`` looks, in order: ``$RETR_BUTD_WEIGHTS``, ``$RETR_WEIGHTS/<file>``,
    ``~/.cache/retr/weights/<file>`` (:data:`~retr.extractors.butd.checkpoint.BUTD_WEIGHTS`)."""
    return BUTD_WEIGHTS.candidates()


def default_checkpoint_path() -> Path:
    """Where a downloaded default checkpoint goes: ``$RETR_WEIGHTS/<file>``, else ``~/.cache/retr/weights/<file>``."""
    return BUTD_WEIGHTS.default_path()


def find_default_checkpoint() -> Path | None:
    """The first of :func:`default_checkpoint_candidates` that is a file, or None."""
    return BUTD_WEIGHTS.locate()


def resolve_default_checkpoint(fetch: bool = True, quiet: bool = False) -> str:
    """The default checkpoint's path, downloaded on first use (to :func:`default_checkpoint_path`) unless offline;
    offline and absent, a one-line :class:`MissingResourceError` naming the command that fetches it.

    A real extraction never falls back to random weights silently: ``weights="random"`` must be asked for."""
    found = find_default_checkpoint()
    if found is not None:
        return str(found)
    if fetch and not is_offline():
        return str(fetch_checkpoint(default_checkpoint_path(), quiet=quiet))
    candidates = default_checkpoint_candidates()
    raise MissingResourceError(
        f"bottom-up-attention checkpoint {DEFAULT_CHECKPOINT}", [str(c) for c in candidates],
        f"run retr-pipeline fetch-weights butd on a connected machine (it downloads MILVLG's R101-k36 model, the "
        f"'fix36' model SCAN's features came from) and copy it to {default_checkpoint_path()}, or pass --weights "
        "PATH (the airsplay faster_rcnn_from_caffe_attr.pkl also works with --trust-checkpoint)")


class BottomUpRegionExtractor(Extractor):
    """Caffe preprocessing in workers, the detector and generate_tsv's selection in the main process.

    ``weights``: ``random``, a ``.pth``/``.pkl`` path, or None for :data:`DEFAULT_CHECKPOINT`; ``detector_batch``:
    images per forward (None: :data:`DEFAULT_DETECTOR_BATCH` of the device); ``tf32``: let CUDA use TF32 (faster,
    not the exact float32 of the default). Settings: docs/butd.md."""

    name = "butd-regions"
    kind = "regions"

    def __init__(self, *, weights: str | None = None, device: str = "cpu", half: bool = False,
                 settings: DetectorSettings = DetectorSettings(), short_side: int = SHORT_SIDE,
                 max_side: int = MAX_SIDE, exif_orientation: bool = False, object_vocab: str | None = None,
                 attr_vocab: str | None = None, allow_partial: bool = False, trust_checkpoint: bool = False,
                 detector_batch: int | None = None, tf32: bool = False):
        opencv()  # the pipeline extra, checked here: DataLoader workers read the images with it
        if detector_batch is not None and detector_batch < 1:
            raise ParameterError(f"detector_batch must be at least 1, not {detector_batch}", "detector_batch")
        if settings.min_boxes < 1 or settings.max_boxes < settings.min_boxes:
            raise ParameterError(f"need 1 ≤ min_boxes ≤ max_boxes, got {settings.min_boxes} and "
                                 f"{settings.max_boxes}", "min_boxes", "max_boxes")
        if settings.post_nms_topk < settings.max_boxes:
            raise ParameterError(f"post_nms_topk ({settings.post_nms_topk}) must be at least max_boxes "
                                 f"({settings.max_boxes})", "post_nms_topk", "max_boxes")
        if short_side < 16 or max_side < short_side:
            raise ParameterError(f"need 16 ≤ short_side ≤ max_side, got {short_side} and {max_side}",
                                 "short_side", "max_side")
        if weights is None:
            weights = resolve_default_checkpoint()
        self.half = bool(half)
        self.device = resolve_device(device, self.half)
        self.requested_detector_batch = detector_batch
        self.tf32 = bool(tf32)                      # asked for; recorded as what runs (CUDA only, see attrs)
        self.settings = settings
        self.short_side, self.max_side, self.exif_orientation = short_side, max_side, bool(exif_orientation)
        self.object_names = read_vocab(object_vocab, NUM_OBJECTS, "object") if object_vocab else None
        self.attr_names = read_vocab(attr_vocab, NUM_ATTRIBUTES, "attribute") if attr_vocab else None
        # every parameter is overwritten below, so skip the default init unless a partial load may leave gaps
        self.network = (BottomUpAttention(settings) if allow_partial and weights != "random"
                        else empty_detector(settings)).eval()
        self.network.requires_grad_(False)
        self.load_report: LoadReport | None = None
        if weights == "random":
            randomize_(self.network)
            self.weights = "random"
        else:
            self.load_report = load_weights(self.network, weights, allow_partial=allow_partial,
                                            trust_checkpoint=trust_checkpoint)
            self.weights = f"{Path(weights).name} sha256:{sha256_file(weights)}"
        self.to(self.device)

    @property
    def feature_shape(self) -> tuple[int, int]:
        return (self.settings.max_boxes, FEATURE_DIM)

    @property
    def extras(self) -> dict[str, tuple[tuple[int, ...], str]]:
        k = self.settings.max_boxes
        return {"boxes": ((k, 4), "float32"), "object_ids": ((k,), "int32"), "object_conf": ((k,), "float32"),
                "attr_ids": ((k,), "int32"), "attr_conf": ((k,), "float32"), "num_boxes": ((), "int32"),
                "image_hw": ((2,), "int32")}

    def attrs(self) -> dict[str, Any]:
        s = self.settings
        attrs: dict[str, Any] = {
            "kind": self.kind, "extractor": self.name, "backbone": BACKBONE, "weights": self.weights,
            "image_size": f"short side {self.short_side}, long side <= {self.max_side}",
            "short_side": self.short_side, "max_side": self.max_side,
            "preprocessing": "Caffe: BGR, minus pixel means [102.9801, 115.9465, 122.7717], bilinear resize",
            "exif_orientation": self.exif_orientation, "half": self.half,
            "detector_settings": json.dumps(s.__dict__, sort_keys=True),
            "detector_batch": self.detector_batch, "tf32": self.tf32 and self.device.type == "cuda",
            "min_boxes": s.min_boxes, "max_boxes": s.max_boxes, "conf_threshold": s.conf_threshold,
            "object_ids_base": "0-based into the 1600 Visual Genome objects (network class id - 1)",
            "attr_ids_base": "0-based into the 400 Visual Genome attributes (network attribute id - 1)",
        }
        if self.object_names is not None:
            attrs["object_vocab"] = self.object_names
        if self.attr_names is not None:
            attrs["attr_vocab"] = self.attr_names
        if self.load_report is not None:
            attrs["checkpoint_load"] = self.load_report.summary()
        return attrs

    # -- worker side --------------------------------------------------------------------------------------
    def load(self, path: str) -> CaffeImage:
        return load_caffe_image(path, self.short_side, self.max_side, exif=self.exif_orientation)

    def collate(self, samples: list[CaffeImage]) -> list[CaffeImage]:
        """The batch is the list itself (sizes differ); :meth:`extract` pads ``detector_batch`` at a time."""
        return list(samples)

    # -- main process -------------------------------------------------------------------------------------
    def to(self, device: torch.device | str) -> "BottomUpRegionExtractor":
        self.device = resolve_device(device, self.half)
        self.network.to(self.device, dtype=torch.float16 if self.half else torch.float32)
        return self

    @property
    def detector_batch(self) -> int:
        """Images per detector forward: the requested number, else :data:`DEFAULT_DETECTOR_BATCH` of the device."""
        if self.requested_detector_batch is not None:
            return self.requested_detector_batch
        return DEFAULT_DETECTOR_BATCH.get(self.device.type, 1)

    def regions(self, image: CaffeImage) -> Regions:
        """The kept regions of one preprocessed image (float32 outputs)."""
        return self.regions_batched([image], 1)[0]

    def regions_batched(self, images: list[CaffeImage], batch_size: int | None = None) -> list[Regions]:
        """The kept regions of each image, ``batch_size`` (default :attr:`detector_batch`) per forward; tensors
        stay on the device (see :func:`retr.extractors.butd.model.run_detector`)."""
        return run_detector(self.network, [image.pixels for image in images], [image.scale for image in images],
                            self.detector_batch if batch_size is None else batch_size, tf32=self.tf32)

    def extract(self, batch: list[CaffeImage]) -> dict[str, np.ndarray]:
        k, b = self.settings.max_boxes, len(batch)
        features = torch.zeros((b, k, FEATURE_DIM), device=self.device)
        boxes = torch.zeros((b, k, 4), device=self.device)
        conf = torch.zeros((2, b, k), device=self.device)                      # object, attribute
        ids = torch.zeros((2, b, k), dtype=torch.int64, device=self.device)
        regions = self.regions_batched(batch)
        for i, r in enumerate(regions):
            n = len(r.boxes)
            features[i, :n], boxes[i, :n] = r.features, r.boxes.float()
            conf[0, i, :n], ids[0, i, :n] = r.cls_prob[:, 1:].max(dim=1)
            conf[1, i, :n], ids[1, i, :n] = r.attr_prob[:, 1:].max(dim=1)
        # one device-to-host copy per output for the whole batch
        conf_host, ids_host = conf.cpu().numpy(), ids.cpu().numpy().astype(np.int32)
        return {"features": features.cpu().numpy(), "boxes": boxes.cpu().numpy(),
                "object_ids": ids_host[0], "object_conf": conf_host[0],
                "attr_ids": ids_host[1], "attr_conf": conf_host[1],
                "num_boxes": np.asarray([len(r.boxes) for r in regions], np.int32).reshape(b),
                "image_hw": np.asarray([image.original_hw for image in batch], np.int32).reshape(b, 2)}


def build_butd_regions(weights: str | None = None, device: str = "cpu", half: bool = False,
                       exif_orientation: bool = False, min_boxes: int = 36, max_boxes: int = 36,
                       conf_threshold: float = 0.2, short_side: int = SHORT_SIDE, max_side: int = MAX_SIDE,
                       pre_nms_topk: int = 6000, post_nms_topk: int = 300, pooled_size: int = 14,
                       object_vocab: str | None = None, attr_vocab: str | None = None,
                       allow_partial: bool = False, trust_checkpoint: bool = False,
                       detector_batch: int | None = None, tf32: bool = False,
                       **unused: Any) -> BottomUpRegionExtractor:
    """Bottom-up-attention regions; defaults are the original's (600/1000, 6000/300, 14×14 pool, 36/36, 0.2).

    Smaller sizes are speed options (the demo's); other extractors' options are refused unless None."""
    given = sorted(name for name, value in unused.items() if value is not None)
    if given:
        raise ParameterError(f"butd-regions does not take {', '.join(given)}", *given)
    settings = DetectorSettings(pre_nms_topk=pre_nms_topk, post_nms_topk=post_nms_topk, pooled_size=pooled_size,
                                conf_threshold=conf_threshold, min_boxes=min_boxes, max_boxes=max_boxes)
    return BottomUpRegionExtractor(weights=weights, device=device, half=half, settings=settings,
                                   short_side=short_side, max_side=max_side, exif_orientation=exif_orientation,
                                   object_vocab=object_vocab, attr_vocab=attr_vocab, allow_partial=allow_partial,
                                   trust_checkpoint=trust_checkpoint, detector_batch=detector_batch, tf32=tf32)


register_extractor(ExtractorSpec(
    name="butd-regions", builder=build_butd_regions, kind="regions",
    output=lambda options: (options["max_boxes"], FEATURE_DIM),
    weights=BUTD_WEIGHTS, extra="pipeline", requires=("cv2",), random=RANDOM))
