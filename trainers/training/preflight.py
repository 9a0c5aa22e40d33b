"""Every check that can fail, run before any work: the audits ``retr-train MODEL``, ``reproduce`` and
``eval-clip`` share (one function per concern), so a wrong input is one line before the first training step or
caption encoding, never after minutes of it.

* :func:`~retr.common.paths.check_output_folder` — the folder a command writes into can be made and written;
* :func:`check_training` — the run's folder (new, empty, or a run to resume; a non-empty folder that holds no run
  only with ``allow_nonempty_out``), one run's data, its feature kind against the model's paper
  (:func:`check_feature_kind`), pairing of features and manifest
  (:func:`~retr.trainers.data.pairing.check_manifest_pairing`), splits, side files and word vectors
  (:func:`~retr.trainers.models.side_inputs.check_side_inputs`) and the ``--log`` targets (the settings'
  bounds are :class:`~retr.trainers.config.TrainConfig`'s own, checked when it is made);
* :func:`~retr.trainers.evaluation.metrics.check_evaluation_split` (beside the protocols) — the split a protocol
  evaluates: present, every image with features, and the protocol's size (unless a mismatch is allowed);
* :func:`check_feature_rows` — every row of a feature set against its stored checksum, once per state of its files
  (:func:`~retr.store.integrity.verify_rows`).

Each raises :class:`~retr.common.errors.UserError` (one line) and returns the notes to print (``note: …``
lines, without the prefix) when something differs without being wrong. None of them writes anything, but for the
files :func:`check_feature_rows` found sound, remembered in the user's cache (``$RETR_CACHE/verified/``).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from retr.common.errors import UserError
from retr.common.paths import check_folder_holds_only, check_input, check_output_folder
from retr.manifests.schema import ManifestRecord, read_manifest
from retr.store.features import FeatureSet
from retr.store.word_vectors import GLOVE_SETS, RANDOM
from retr.trainers.config import TrainConfig
from retr.trainers.data.splits import SplitData, check_feature_contract
from retr.trainers.data.pairing import check_manifest_pairing
from retr.store.integrity import verify_rows
from retr.store.vocab import Vocabulary
from retr.trainers.models import get_spec
from retr.trainers.models.side_inputs import caption_keys, check_side_inputs
from retr.trainers.runs.checkpoint import is_run_file, read_config
from retr.trainers.runs.run_log import summary_writer


def check_run_folder(out: str | os.PathLike, resume: bool = False, allow_nonempty_out: bool = False) -> None:
    """The folder a training run writes: one it can make and write (:func:`check_output_folder`), and for a new run
    not a non-empty folder of other files unless ``allow_nonempty_out`` (a run's own files do not count: those of a
    start that stopped before its settings, or of a run ``reproduce --retrain`` moves aside; a run already there is
    refused by ``retr-train MODEL`` unless ``--resume``)."""
    check_output_folder(out, "--out")
    if resume:
        return
    if not allow_nonempty_out:
        check_folder_holds_only(out, "--out", "a run",
                                lambda folder: all(is_run_file(p.name) for p in folder.iterdir()))


def check_feature_kind(spec, features: FeatureSet, config, name: str = "--features") -> list[str]:
    """The feature set against what ``spec``'s model is built for: refused in one line where the model's settings
    cannot take its ``[K, D]`` (``spec.check_features``, worded in the options to give), a note where its kind is
    not one the model's paper used (``spec.feature_kinds``); ``config``: the model's settings (its config
    dataclass). Returns the notes."""
    shape = tuple(int(n) for n in features.feature_shape)
    if spec.check_features is not None:
        refusal = spec.check_features(config, shape)
        if refusal:
            raise UserError(f"{spec.name} on {name} {features.path} ({features.kind}, {shape[0]}×{shape[1]} per "
                            f"image): {refusal}")
    if spec.feature_kinds and features.kind not in spec.feature_kinds:
        return [f"{name} {features.path} holds {features.kind} features ({shape[0]}×{shape[1]} per image); "
                f"{spec.name}'s paper used {' or '.join(spec.feature_kinds)} features, so this run is not its "
                f"paper's setting"]
    return []


def check_feature_rows(path: str | os.PathLike, name: str = "--features", quiet: bool = False) -> None:
    """Every row of the feature set at ``path`` finite and equal to the checksum stored when it was written (once
    per state of its files: :func:`~retr.store.integrity.verify_rows`); one line naming ``name`` otherwise."""
    verify_rows(path, name, quiet=quiet)


def check_run_features(runs: list[str], features: str | None = None, quiet: bool = False) -> None:
    """:func:`check_feature_rows` of the set each run is evaluated on: ``features`` when given, else each run's
    own (a run whose set is not on disk is left to the evaluation's own one-line error)."""
    if features:
        check_feature_rows(features, "--features", quiet)
        return
    for path in dict.fromkeys(read_config(run).get("features") for run in runs):
        if path and Path(path).is_file():
            check_feature_rows(path, "the runs' feature set" if len(runs) > 1 else "the run's feature set", quiet)


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


def check_training(cfg: TrainConfig, resume: bool = False, features: FeatureSet | None = None,
                   allow_nonempty_out: bool = False) -> list[str]:
    """Everything a training run of ``cfg`` (a new run, or with ``resume`` one that continues) would refuse,
    checked without training: the output folder (:func:`check_run_folder`), the manifest and feature set
    (contract, the model's feature kind and shape, pairing), the vocabulary's captions (or the ``vocab`` file), the
    training and validation splits, the model's side files and word vectors, and the ``log`` targets.
    ``features``: the set already opened, if it is. Returns the notes."""
    check_run_folder(cfg.out, resume, allow_nonempty_out)
    summary_writer(tuple(cfg.log))
    check_input(cfg.manifest, "--manifest", "file", "a JSON Lines manifest")
    if features is None:
        check_input(cfg.features, "--features", "file", "a feature-set .h5 file")
        features = FeatureSet(cfg.features)
    check_feature_contract(features, cfg.sizes.get("img_dim") if resume else None)
    spec = get_spec(cfg.model)
    vectors = getattr(cfg.model_config, "word_vectors", None)
    if vectors and vectors != RANDOM and vectors not in GLOVE_SETS:
        check_input(vectors, "--word-vectors", "file", f"a GloVe-format .txt or .zip file, or {' / '.join(GLOVE_SETS)}")
    notes = check_feature_kind(spec, features, cfg.model_config)
    notes += check_manifest_pairing(features, cfg.manifest)
    fixed = (spec.caption_vocabulary(cfg.model_config, cfg.vocab) if not resume and spec.caption_vocabulary
             else None)                          # a vocabulary the model's settings fix (BERT's WordPiece)
    if not resume and cfg.vocab:
        check_input(cfg.vocab, "--vocab", "file", "a vocabulary JSON file")
        Vocabulary.load(cfg.vocab)
    if not resume and not cfg.vocab and fixed is None:
        splits = list(cfg.vocab_splits or cfg.train_splits)
        if not any(r.captions for r in read_manifest(cfg.manifest, splits=splits)):
            raise UserError(f"{cfg.manifest} has no captions in {', '.join(splits)} to build the vocabulary from "
                            "(--vocab-split / --train-split)")
    train = _split_records(cfg.manifest, list(cfg.train_splits), features)
    _split_records(cfg.manifest, [cfg.val_split], features)
    data = SplitData([r.id for r in train], [c for r in train for c in r.captions],
                     np.repeat(np.arange(len(train)), [len(r.captions) for r in train]), [])
    check_side_inputs(spec, dict(cfg.inputs), cfg.model_config, data.image_ids,
                      caption_keys(data) if "trees" in dict(cfg.inputs) else [])
    return notes
