"""CLIP image features through open_clip: ``clip-vit-b-32``, ``clip-vit-b-16``, ``clip-vit-l-14``,
``clip-vit-l-14-336`` (:data:`FAMILY`), kind ``clip``, ``[1 + P, D]`` per image.

Row 0 is the projected image embedding — exactly open_clip's ``encode_image`` (not L2-normalised; zero-shot
scoring normalises it). Rows ``1..P`` are the final layer's patch tokens in raster order (``P = (S / patch)²``:
49, 196, 256, 576), put through the same ``ln_post`` and projection, so every row is ``D``-dimensional
(``embed_dim``: 512 for ViT-B, 768 for ViT-L) and SCAN-style models train on them like on regions.

Preprocessing is CLIP's: short side resized to ``S`` (bicubic, antialiased), centre ``S×S`` crop, CLIP's channel
statistics. ``S`` is the architecture's (224; 336 for ViT-L/14@336px), not an option: the position embeddings fix it.

``weights``: ``openai`` (default) or another open_clip pretrained tag of the architecture, read from the Hugging
Face cache (``open_clip_model.safetensors`` or ``open_clip_pytorch_model.bin`` of the tag's hub repository, what
``open_clip.create_model(..., pretrained=TAG)`` downloads), downloaded there on first use; offline, one line
names the folder and ``retr-pipeline fetch-weights clip-…``. ``random``: open_clip's initialisation of the whole
model under :data:`~retr.extractors.weights.RANDOM_SEED` (tests, demos). A path: a safetensors or ``torch.save``
state dict of the whole CLIP model with open_clip's key names. OpenAI's weights use QuickGELU; ``random`` and
files build the OpenAI architecture too, other tags their own activation (recorded as ``quick_gelu``).

The text tower is built from the same recorded attributes (:func:`clip_from_attrs`), for zero-shot scoring.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torchvision.transforms.functional as TF
import torchvision.transforms.v2.functional as TV2
from torch import nn
from torchvision.transforms import InterpolationMode

from retr.common.downloads import is_offline
from retr.common.errors import ParameterError, UserError
from retr.common.hashing import sha256_file
from retr.common.optional import require
from retr.extractors.backbone import BackboneExtractor
from retr.extractors.base import needed_by, register_extractor
from retr.extractors.images import check_aspect, decode_image, normalize_uint8, to_normalized_tensor
from retr.extractors.spec import ExtractorSpec, RandomInit, WeightSource
from retr.extractors.timm_weights import (cached_hub_file, download_hub_file, hf_hub_cache, missing_hub_weights,
                                          read_weights_file)
from retr.extractors.weights import RANDOM_SEED, LoadedWeights, load_checked, seeded_random_model

#: extractor name → open_clip architecture
FAMILY = {"clip-vit-b-32": "ViT-B-32", "clip-vit-b-16": "ViT-B-16", "clip-vit-l-14": "ViT-L-14",
          "clip-vit-l-14-336": "ViT-L-14-336"}
#: extractor name → ``(1 + P, D)`` of its features (what :func:`geometry` reads from open_clip's configs)
OUTPUT = {"clip-vit-b-32": (50, 512), "clip-vit-b-16": (197, 512), "clip-vit-l-14": (257, 768),
          "clip-vit-l-14-336": (577, 768)}
DEFAULT_WEIGHTS = "openai"
#: open_clip's files of a pretrained tag on the hub, in the order open_clip prefers them (the first is downloaded)
HUB_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
#: the extra that installs open_clip, and the fetch-weights name of the four weight files (not part of ``all``:
#: 4.6 GB that no preset needs)
EXTRA = GROUP = "clip"
#: ``random``: open_clip's initialisation of the OpenAI architecture (QuickGELU)
RANDOM = RandomInit("open_clip", {"force_quick_gelu": True})


def open_clip():
    return require("open_clip", EXTRA, f"{needed_by('open_clip')} and retr-train eval-clip")


def geometry(arch: str) -> dict[str, int]:
    """``image_size``, ``patch_size``, ``grid_size``, ``tokens`` (1 + P) and ``embed_dim`` of ``arch``, from
    open_clip's model config (no network built)."""
    cfg = open_clip().get_model_config(arch)
    size, patch = int(cfg["vision_cfg"]["image_size"]), int(cfg["vision_cfg"]["patch_size"])
    return {"image_size": size, "patch_size": patch, "grid_size": size // patch,
            "tokens": 1 + (size // patch) ** 2, "embed_dim": int(cfg["embed_dim"])}


def _hub_id(arch: str, tag: str) -> str:
    cfg = open_clip().get_pretrained_cfg(arch, tag)
    if not cfg or not cfg.get("hf_hub"):
        tags = ", ".join(open_clip().list_pretrained_tags_by_model(arch))
        raise ParameterError(f"weights {tag!r} is neither 'random', an open_clip pretrained tag of {arch} ({tags}) "
                             f"nor an existing safetensors or state-dict file", "weights")
    return cfg["hf_hub"].strip("/")


def fetch_clip_weights(arch: str, tag: str = DEFAULT_WEIGHTS, quiet: bool = False) -> Path:
    """The cached open_clip file of ``arch`` / ``tag``, downloaded into the Hugging Face cache first when absent
    (offline: the one-line :class:`MissingResourceError` naming ``retr-pipeline fetch-weights``)."""
    repo = _hub_id(arch, tag)
    found = cached_hub_file(repo, HUB_FILES)
    if found is not None:
        return found
    if is_offline():
        name = next(n for n, a in FAMILY.items() if a == arch)
        raise missing_hub_weights(f"open_clip weights {arch} {tag}", repo, HUB_FILES[0],
                                  f"import open_clip; open_clip.create_model('{arch}', pretrained='{tag}')",
                                  name if tag == DEFAULT_WEIGHTS else None)
    return download_hub_file(repo, HUB_FILES[0], quiet)


def _create(arch: str, quick_gelu: bool) -> nn.Module:
    """open_clip's ``arch`` with its own initialisation under :data:`RANDOM_SEED` (the caller's random state
    untouched; open_clip's 'no pretrained weights' warning kept off the log)."""
    before = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(RANDOM_SEED)
            return open_clip().create_model(arch, pretrained=None, force_quick_gelu=quick_gelu)
    finally:
        logging.disable(before)


def build_clip(arch: str, weights: str) -> tuple[nn.Module, LoadedWeights]:
    """open_clip's whole CLIP model ``arch`` in eval mode with ``weights`` loaded (see the module docstring)."""
    if arch not in FAMILY.values():
        raise ParameterError(f"{arch!r} is not a CLIP architecture retr knows ({', '.join(FAMILY.values())})", "arch")
    path, quick_gelu = Path(weights), True
    if weights == "random":
        model = seeded_random_model((RANDOM.library, arch), lambda: _create(arch, RANDOM.options["force_quick_gelu"]))
        name, attrs = "random", {"weights_seed": RANDOM_SEED}
    elif path.is_file():
        model = _create(arch, True)
        load_checked(model, read_weights_file(path), str(path), arch)
        name, attrs = f"sha256:{sha256_file(path)}", {"weights_file": path.name}
    else:
        # the recorded identity (the tag's hub repository, e.g. timm/vit_base_patch32_clip_224.openai) names its tag
        weights = next((tag for tag in open_clip().list_pretrained_tags_by_model(arch)
                        if (open_clip().get_pretrained_cfg(arch, tag).get("hf_hub") or "").strip("/") == weights),
                       weights)
        found = fetch_clip_weights(arch, weights)
        quick_gelu = bool(open_clip().get_pretrained_cfg(arch, weights).get("quick_gelu", False))
        model = _create(arch, quick_gelu)
        load_checked(model, read_weights_file(found), str(found), arch)
        name = _hub_id(arch, weights)
        attrs = {"weights_file": found.name, "weights_revision": found.parent.name, "clip_pretrained": weights}
    default = open_clip().get_pretrained_cfg(arch, DEFAULT_WEIGHTS)    # OpenAI's statistics unless a tag has its own
    cfg = {**default, **open_clip().get_pretrained_cfg(arch, attrs.get("clip_pretrained", DEFAULT_WEIGHTS))}
    attrs.update(clip_model=arch, quick_gelu=quick_gelu)
    return model.eval().requires_grad_(False), LoadedWeights(name, attrs, tuple(cfg["mean"]), tuple(cfg["std"]))


def clip_from_attrs(attrs: dict, weights: str | None = None) -> nn.Module:
    """The CLIP model a ``clip`` feature set was extracted with, rebuilt from its attributes ``attrs``: the same
    random initialisation, the same pretrained tag, or — for weights read from a file — ``weights``, the path of
    that file (its sha256 must be the recorded one)."""
    arch, recorded = attrs.get("clip_model"), str(attrs.get("weights", ""))
    if attrs.get("kind") != "clip" or arch not in FAMILY.values():
        raise UserError(f"the feature set was made by {attrs.get('extractor')!r}, not a clip extractor "
                        f"({', '.join(FAMILY)})")
    if recorded.startswith("sha256:"):
        if weights is None:
            raise UserError(f"the features were extracted with the weights file {attrs.get('weights_file')} "
                            f"({recorded[:19]}…): pass it as --weights", parameters=["weights"])
        if f"sha256:{sha256_file(weights)}" != recorded:
            raise UserError(f"{weights} is not the weights file the features were extracted with "
                            f"({attrs.get('weights_file')}, {recorded[:19]}…)", parameters=["weights"])
        spec = weights
    else:
        spec = "random" if recorded == "random" else attrs.get("clip_pretrained")
    model, _ = build_clip(arch, str(spec))
    return model


@dataclass(frozen=True)
class ClipResize:
    """CLIP's preprocessing: short side to ``size`` (bicubic, antialiased), centre crop ``size×size``, normalise.
    ``__call__(path)`` returns ``[3, size, size]`` float32."""

    size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    exif_orientation: bool = False

    def __call__(self, path: str) -> torch.Tensor:
        image = decode_image(path, self.exif_orientation)
        check_aspect(*image.size)
        image = TF.resize(image, [self.size], interpolation=InterpolationMode.BICUBIC, antialias=True)
        return to_normalized_tensor(TF.center_crop(image, [self.size, self.size]), self.mean, self.std)

    def from_decoded(self, image: torch.Tensor) -> torch.Tensor:
        """The same as tensor ops: ``[3, H, W]`` uint8 RGB → ``[3, size, size]`` float32 (on its device)."""
        image = TV2.resize(image, [self.size], interpolation=InterpolationMode.BICUBIC, antialias=True)
        return normalize_uint8(TV2.center_crop(image, [self.size, self.size]), self.mean, self.std)


class ClipTokens(nn.Module):
    """open_clip's vision tower → ``[B, 1 + P, D]``: the projected embedding, then the projected patch tokens."""

    def __init__(self, visual: nn.Module):
        super().__init__()
        visual.output_tokens = True         # forward returns (projected pooled [B, D], ln_post tokens [B, P, W])
        self.visual = visual

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        pooled, tokens = self.visual(images)
        return torch.cat([pooled[:, None], tokens @ self.visual.proj], dim=1)


class ClipExtractor(BackboneExtractor):
    """A CLIP vision tower: images ``[B, 3, S, S]`` → features ``[B, 1 + P, D]`` (module docstring)."""

    kind = "clip"

    def __init__(self, *, name: str, weights: str, device: str, half: bool, exif_orientation: bool, decode: str,
                 autocast: str, channels_last: bool, tf32: bool = False):
        self.name, self.geometry, self.exif_orientation = name, geometry(FAMILY[name]), exif_orientation
        size = self.geometry["image_size"]

        def builder(arch: str, weights: str, unused_prefixes=()) -> tuple[nn.Module, LoadedWeights]:
            model, loaded = build_clip(arch, weights)
            return ClipTokens(model.visual), loaded

        super().__init__(arch=FAMILY[name], node="visual.ln_post+proj (every token)", weights=weights,
                         preprocess=lambda mean, std: ClipResize(size, mean, std, exif_orientation), device=device,
                         half=half, builder=builder, cut=False, decode=decode, autocast=autocast,
                         channels_last=channels_last, tf32=tf32)

    @property
    def feature_shape(self) -> tuple[int, int]:
        return (self.geometry["tokens"], self.geometry["embed_dim"])

    def to_features(self, output: torch.Tensor, batch_size: int) -> torch.Tensor:
        return output

    def extra_attrs(self) -> dict[str, Any]:
        g = self.geometry
        return {**g, "token_layout": "row 0: projected image embedding (open_clip encode_image); rows 1..P: final-"
                                     "layer patch tokens in raster order after ln_post and the projection",
                "preprocessing": f"resize short side to {g['image_size']} (bicubic, antialiased), centre crop "
                                 f"{g['image_size']}x{g['image_size']}, CLIP normalisation",
                "exif_orientation": self.exif_orientation}


@dataclass(frozen=True, kw_only=True)
class OpenClipWeights(WeightSource):
    """open_clip's pretrained tag ``tag`` of ``arch`` (``ViT-B-32`` / ``openai``), cached by ``huggingface_hub`` in
    the Hugging Face cache (:func:`fetch_clip_weights`)."""

    arch: str
    tag: str = DEFAULT_WEIGHTS

    @property
    def recorded(self) -> str:
        return _hub_id(self.arch, self.tag)

    def locate(self) -> Path | None:
        return cached_hub_file(_hub_id(self.arch, self.tag), HUB_FILES)

    def fetch(self, quiet: bool = False, mirror: str | None = None) -> Path:
        return fetch_clip_weights(self.arch, self.tag, quiet=quiet)

    def looked_in(self) -> str:
        return str(hf_hub_cache())


def _register(name: str) -> None:
    def build(weights: str = DEFAULT_WEIGHTS, device: str = "cpu", half: bool = False, exif_orientation: bool = False,
              decode: str = "auto", autocast: str = "none", channels_last: bool = False,
              tf32: bool = False) -> ClipExtractor:
        return ClipExtractor(name=name, weights=weights, device=device, half=half, exif_orientation=exif_orientation,
                             decode=decode, autocast=autocast, channels_last=channels_last, tf32=tf32)
    build.__doc__ = f"open_clip {FAMILY[name]}: projected embedding + projected patch tokens per image."
    register_extractor(ExtractorSpec(
        name=name, builder=build, kind="clip", output=OUTPUT[name],
        weights=OpenClipWeights(source=name, arch=FAMILY[name], group=GROUP),   # SOURCES keys are the names
        extra=EXTRA, requires=("open_clip",), random=RANDOM))


for _name in FAMILY:
    _register(_name)
