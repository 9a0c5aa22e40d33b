"""Zero-shot CLIP (``retr-train eval-clip``): captions through CLIP's text tower, scored against the image
embeddings a ``clip`` feature set stores (row 0), ranked with the protocols every model is evaluated with
(:mod:`retr.trainers.evaluation.metrics`). Nothing is trained, so there is no run folder: the text tower is
rebuilt from the feature set's recorded attributes (:func:`retr.extractors.clip.clip_from_attrs`).

Scores are cosine similarities in float64 (both sides L2-normalised), so every rank is exact. Captions go
through open_clip's own tokenizer (lower-cased BPE, 77 tokens), each distinct text encoded once, so identical
captions tie exactly; ``prompt`` is prepended (the CLIP paper prepends "a photo of", Table 13's caption).
"""
from __future__ import annotations

import logging
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from retr.common.devices import resolve_device
from retr.common.errors import UserError
from retr.common.progress import progress
from retr.manifests.schema import read_manifest
from retr.store.features import FeatureSet
from retr.trainers.evaluation.metrics import protocol_metrics
from retr.trainers.data.splits import SplitData
from retr.trainers.data.pairing import check_manifest_pairing
from retr.trainers.evaluation.metrics import check_evaluation_split
from retr.common.hashing import sha256_file

logger = logging.getLogger(__name__)

#: what the CLIP paper prepends to every caption for zero-shot retrieval (Radford et al. 2021, Table 13)
DEFAULT_PROMPT = "a photo of"


def image_embeddings(features: FeatureSet, image_ids: list[str], block: int = 256) -> np.ndarray:
    """``[N, D]`` float64, L2-normalised: row 0 (the projected image embedding) of each image's features."""
    rows = features.rows_of(image_ids)
    out = np.concatenate([features.read_rows(rows[s:s + block])[:, 0].astype(np.float64)
                          for s in range(0, len(rows), block)])
    return out / np.linalg.norm(out, axis=1, keepdims=True)


@torch.no_grad()
def text_embeddings(model, arch: str, texts: list[str], device: torch.device, batch_size: int = 256,
                    quiet: bool = True) -> np.ndarray:
    """``[M, D]`` float64, L2-normalised: ``model.encode_text`` of ``texts`` (open_clip's tokenizer for ``arch``),
    each distinct text encoded once."""
    from retr.extractors.clip import open_clip  # cost: torchvision, which retr-train loads only for CLIP

    tokenizer = open_clip().get_tokenizer(arch)
    distinct = list(dict.fromkeys(texts))
    model = model.to(device)
    blocks = [model.encode_text(tokenizer(distinct[s:s + batch_size]).to(device)).double().cpu().numpy()
              for s in progress(range(0, len(distinct), batch_size), desc="encode captions", quiet=quiet)]
    encoded = np.concatenate(blocks)
    encoded /= np.linalg.norm(encoded, axis=1, keepdims=True)
    where = {text: i for i, text in enumerate(distinct)}
    return encoded[[where[t] for t in texts]]


def check_clip_inputs(features: FeatureSet, manifest: str, protocol: str, split: str = "test",
                      weights: str | None = None, allow_size_mismatch: bool = False) -> list[str]:
    """Everything :func:`evaluate_clip` would refuse, checked before the text tower is built or a caption encoded:
    a set no clip extractor made, ``weights`` given for a set not extracted from a weights file (random weights or
    a pretrained tag: the file would not be used) or a file that is not the recorded one (sha256), the split
    (present, every image with features, the protocol's size unless ``allow_size_mismatch``), and ``manifest``
    against the one the features were made from
    (:func:`~retr.trainers.data.pairing.check_manifest_pairing`). Returns the notes."""
    from retr.extractors.clip import FAMILY  # cost: torchvision

    attrs = features.attrs
    if attrs.get("kind") != "clip" or attrs.get("clip_model") not in FAMILY.values():
        raise UserError(f"the feature set was made by {attrs.get('extractor')!r}, not a clip extractor "
                        f"({', '.join(FAMILY)})")
    recorded = str(attrs.get("weights", ""))
    if weights is not None:
        if not recorded.startswith("sha256:"):
            made = ("a randomly initialised CLIP" if recorded == "random" else
                    f"CLIP's pretrained tag {attrs.get('clip_pretrained') or recorded!r}")
            raise UserError(f"{features.path} was extracted from {made}, not from a file: weights {weights} would "
                            "be ignored; leave it out", parameters=["weights"])
        if not Path(weights).is_file():
            raise UserError(f"weights file {weights} does not exist", parameters=["weights"])
        if f"sha256:{sha256_file(weights)}" != recorded:
            raise UserError(f"{weights} is not the weights file the features were extracted with "
                            f"({attrs.get('weights_file')}, {recorded[:19]}…)", parameters=["weights"])
    elif recorded.startswith("sha256:"):
        raise UserError(f"the features were extracted with the weights file {attrs.get('weights_file')} "
                        f"({recorded[:19]}…): pass it as --weights", parameters=["weights"])
    check_evaluation_split(features, manifest, split, protocol, allow_size_mismatch)
    return check_manifest_pairing(features, manifest)


def evaluate_clip(features: str, manifest: str, protocol: str, split: str = "test", weights: str | None = None,
                  prompt: str = DEFAULT_PROMPT, device: str = "auto", allow_size_mismatch: bool = False,
                  ties: str = "pessimistic", batch_size: int = 256, quiet: bool = False) -> tuple[dict, np.ndarray]:
    """Zero-shot CLIP on ``split`` of ``manifest`` with the image embeddings of ``features``; ``weights``: the
    weights file, when the features were extracted from one. Every input is checked first
    (:func:`check_clip_inputs`). Returns ``(result, sims [N_img, M] float64)``."""
    from retr.extractors.clip import clip_from_attrs  # cost: torchvision

    feature_set = FeatureSet(features)
    for note in check_clip_inputs(feature_set, manifest, protocol, split, weights, allow_size_mismatch):
        logger.warning(f"note: {note}")
    records = read_manifest(manifest, splits=[split])
    model = clip_from_attrs(feature_set.attrs, weights)
    model.visual = None                                     # only the text tower runs
    captions = [c for r in records for c in r.captions]
    owner = np.repeat(np.arange(len(records)), [len(r.captions) for r in records])
    data = SplitData([r.id for r in records], captions, owner.astype(np.int64), [[] for _ in captions])
    texts = [f"{prompt} {c}" if prompt else c for c in captions]
    arch = feature_set.attrs["clip_model"]
    sims = image_embeddings(feature_set, data.image_ids) @ text_embeddings(
        model, arch, texts, resolve_device(device), batch_size, quiet).T
    result = protocol_metrics(sims, data, protocol, allow_size_mismatch, ties)
    result.update(protocol=protocol, split=split, model="clip-zero-shot", clip_model=arch, prompt=prompt,
                  weights=feature_set.attrs.get("weights"), features=str(features), manifest=str(manifest),
                  evaluated=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return result, sims
