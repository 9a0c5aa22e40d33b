"""Whether a run may go on: the identity of the data it was trained on (recorded in ``config.json``), and the
settings and data asked for now that differ from the run's. ``retr-train MODEL --resume`` refuses a difference
outside :data:`~retr.trainers.config.RESUME_APPLIES`; ``reproduce`` reuses a member run only without one."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import asdict, fields
from pathlib import Path
from typing import NamedTuple

import numpy as np

from retr.common.errors import UserError
from retr.common.hashing import sha256_file
from retr.manifests.schema import manifest_sha256
from retr.store.features import FeatureSet
from retr.trainers.config import RESUME_APPLIES, TrainConfig
from retr.trainers.models import get_spec
from retr.trainers.runs import checkpoint as ckpt
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
    import h5py

    from retr.store.features import CHECKSUMS

    shards = features.attrs.get("shards")
    paths = [features.path.resolve().parent / s["file"] for s in shards] if shards else [features.path]
    digest = hashlib.sha256()
    for path in paths:
        with h5py.File(path, "r") as f:
            if CHECKSUMS not in f:
                return None
            digest.update(np.asarray(f[CHECKSUMS][:], dtype="<u4").tobytes())
    return digest.hexdigest()


class Difference(NamedTuple):
    """A setting or data fingerprint asked for now (``given``) that is not the run's (``stored``); both as shown."""

    name: str
    given: str
    stored: str

    def __str__(self) -> str:
        return f"{self.name} {self.given} (run: {self.stored})"


def config_differences(cfg: TrainConfig, saved: dict,
                       may_differ: tuple[str, ...] = RESUME_APPLIES) -> list[Difference]:
    """Each setting of ``cfg`` (model settings and :class:`TrainConfig`'s, the data paths, side files and run
    folder aside) that differs from the run's stored ``config.json`` (``saved``); settings named in ``may_differ``
    are not compared."""
    saved = ckpt.upgrade_config(saved)
    spec = get_spec(saved["model"])
    names = spec.setting_names
    old_model = asdict(spec.make_config({k: v for k, v in saved["model_args"].items() if k in names}))
    new_model = asdict(spec.make_config({k: v for k, v in cfg.model_args.items() if k in names}))
    known = {f.name for f in fields(TrainConfig)}
    old = TrainConfig(**{k: v for k, v in saved.items() if k in known})
    differences = [Difference(k, repr(new_model[k]), repr(old_model[k])) for k in old_model
                   if old_model[k] != new_model[k]]
    differences += [Difference(k, repr(getattr(cfg, k)), repr(getattr(old, k))) for k in sorted(known)
                    if k not in may_differ and k not in ("model", "model_args", "features", "manifest", "inputs",
                                                         "out")
                    and getattr(cfg, k) != getattr(old, k)]
    return differences


def resumed_config(cfg: TrainConfig, saved: dict, folder: Path) -> TrainConfig:
    """The run's own config with the settings that may change on resume taken from ``cfg``
    (:data:`~retr.trainers.config.RESUME_APPLIES`: epochs, device, workers …); any other difference is refused
    in one line that names each setting."""
    saved = ckpt.upgrade_config(saved)
    if saved["model"] != cfg.model:
        raise UserError(f"{folder} is a {saved['model']} run; continue it with `retr-train {saved['model']} "
                        f"--resume --out {folder}`")
    differences = config_differences(cfg, saved)
    if differences:
        raise UserError(f"{folder} cannot change on resume: {'; '.join(map(str, differences))}; resume with the run's "
                        "settings (leave those options out) or choose another --out")
    known = {f.name for f in fields(TrainConfig)}
    old = TrainConfig(**{k: v for k, v in saved.items() if k in known})
    applied = {k: getattr(cfg, k) for k in (*RESUME_APPLIES, "features", "manifest", "inputs", "out")}
    return dataclasses.replace(old, model_args=saved["model_args"], **applied)


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
