"""Where a timm backbone's weights come from (``tencrop-irv2``): ``imagenet``, a timm tag, ``random``, a file.

torchvision has no Inception-ResNet-v2; timm's ``inception_resnet_v2`` is the TF-slim network with Google's
ImageNet weights converted (tag ``tf_in1k``). The network is built headless (``num_classes=0``): its forward pass
ends in the global average pool, ``[B, 1536]``. ``weights`` takes one of

* ``imagenet`` — the default tag (:data:`TIMM_DEFAULT_TAG`), or a tag timm lists for the architecture
  (``tf_ens_adv_in1k``, also written ``inception_resnet_v2.tf_ens_adv_in1k``). timm keeps downloaded weights in
  the Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, default ``~/.cache/huggingface/hub``), in a
  folder ``models--timm--<arch>.<tag>``. retr reads ``model.safetensors`` (or ``pytorch_model.bin``) from that
  folder; when it is not there it is downloaded on first use with ``huggingface_hub.hf_hub_download`` (what
  timm itself calls: the hub's own cache, progress and checks; ``HF_ENDPOINT`` names a hub mirror). Offline
  (``RETR_OFFLINE=1``) it fails in one line naming the folder and the command that fills it on a connected
  machine — ``retr-pipeline fetch-weights inception_resnet_v2`` — after which the folder is copied over (or the
  file is passed as ``--weights PATH``).
* ``random`` — timm's own initialisation under :data:`~retr.extractors.weights.RANDOM_SEED`. Tests and demos.
* a path: a ``.safetensors`` file (what the cache holds; nothing in it can execute) or a ``torch.save`` state
  dict (read with ``weights_only=True`` like every torchvision state-dict file; ``state_dict``/``model`` nesting
  and a DDP ``module.`` prefix are accepted) with timm's key names, checked key by key and shape by shape. The
  classifier (``classif.*``), which the headless network does not have, may be present and is dropped. Such a
  file is tensors only, so there is no ``trust_checkpoint`` opt-in (that exists for the bottom-up-attention
  pickles, which hold other objects).

The input normalisation is the architecture's, from timm's pretrained config (mean = std = 0.5 for
Inception-ResNet-v2: pixels scaled to [-1, 1]), whatever the weights.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from retr.common.downloads import is_offline
from retr.common.errors import MissingResourceError, ParameterError, UserError
from retr.common.hashing import sha256_file
from retr.common.optional import require
from retr.extractors.weights import RANDOM_SEED, LoadedWeights, first_line, load_checked, read_state_dict

#: The tag ``--weights imagenet`` means (timm's default for ``inception_resnet_v2``).
TIMM_DEFAULT_TAG = "tf_in1k"
#: Files of a timm weight folder in the Hugging Face cache, in the order they are looked for.
HUB_FILES = ("model.safetensors", "pytorch_model.bin")
#: what needs timm, huggingface_hub and safetensors (the ``pipeline`` extra), in their one-line error
WHAT = "the tencrop-irv2 extractor and its weights"


def _timm():
    return require("timm", "pipeline", WHAT)


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
    safetensors = require("safetensors", "pipeline", WHAT)
    load_file = require("safetensors.torch", "pipeline", WHAT).load_file
    try:
        return load_file(str(path), device="cpu")
    except (safetensors.SafetensorError, OSError, ValueError) as exc:
        raise UserError(f"cannot read {path} as a safetensors file ({first_line(exc)})") from None


def cached_hub_file(repo_id: str) -> Path | None:
    """The first of :data:`HUB_FILES` of ``repo_id`` present in the Hugging Face cache, or ``None``."""
    hub = require("huggingface_hub", "pipeline", WHAT)
    for name in HUB_FILES:
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
    folder = hf_hub_cache() / ("models--" + cfg.hf_hub_id.replace("/", "--"))
    if is_offline():
        python = f"python -c \"import timm; timm.create_model('{arch}.{tag}', pretrained=True)\""
        run = (f"run retr-pipeline fetch-weights {arch} on a connected machine (or {python})"
               if tag == TIMM_DEFAULT_TAG else f"on a connected machine run {python}")
        raise MissingResourceError(
            f"timm weights {arch}.{tag} ({HUB_FILES[0]})", str(folder),
            f"{run} and copy {folder.name} into {folder.parent} (HF_HUB_CACHE or HF_HOME name another cache), or "
            f"pass --weights PATH to its {HUB_FILES[0]}")
    hf_hub_download = require("huggingface_hub", "pipeline", WHAT).hf_hub_download
    hub_utils = require("huggingface_hub.utils", "pipeline", WHAT)
    disable_progress_bars, enable_progress_bars = hub_utils.disable_progress_bars, hub_utils.enable_progress_bars

    if quiet:
        disable_progress_bars()
    try:
        path = Path(hf_hub_download(cfg.hf_hub_id, HUB_FILES[0], cache_dir=hf_hub_cache()))
    except Exception as exc:  # noqa: BLE001 - connection, HTTP and hub errors come in many types
        raise UserError(f"could not download {HUB_FILES[0]} of {cfg.hf_hub_id} from the Hugging Face hub into "
                        f"{folder} ({type(exc).__name__}: {first_line(exc)[:200]}); run again, or set HF_ENDPOINT to "
                        f"a hub mirror") from None
    finally:
        if quiet:
            enable_progress_bars()
    return path


def build_timm_backbone(arch: str, weights: str, unused_prefixes: Iterable[str] = (),
                        **builder_options) -> tuple[nn.Module, LoadedWeights]:
    """timm's headless ``arch`` (output: the global pool) in eval mode with ``weights`` loaded.

    Same contract as :func:`retr.extractors.weights.build_backbone`. ``unused_prefixes``: the head's parameter
    names (``classif.``), absent from the headless network; a file's copies are dropped before the check.
    ``builder_options`` go to ``timm.create_model`` for ``random`` only.
    """
    mean, std = _normalisation(arch)
    head = tuple(unused_prefixes)
    if weights == "random":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(RANDOM_SEED)
            model = _timm().create_model(arch, pretrained=False, num_classes=0, **builder_options)
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
