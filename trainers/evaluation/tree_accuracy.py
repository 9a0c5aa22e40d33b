"""SMFEA's tree-node accuracy: how often the image and text trees predict the caption's referral-tree nodes."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from retr.common.devices import resolve_device
from retr.common.errors import UserError
from retr.store.features import FeatureSet
from retr.trainers.data.splits import ImageFeatures, load_split, pad_tokens
from retr.trainers.models.side_inputs import caption_keys, read_tree_nodes
from retr.trainers.runs import checkpoint as ckpt

logger = logging.getLogger(__name__)


@torch.no_grad()
def tree_node_accuracy(model, data, features, trees_path: str, device: torch.device | str = "cpu",
                       batch_size: int = 128) -> dict:
    """Accuracy (%) of the predicted tree nodes against the captions' referral trees on a split.

    ``text``: the TCS-Tree of each caption against its own tree; ``image``: the VCS-Tree of each image against
    the tree of each of its captions (captions of one image differ, so this is bounded below 100).
    Each side: ``all`` (7 slots), ``entities`` (4 leaves), ``relations`` (3 inner nodes). Captions without a
    tree are left out.
    """
    model.eval()
    targets, _, _ = read_tree_nodes(trees_path, caption_keys(data))
    keep = targets[:, 0] != -100
    text_pred = np.zeros_like(targets)
    for start in range(0, data.num_captions, batch_size):
        idx = np.arange(start, min(start + batch_size, data.num_captions))
        tokens, lengths = pad_tokens([data.tokens[m] for m in idx])
        text_pred[idx] = model.predict_nodes(tokens=tokens.to(device), lengths=lengths).cpu().numpy()
    image_pred = np.zeros((data.num_images, 7), dtype=np.int64)
    for start in range(0, data.num_images, batch_size):
        idx = np.arange(start, min(start + batch_size, data.num_images))
        feats, mask = features.get(idx)
        image_pred[idx] = model.predict_nodes(features=feats.to(device), mask=mask.to(device)).cpu().numpy()
    image_pred = image_pred[data.caption_image]

    def summary(pred: np.ndarray) -> dict:
        hit = (pred == targets)[keep]
        return {"all": round(100 * float(hit.mean()), 2), "entities": round(100 * float(hit[:, ::2].mean()), 2),
                "relations": round(100 * float(hit[:, 1::2].mean()), 2)}

    return {"text": summary(text_pred), "image": summary(image_pred), "captions": int(keep.sum())}


def run_tree_accuracy(run: str | Path, split: str = "test", which: str = "best", device: str = "cpu") -> dict:
    """Tree-node accuracy of a finished SMFEA run on ``split``; also written to ``RUN/tree_accuracy.json``."""
    model, vocab, _ = ckpt.load_run_model(run, which, device)
    settings = ckpt.read_settings(run)
    trees = settings.inputs.get("trees") if getattr(settings.model_config, "use_trees", True) else None
    if not trees:
        raise UserError(f"{run} was trained without trees; there are no tree nodes to score")
    feature_set = FeatureSet(settings.features)
    data, _ = load_split(settings.manifest, [split], vocab, feature_set, missing="error")
    result = {"split": split, **tree_node_accuracy(model, data, ImageFeatures(feature_set, data.image_ids),
                                                   trees, device)}
    (Path(run) / "tree_accuracy.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def report_tree_accuracy(run: str | Path, cfg) -> None:
    """After training (the ``tree_accuracy`` report SMFEA's spec names): the best checkpoint's accuracy on the test split,
    written to ``RUN/tree_accuracy.json`` and logged; a run without trees or a manifest without a test split
    gets a note instead (training itself succeeded)."""
    if not getattr(cfg.model_config, "use_trees", True):
        return
    try:
        result = run_tree_accuracy(run, "test", device=resolve_device(cfg.device))
    except UserError as exc:
        logger.warning(f"note: no tree-node accuracy ({exc})")
        return
    logger.info(f"tree-node accuracy on test ({result['captions']} captions): text {result['text']['all']:.1f}% "
        f"(entities {result['text']['entities']:.1f}, relations {result['text']['relations']:.1f}), "
        f"image {result['image']['all']:.1f}%  → {Path(run) / 'tree_accuracy.json'}")
