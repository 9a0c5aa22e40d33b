"""Loading the converted bottom-up-attention checkpoints: MILVLG ``.pth`` (key for key) and airsplay ``.pkl``
(mapped by :func:`airsplay_to_caffe`); restricted unpicklers unless ``trust_checkpoint``.

Formats, safety, the download's checks and partial loads: docs/butd.md ("Checkpoints")."""
from __future__ import annotations

import io
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from retr.common.errors import MissingResourceError, UserError
from retr.extractors.butd.heads import NUM_ATTRIBUTE_CLASSES, NUM_OBJECT_CLASSES
from retr.extractors.weights import UrlWeights, load_torch_file
from retr.extractors.butd.model import BottomUpAttention

#: keys of the MILVLG/detectron2 files that carry nothing this model learns (ignored, reported)
IGNORED_KEYS = re.compile(r"^(pixel_mean|pixel_std|proposal_generator\.anchor_generator\.cell_anchors\.\d+)$")
#: where the weights come from, for the "missing file" message
WEIGHTS_HOW = ("run retr-pipeline fetch-weights butd on a connected machine (it downloads "
               "bua-caffe-frcn-r101-k36.pth from the MILVLG/bottom-up-attention.pytorch model zoo), or download "
               "faster_rcnn_from_caffe_attr.pkl from airsplay/py-bottom-up-attention, and pass its path to --weights")
NUM_ANCHORS = 12
_ANCHOR_RATIOS, _ANCHOR_SCALES = 3, 4


@dataclass
class LoadReport:
    """What happened when a state dict was loaded into the detector."""

    loaded: int
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = [f"{self.loaded} tensors loaded"]
        for label, names in (("missing", self.missing), ("unexpected", self.unexpected),
                             ("ignored", self.ignored)):
            if names:
                parts.append(f"{len(names)} {label} ({', '.join(names[:3])}{', …' if len(names) > 3 else ''})")
        return "; ".join(parts)


# -- reading files ---------------------------------------------------------------------------------------
class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles NumPy arrays and plain containers only (what a converted-weights pickle holds)."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_airsplay_pickle(path: str | Path, trust_checkpoint: bool = False) -> dict[str, np.ndarray]:
    """The ``{name: ndarray}`` of an airsplay/detectron2 ``.pkl`` (under ``"model"`` or bare)."""
    data = Path(path).read_bytes()
    try:
        if trust_checkpoint:
            obj = pickle.loads(data, encoding="latin1")
        else:
            obj = _ArrayUnpickler(io.BytesIO(data), encoding="latin1").load()
    except pickle.UnpicklingError as exc:
        raise UserError(f"{path} holds Python objects beyond arrays ({exc}); if you trust the file, set "
                        f"trust_checkpoint", parameters=["trust_checkpoint"]) from None
    except Exception as exc:  # noqa: BLE001 - a broken pickle can raise almost anything
        raise UserError(f"{path} is not a readable pickle ({type(exc).__name__}: {exc})") from None
    if isinstance(obj, Mapping) and isinstance(obj.get("model"), Mapping):
        obj = obj["model"]
    if not isinstance(obj, Mapping):
        raise UserError(f"{path} does not hold a dict of weights")
    return {str(k): np.asarray(v) for k, v in obj.items()}


def read_pth(path: str | Path, trust_checkpoint: bool = False) -> dict[str, torch.Tensor]:
    """The state dict of a ``.pth`` file (bare, or under ``"model"``/``"state_dict"``)."""
    obj = load_torch_file(path, "a PyTorch checkpoint", weights_only=not trust_checkpoint,
                          trust_parameter="trust_checkpoint", numpy_arrays=True)
    for key in ("model", "state_dict"):
        if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
            obj = obj[key]
            break
    if not isinstance(obj, Mapping):
        raise UserError(f"{path} does not hold a state dict")
    return {str(k): torch.as_tensor(v) for k, v in obj.items()}


# -- airsplay → Caffe layout -------------------------------------------------------------------------------
def _anchor_order_d2_to_caffe() -> list[int]:
    """detectron2 anchors are size-major (size s, ratio r → s·3 + r); Caffe's are ratio-major (r·4 + s)."""
    return [s * _ANCHOR_RATIOS + r for r in range(_ANCHOR_RATIOS) for s in range(_ANCHOR_SCALES)]


def airsplay_to_caffe(weights: Mapping[str, np.ndarray | torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map an airsplay (detectron2-layout) state dict onto this model's Caffe-layout names and orders (docs/butd.md,
    "Checkpoints")."""
    out: dict[str, torch.Tensor] = {}
    order = torch.tensor(_anchor_order_d2_to_caffe())
    prefix = "roi_heads.box_predictor."
    for name, value in weights.items():
        tensor = torch.as_tensor(np.asarray(value)).clone()
        if name.startswith(prefix):
            leaf = name[len(prefix):]
            if leaf.startswith("cls_score.") or leaf.startswith("cls_embedding."):
                tensor = torch.cat([tensor[-1:], tensor[:-1]])             # background last → first
                leaf = leaf.replace("cls_embedding.", "cls_embed.")
            elif leaf.startswith("bbox_pred."):
                tensor = torch.cat([torch.zeros_like(tensor[:4]), tensor])  # add background rows
            elif leaf.startswith("fc_attr."):
                leaf = leaf.replace("fc_attr.", "attr_linear1.")
            elif leaf.startswith("attr_score."):
                tensor = torch.cat([tensor[-1:], tensor[:-1]])             # no-attribute last → first
                leaf = leaf.replace("attr_score.", "attr_linear2.")
            name = prefix + leaf
        elif name.startswith("proposal_generator.rpn_head.objectness_logits."):
            fg = tensor[order]
            tensor = torch.cat([torch.zeros_like(fg), fg])
        elif name.startswith("proposal_generator.rpn_head.anchor_deltas."):
            tensor = tensor.reshape(NUM_ANCHORS, 4, *tensor.shape[1:])[order].reshape(tensor.shape)
        out[name] = tensor
    return out


# -- putting weights into the model ------------------------------------------------------------------------
def load_into(model: nn.Module, state: Mapping[str, torch.Tensor], allow_partial: bool = False,
              source: str = "checkpoint") -> LoadReport:
    """Copy ``state`` into ``model`` key for key; refuse (``UserError``) a partial or mismatched load."""
    given, report = check_state(model.state_dict(), state, allow_partial, source)
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in given.items() if k in own}, strict=False)
    return report


def check_state(own: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], allow_partial: bool = False,
                source: str = "checkpoint") -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Compare ``state`` with the model's own state dict ``own`` (meta tensors do: only names and shapes count);
    ``(the tensors to load, the report)``, or a one-line ``UserError`` for a partial or mismatched state."""
    ignored = sorted(k for k in state if IGNORED_KEYS.match(k))
    given = {k: v for k, v in state.items() if not IGNORED_KEYS.match(k)}
    missing = sorted(k for k in own if k not in given)
    unexpected = sorted(k for k in given if k not in own)
    mismatched = [f"{k} {tuple(given[k].shape)} vs {tuple(own[k].shape)}" for k in sorted(given)
                  if k in own and tuple(given[k].shape) != tuple(own[k].shape)]
    if mismatched:
        raise UserError(f"{source}: {len(mismatched)} tensors have the wrong shape (e.g. {mismatched[0]}); "
                        f"is this a bottom-up-attention ResNet-101 checkpoint with {NUM_OBJECT_CLASSES} classes "
                        f"and {NUM_ATTRIBUTE_CLASSES} attributes?")
    report = LoadReport(loaded=len(given) - len(unexpected), missing=missing, unexpected=unexpected,
                        ignored=ignored)
    if (missing or unexpected) and not allow_partial:
        raise UserError(f"{source} does not match the detector: {report.summary()}; set allow_partial to "
                        f"load it anyway", parameters=["allow_partial"])
    return given, report


def load_weights(model: nn.Module, path: str | Path, allow_partial: bool = False,
                 trust_checkpoint: bool = False) -> LoadReport:
    """Load a MILVLG ``.pth`` or airsplay ``.pkl`` file into ``model`` (format chosen by the suffix)."""
    path = Path(path)
    if not path.is_file():
        raise MissingResourceError(f"bottom-up-attention weights {path.name}", str(path.resolve().parent),
                                   WEIGHTS_HOW)
    if path.suffix == ".pkl":
        state = airsplay_to_caffe(read_airsplay_pickle(path, trust_checkpoint))
    else:
        state = read_pth(path, trust_checkpoint)
    return load_into(model, state, allow_partial=allow_partial, source=str(path))


# -- download ------------------------------------------------------------------------------------------------
def read_checkpoint(path: str | Path, trust_checkpoint: bool = False, suffix: str | None = None
                    ) -> dict[str, torch.Tensor]:
    """The Caffe-layout state dict of a MILVLG ``.pth`` or airsplay ``.pkl`` (format by ``suffix``, default the
    path's own)."""
    if (suffix or Path(path).suffix) == ".pkl":
        return airsplay_to_caffe(read_airsplay_pickle(path, trust_checkpoint))
    return read_pth(path, trust_checkpoint)


def check_checkpoint_file(path: str | Path, suffix: str = ".pth") -> LoadReport:
    """Refuse (one-line ``UserError``) a file that does not load into the detector key for key and shape for
    shape — without allocating the detector (the comparison runs against its ``meta`` tensors)."""
    with torch.device("meta"):
        own = BottomUpAttention().state_dict()
    _given, report = check_state(own, read_checkpoint(path, suffix=suffix), source=Path(path).name)
    return report


#: The default checkpoint (MILVLG's R101-k36, SOURCES["butd"]): ``$RETR_BUTD_WEIGHTS``, else
#: ``$RETR_WEIGHTS/bua-caffe-frcn-r101-k36.pth`` (default ``~/.cache/retr/weights``); a download is checked by a
#: strict key-and-shape load (:func:`check_checkpoint_file`) before it takes its name.
BUTD_WEIGHTS = UrlWeights(source="butd", env="RETR_BUTD_WEIGHTS", validate=check_checkpoint_file)


def fetch_checkpoint(dest: str | Path, quiet: bool = False, mirror: str | None = None) -> Path:
    """Download the MILVLG R101-k36 checkpoint to ``dest`` (unless it is there), checked before the rename: the
    server's length, then a strict key-and-shape load (:func:`check_checkpoint_file`). Offline: the one-line
    :class:`MissingResourceError` naming ``retr-pipeline fetch-weights butd``."""
    return BUTD_WEIGHTS.download(dest, quiet=quiet, mirror=mirror)
