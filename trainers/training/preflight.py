"""Every check that can fail, run before any work: the audits ``retr-train MODEL``, ``reproduce`` and
``eval-clip`` share (one function per concern), so a wrong input is one line before the first training step or
caption encoding, never after minutes of it.

* :func:`check_output_folder` — the folder a command writes into can be made and written;
* :func:`check_training` — one run's data, pairing of features and manifest
  (:func:`~retr.trainers.data.pairing.check_manifest_pairing`), splits, side files and word vectors
  (:func:`~retr.trainers.models.side_inputs.check_side_inputs`) and the ``--log`` targets (the settings'
  bounds are :class:`~retr.trainers.config.TrainConfig`'s own, checked when it is made);
* :func:`~retr.trainers.evaluation.metrics.check_evaluation_split` (beside the protocols) — the split a protocol
  evaluates: present, every image with features, and the protocol's size (unless a mismatch is allowed).

Each raises :class:`~retr.common.errors.UserError` (one line) and returns the notes to print (``note: …``
lines, without the prefix) when something differs without being wrong. None of them writes anything.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from retr.common.errors import UserError
from retr.manifests.schema import ManifestRecord, read_manifest
from retr.store.features import FeatureSet
from retr.trainers.config import TrainConfig
from retr.trainers.data.splits import check_feature_contract
from retr.trainers.data.pairing import check_manifest_pairing


def check_output_folder(out: str | os.PathLike, flag: str = "--out") -> None:
    """Refuse an output folder that is a file, lies below a file, or cannot be created or written (its nearest
    existing folder is not writable)."""
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{flag} {folder} is a file, not a folder")
    existing = folder
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise UserError(f"{flag} {folder}: {existing} is a file, so the folder cannot be made")
    if existing.exists() and not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {folder}: {existing} is not writable")


def _split_records(manifest: str, splits: list[str], features: FeatureSet) -> list[ManifestRecord]:
    """The records of ``splits`` that have features; refuses a split without images or without any features
    (the messages of :func:`~retr.trainers.data.splits.load_split`)."""
    records = read_manifest(manifest, splits=splits)
    if not records:
        raise UserError(f"{manifest} has no images in split(s) {', '.join(splits)}")
    kept = [r for r in records if r.id in features]
    if not kept:
        raise UserError(f"no image of split {'+'.join(splits)} has features in {features.path}: is this the "
                        "feature set of that manifest?")
    return kept


def check_training(cfg: TrainConfig, resume: bool = False, features: FeatureSet | None = None) -> list[str]:
    """Everything a training run of ``cfg`` (a new run, or with ``resume`` one that continues) would refuse,
    checked without training: the output folder, the manifest and feature set (contract and pairing), the
    vocabulary's captions (or the ``vocab`` file), the training and validation splits, the model's side files
    and word vectors, and the ``log`` targets. ``features``: the set already opened, if it is. Returns the
    notes."""
    from retr.trainers.models import get_spec
    from retr.trainers.runs.run_log import summary_writer
    from retr.trainers.data.splits import SplitData
    from retr.trainers.models.side_inputs import caption_keys, check_side_inputs

    check_output_folder(cfg.out)
    summary_writer(tuple(cfg.log))
    if not Path(cfg.manifest).is_file():
        raise UserError(f"manifest {cfg.manifest} {'is a folder' if Path(cfg.manifest).is_dir() else 'does not exist'}"
                        " (expected a JSON Lines file)")
    features = features if features is not None else FeatureSet(cfg.features)
    check_feature_contract(features, cfg.model_args.get("img_dim") if resume else None)
    notes = check_manifest_pairing(features, cfg.manifest)
    if not resume and cfg.vocab:
        from retr.store.vocab import Vocabulary

        Vocabulary.load(cfg.vocab)
    if not resume and not cfg.vocab:
        splits = list(cfg.vocab_splits or cfg.train_splits)
        if not any(r.captions for r in read_manifest(cfg.manifest, splits=splits)):
            raise UserError(f"{cfg.manifest} has no captions in {', '.join(splits)} to build the vocabulary from "
                            "(--vocab-split / --train-split)")
    train = _split_records(cfg.manifest, list(cfg.train_splits), features)
    _split_records(cfg.manifest, [cfg.val_split], features)
    spec = get_spec(cfg.model)
    data = SplitData([r.id for r in train], [c for r in train for c in r.captions],
                     np.repeat(np.arange(len(train)), [len(r.captions) for r in train]), [])
    check_side_inputs(spec, dict(cfg.inputs), cfg.model_args, data.image_ids,
                      caption_keys(data) if "trees" in dict(cfg.inputs) else [])
    return notes
