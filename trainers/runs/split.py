"""A trained run opened on one split: its checkpoint's model and the split's data, the paths actually read."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from retr.common.errors import UserError
from retr.store.features import FeatureSet
from retr.store.vocabularies import CaptionVocabulary
from retr.trainers.config import TrainConfig, settings_from_stored
from retr.trainers.data.pairing import check_manifest_pairing
from retr.trainers.data.splits import SplitData, check_feature_contract, load_split
from retr.trainers.models import get_spec
from retr.trainers.runs import checkpoint as ckpt

logger = logging.getLogger(__name__)


@dataclass
class RunSplit:
    """A trained run opened on one split: its model (eval mode), vocabulary, ``config.json`` (its records) and
    settings (the typed :class:`~retr.trainers.config.TrainConfig`), the feature set (checked against the model) and
    the split's data, with the paths actually read."""

    model: object
    vocab: CaptionVocabulary
    config: dict
    settings: TrainConfig
    features: FeatureSet
    data: SplitData
    features_path: str
    manifest_path: str


def open_run_split(run, split: str, features: str | None = None, manifest: str | None = None,
                   which: str = "best", device="cpu", trust_checkpoint: bool = False) -> RunSplit:
    """Load ``run``'s ``which`` checkpoint and ``split`` of its feature set and manifest (or the ones given),
    every image of the split required (evaluation and search see the whole split)."""
    model, vocab, config = ckpt.load_run_model(run, which, device, trust=trust_checkpoint)
    settings = settings_from_stored(get_spec(config["model"]), config)
    features = features or settings.features
    manifest = manifest or settings.manifest
    if not features or not manifest:
        raise UserError(f"{run} does not record its features/manifest (an export or an imported run); pass --features and "
                        "--manifest")
    feature_set = FeatureSet(features)
    check_feature_contract(feature_set, settings.sizes.get("img_dim"))
    for note in check_manifest_pairing(feature_set, manifest):   # refuses a manifest of other images
        logger.warning(f"note: {note}")
    data, _ = load_split(manifest, [split], vocab, feature_set, missing="error")
    return RunSplit(model, vocab, config, settings, feature_set, data, str(features), str(manifest))
