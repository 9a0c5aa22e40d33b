"""Where a timm backbone's weights come from: ``imagenet``, a timm tag, ``random``, a file (:class:`TimmWeights`: a
spec's default weights).

Headless timm network (output: the global pool ``[B, 1536]``); tags from the Hugging Face cache, files checked key
by key, the architecture's own normalisation: docs/extraction.md ("Decisions the code relies on")."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from retr.common.downloads import is_offline
from retr.common.errors import MissingResourceError, ParameterError, UserError
from retr.common.hashing import sha256_file
from retr.common.optional import require
from retr.extractors.spec import WeightSource
from retr.extractors.weights import (RANDOM_SEED, LoadedWeights, first_line, load_checked, read_state_dict,
                                     seeded_random_model)
from retr.extractors.base import extractors_requiring, needed_by

#: The tag ``--weights imagenet`` means (timm's default for ``inception_resnet_v2``).
TIMM_DEFAULT_TAG = "tf_in1k"
#: Files of a timm weight folder in the Hugging Face cache, in the order they are looked for.
HUB_FILES = ("model.safetensors", "pytorch_model.bin")
#: the extra that installs timm (which brings huggingface_hub and safetensors)
EXTRA = "pipeline"


def what() -> str:
    """What needs timm, in the one-line error when it is missing: the extractors whose spec requires it."""
    return f"{needed_by('timm')} and {'its' if len(extractors_requiring('timm')) == 1 else 'their'} weights"


def _timm():
    return require("timm", EXTRA, what())


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache timm downloads into: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub`` (default ``~/.cache/huggingface/hub``). Read at call time."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def weight_tags(arch: str) -> list[str]:
    """The pretrained tags timm lists for ``arch`` (``tf_ens_adv_in1k``, ``tf_in1k`` for Inception-ResNet-v2)."""
    return sorted(name.split(".", 1)[1] for name in _timm().list_pretrained(f"{arch}.*"))


def _pretrained_cfg(arch: str, tag: str):
    cfg = _timm().models.get_pretrained_cfg(f"{arch}.{tag}")
    if cfg is None or not cfg.hf_hub_id:
        raise ParameterError(f"weights {tag!r} is not a timm weight tag of {arch} (it has "
                             f"{', '.join(weight_tags(arch))}; or use 'imagenet', 'random' or a file path)", "weights")
    return cfg


def _normalisation(arch: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    cfg = _pretrained_cfg(arch, TIMM_DEFAULT_TAG)
    return tuple(float(v) for v in cfg.mean), tuple(float(v) for v in cfg.std)


def _headless(arch: str) -> nn.Module:
    return _timm().create_model(arch, pretrained=False, num_classes=0)


def read_weights_file(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from a ``.safetensors`` file or a ``torch.save`` file (tensors only)."""
    if path.suffix != ".safetensors":
        return read_state_dict(path)
    safetensors = require("safetensors", EXTRA, what())
    load_file = require("safetensors.torch", EXTRA, what()).load_file
    try:
        return load_file(str(path), device="cpu")
    except (safetensors.SafetensorError, OSError, ValueError) as exc:
        raise UserError(f"cannot read {path} as a safetensors file ({first_line(exc)})") from None


def cached_hub_file(repo_id: str, names: Iterable[str] = HUB_FILES) -> Path | None:
    """The first of ``names`` (default :data:`HUB_FILES`) of ``repo_id`` present in the Hugging Face cache, or
    ``None``."""
    hub = require("huggingface_hub", EXTRA, what())
    for name in names:
        found = hub.try_to_load_from_cache(repo_id, name, cache_dir=hf_hub_cache())
        if isinstance(found, str) and Path(found).is_file():
            return Path(found)
    return None


def fetch_timm_weights(arch: str, tag: str = TIMM_DEFAULT_TAG, quiet: bool = False) -> Path:
    """The cached weight file of ``arch.tag``, downloaded into the Hugging Face cache first when absent (unless
    offline: then the one-line :class:`MissingResourceError` naming ``retr-pipeline fetch-weights ARCH``)."""
    cfg = _pretrained_cfg(arch, tag)
    found = cached_hub_file(cfg.hf_hub_id)
    if found is not None:
        return found
    if is_offline():
        raise missing_hub_weights(f"timm weights {arch}.{tag}", cfg.hf_hub_id, HUB_FILES[0],
                                  f"import timm; timm.create_model('{arch}.{tag}', pretrained=True)",
                                  arch if tag == TIMM_DEFAULT_TAG else None)
    return download_hub_file(cfg.hf_hub_id, HUB_FILES[0], quiet)


def missing_hub_weights(what: str, repo_id: str, filename: str, python: str,
                        fetch_name: str | None) -> MissingResourceError:
    """The one-line error for ``filename`` of ``repo_id`` absent from the Hugging Face cache while offline: the
    folder, ``retr-pipeline fetch-weights FETCH_NAME`` (when it fetches these weights) or the ``python`` line."""
    folder, python = hub_folder(repo_id), f"python -c \"{python}\""
    run = (f"run retr-pipeline fetch-weights {fetch_name} on a connected machine (or {python})" if fetch_name
           else f"on a connected machine run {python}")
    return MissingResourceError(
        f"{what} ({filename})", str(folder),
        f"{run} and copy {folder.name} into {folder.parent} (HF_HUB_CACHE or HF_HOME name another cache), or "
        f"pass --weights PATH to its {filename}")


def hub_folder(repo_id: str) -> Path:
    """The Hugging Face cache folder of ``repo_id`` (``models--ORG--NAME``)."""
    return hf_hub_cache() / ("models--" + repo_id.replace("/", "--"))


def download_hub_file(repo_id: str, filename: str, quiet: bool = False) -> Path:
    """``huggingface_hub.hf_hub_download`` of ``filename`` of ``repo_id`` into :func:`hf_hub_cache` (its own
    checks and resume); any failure is one :class:`UserError`."""
    hf_hub_download = require("huggingface_hub", EXTRA, what()).hf_hub_download
    hub_utils = require("huggingface_hub.utils", EXTRA, what())
    if quiet:
        hub_utils.disable_progress_bars()
    try:
        return Path(hf_hub_download(repo_id, filename, cache_dir=hf_hub_cache()))
    except Exception as exc:  # noqa: BLE001 - connection, HTTP and hub errors come in many types
        raise UserError(f"could not download {filename} of {repo_id} from the Hugging Face hub into "
                        f"{hub_folder(repo_id)} ({type(exc).__name__}: {first_line(exc)[:200]}); run again, or set "
                        f"HF_ENDPOINT to a hub mirror") from None
    finally:
        if quiet:
            hub_utils.enable_progress_bars()


def build_timm_backbone(arch: str, weights: str, unused_prefixes: Iterable[str] = (),
                        **builder_options) -> tuple[nn.Module, LoadedWeights]:
    """timm's headless ``arch`` in eval mode with ``weights`` loaded (contract of
    :func:`retr.extractors.weights.build_backbone`); ``unused_prefixes``: head parameters a file may hold."""
    mean, std = _normalisation(arch)
    head = tuple(unused_prefixes)
    if weights == "random":
        model = seeded_random_model(("timm", arch, *sorted(builder_options.items())),
                                    lambda: _timm().create_model(arch, pretrained=False, num_classes=0,
                                                                 **builder_options))
        return model.eval(), LoadedWeights("random", {"weights_seed": RANDOM_SEED}, mean, std)
    path = Path(weights)
    tag = TIMM_DEFAULT_TAG if weights == "imagenet" else weights.removeprefix(f"{arch}.")
    if path.is_file():
        source = path
        state, name, attrs = read_weights_file(path), f"sha256:{sha256_file(path)}", {"weights_file": path.name}
    elif tag in weight_tags(arch):
        found = fetch_timm_weights(arch, tag)
        source = found
        state, name = read_weights_file(found), f"timm/{arch}.{tag}"
        attrs = {"weights_file": found.name, "weights_revision": found.parent.name}
    else:
        raise ParameterError(f"weights {weights!r} is neither 'imagenet', 'random', a timm weight tag of {arch} "
                             f"({', '.join(weight_tags(arch))}) nor an existing state-dict or safetensors file",
                             "weights")
    state = {k: v for k, v in state.items() if not (head and k.startswith(head))}
    with torch.device("meta"):  # no initialisation that loading overwrites
        model = _headless(arch)
    load_checked(model, state, str(source), arch)
    return model.eval(), LoadedWeights(name, attrs, mean, std)


@dataclass(frozen=True, kw_only=True)
class TimmWeights(WeightSource):
    """timm's pretrained weights ``arch.tag`` (``inception_resnet_v2.tf_in1k``), cached by ``huggingface_hub`` in
    :func:`hf_hub_cache` (:func:`fetch_timm_weights`)."""

    arch: str
    tag: str = TIMM_DEFAULT_TAG

    @property
    def recorded(self) -> str:
        return f"timm/{self.arch}.{self.tag}"

    def locate(self) -> Path | None:
        return cached_hub_file(_pretrained_cfg(self.arch, self.tag).hf_hub_id)

    def fetch(self, quiet: bool = False, mirror: str | None = None) -> Path:
        return fetch_timm_weights(self.arch, self.tag, quiet=quiet)

    def looked_in(self) -> str:
        return str(hf_hub_cache())
