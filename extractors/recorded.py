"""What a feature set records of its extraction, read back: the extractor and builder options that made it
(:func:`extraction_options`: search embeds new images with them) and the ``retr-pipeline extract`` arguments that
make the same set again (:func:`extract_arguments`: an export's model card prints them).

A set records every builder option that shapes its features (image size, grid, crops, the detector's scaling and
proposals, EXIF rule), the precision it ran at, and its weights (a torchvision weight name, ``random``, or a file by
its SHA-256); ``retr-pipeline extract``'s options are the builders' parameters, spelt ``--image-size`` for
``image_size``.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from retr.common.errors import UserError
from retr.extractors.base import available_extractors, declared_options
from retr.store.features import ATTRS_BEFORE_RECORDED

#: builder options that say how to run, not what comes out (set from the device or the recorded weights)
RUNTIME_OPTIONS = {"device", "weights", "half", "decode", "autocast", "channels_last", "detector_batch", "tf32",
                   "object_vocab", "attr_vocab", "allow_partial", "trust_checkpoint"}
#: run-time options that change the numbers a set holds, with the value that is ``extract``'s default
NUMERIC_RUNTIME_DEFAULTS = {"half": False, "autocast": "none", "channels_last": False, "decode": "cpu",
                            "tf32": False}
#: of those, the ones that need CUDA (``--device cuda`` goes with them)
CUDA_ONLY = {"half": True, "tf32": True, "decode": "device"}


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def extraction_options(feature_set, why: str = "to embed a new image as its rows were; search images by id, or "
                                                "re-extract with retr-pipeline extract") -> tuple[str, dict[str, Any]]:
    """``(extractor name, builder options)`` that re-create the extraction of ``feature_set`` (a
    :class:`~retr.store.features.FeatureSet`; weights excluded).

    One-line :class:`UserError` (ending in ``why``) for imported features (no extractor known) and for a set that
    does not record an option that shapes the features (made before it was recorded).
    """
    attrs = feature_set.attrs
    name = attrs.get("extractor")
    if "source" in attrs or name not in available_extractors():
        made = f"imported ({attrs['source']})" if "source" in attrs else f"made by {name!r}, not a retr extractor"
        raise UserError(f"{feature_set.path}: the features were {made}, so no extractor is known {why}")
    settings = attrs.get("detector_settings", {})
    recorded = {**ATTRS_BEFORE_RECORDED, **(json.loads(settings) if isinstance(settings, str) else settings),
                **attrs}
    wanted = declared_options(name) - RUNTIME_OPTIONS
    missing = sorted(wanted - set(recorded))
    if missing:
        raise UserError(f"{feature_set.path} does not record {', '.join(missing)} (made by an older retr), so "
                        f"nothing is known {why}")
    options = {key: _plain(recorded[key]) for key in wanted}
    options["half"] = bool(recorded.get("half_precision", recorded.get("half", False)))
    for key in ("autocast", "channels_last", "decode", "detector_batch", "tf32"):
        if key in declared_options(name) and key in recorded:
            options[key] = _plain(recorded[key])
    return name, options


def weights_argument(attrs: dict) -> str | None:
    """``--weights``' value that loads the weights a set records: ``random``, a torchvision or open_clip weight name
    as recorded, or a file's name (the file with the recorded SHA-256); None for the bottom-up-attention default
    checkpoint, which ``extract`` loads without the option."""
    recorded = str(attrs.get("weights", ""))
    if "sha256:" not in recorded:
        return recorded or None
    file_name = str(attrs.get("weights_file") or recorded.split(" sha256:")[0])
    if attrs.get("extractor") == "butd-regions":
        from retr.extractors.butd.extractor import DEFAULT_CHECKPOINT  # cost: torchvision
        if file_name == DEFAULT_CHECKPOINT:
            return None
    return file_name


def extract_arguments(feature_set) -> list[str]:
    """The ``retr-pipeline extract`` arguments (after ``--manifest``, ``--out`` and the image root) that make
    ``feature_set`` again: ``--extractor``, ``--weights`` and every recorded option that shapes its numbers, in
    ``extract``'s spelling (a flag alone for a switch that is on; ``--device cuda`` where the set was made with a
    CUDA-only setting; ``--dtype`` when not float16). :class:`UserError` as :func:`extraction_options`."""
    name, options = extraction_options(feature_set, "to make it again")
    arguments = ["--extractor", name]
    weights = weights_argument(feature_set.attrs)
    if weights is not None:
        arguments += ["--weights", weights]
    cuda = False
    for key in sorted(options):
        value = options[key]
        if key in NUMERIC_RUNTIME_DEFAULTS and value == NUMERIC_RUNTIME_DEFAULTS[key]:
            continue
        cuda = cuda or CUDA_ONLY.get(key) == value
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            arguments += [flag] if value else []
        elif value is not None:
            arguments += [flag, str(value)]
    dtype = str(feature_set.attrs.get("dtype", "float16"))
    if dtype != "float16":
        arguments += ["--dtype", dtype]
    return arguments + (["--device", "cuda"] if cuda else [])
