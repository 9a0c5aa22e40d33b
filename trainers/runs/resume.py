"""Whether a run may go on with the data given: the identity of the data it was trained on (recorded in
``config.json``) and each difference from it. ``retr-train MODEL --resume`` refuses one (the settings' differences:
:func:`retr.trainers.config.setting_differences`); ``reproduce`` reuses a member run only without one."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import h5py
import numpy as np

from retr.common.errors import UserError
from retr.common.hashing import sha256_file
from retr.manifests.schema import manifest_sha256
from retr.store.features import CHECKSUMS, FeatureSet
from retr.trainers.config import Difference
from retr.trainers.runs.layout import CONFIG


def data_identity(features: FeatureSet, manifest: str, inputs: dict | None = None) -> dict:
    """What a resume must find again: the feature set's ids digest, shape, dtype and extraction attributes, the
    digest of its shards' per-row checksums (None for shards written before checksums; no feature value is read),
    the manifest's SHA-256 and each side file's SHA-256 (``inputs``: ``{name: path}``)."""
    attrs = {k: v for k, v in features.attrs.items()
             if k in ("kind", "extractor", "backbone", "weights", "image_size", "manifest_sha256")}
    identity = {"features_ids_sha256": hashlib.sha256("\n".join(features.ids).encode("utf-8")).hexdigest(),
                "features_shape": [len(features), *map(int, features.feature_shape)],
                "features_dtype": str(features.dtype),
                "features_attrs": json.loads(json.dumps(attrs, default=str)),
                "features_rows_crc_sha256": _rows_digest(features),
                "manifest_sha256": manifest_sha256(manifest)}
    if inputs:
        # a missing side file is left to the model's reader, whose error says what the file is and how to get it
        identity["inputs_sha256"] = {name: sha256_file(path) if os.path.isfile(path) else None
                                     for name, path in sorted(inputs.items())}
    return identity


def _rows_digest(features: FeatureSet) -> str | None:
    """SHA-256 over the per-row CRC-32s every shard stores (``store.features.CHECKSUMS``): a fingerprint of the
    values at 4 bytes a row; None when a shard has none."""
    shards = features.attrs.get("shards")
    paths = [features.path.resolve().parent / s["file"] for s in shards] if shards else [features.path]
    digest = hashlib.sha256()
    for path in paths:
        with h5py.File(path, "r") as f:
            if CHECKSUMS not in f:
                return None
            digest.update(np.asarray(f[CHECKSUMS][:], dtype="<u4").tobytes())
    return digest.hexdigest()


def data_differences(folder: Path, identity: dict) -> list[Difference]:
    """What in ``identity`` (:func:`~retr.trainers.runs.resume.data_identity` of the data given now) differs from
    the data the run in ``folder`` was trained on, values shortened to 16 characters (runs from before identities
    were recorded: nothing)."""
    config_path = folder / CONFIG
    recorded = json.loads(config_path.read_text(encoding="utf-8")).get("data_identity") if config_path.is_file() \
        else None
    if not recorded:
        return []
    return [Difference(k, f"{str(identity.get(k))[:16]}…", f"{str(recorded[k])[:16]}…") for k in recorded
            if recorded[k] != identity.get(k)]


def check_same_data(folder: Path, identity: dict) -> None:
    """Refuse to resume on other data than the run started with."""
    changed = data_differences(folder, identity)
    if changed:
        raise UserError(f"{folder} was trained on other data: {', '.join(map(str, changed))}; resume with the run's features "
                        "and manifest or choose another --out")
