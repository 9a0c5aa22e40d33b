"""Where a torchvision backbone's weights come from: ``imagenet`` (torchvision's enums), an enum name, ``random``
(seed :data:`RANDOM_SEED`), a state-dict file (checked key by key; recorded as ``sha256:<hex>``). Also what every
extractor shares about weights: the one seed and cache of random networks (:func:`seeded_random_model`), and the
weight sources of a spec that are a torchvision enum (:class:`TorchvisionWeights`) or a URL (:class:`UrlWeights`).

Cache, mirror and offline behaviour: docs/extraction.md ("Options of retr-pipeline extract", "Downloads")."""
from __future__ import annotations

import copy
import os
import pickle
import sys
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable
from urllib.parse import urlparse

import numpy as np
import torch
from torch import nn
from torchvision import models as tvm

try:
    from numpy._core.multiarray import _reconstruct, scalar
except ImportError:  # NumPy < 2
    from numpy.core.multiarray import _reconstruct, scalar

from retr.common.downloads import SOURCES, download, fetch_source, is_offline, mirror_base
from retr.common.errors import MissingResourceError, ParameterError, UserError
from retr.common.hashing import sha256_file
from retr.extractors.spec import RandomInit, WeightSource
from retr.extractors.images import IMAGENET_MEAN, IMAGENET_STD

#: The seed of every extractor's ``--weights random`` (recorded as the ``weights_seed`` attribute where recorded).
RANDOM_SEED = 0
#: Random ResNets start each residual branch at zero, so activations stay in float16's range (docs/extraction.md).
RANDOM_RESNET = RandomInit("torchvision", {"zero_init_residual": True})
#: The enum member ``--weights imagenet`` means.
IMAGENET_DEFAULT = "IMAGENET1K_V1"


@dataclass(frozen=True)
class LoadedWeights:
    """What :func:`build_backbone` loaded: the name the feature set records and the input normalisation."""

    name: str  #: ``ResNet152_Weights.IMAGENET1K_V1``, ``random`` or ``sha256:<hex>``
    attrs: dict  #: further root attributes (``weights_seed``, ``weights_file``, ``weights_url``)
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


def hub_checkpoint_path(url: str) -> Path:
    """Where torchvision's loader caches the file at ``url``: ``<torch.hub.get_dir()>/checkpoints/<file name>``."""
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path)


def imagenet_weights(arch: str, spec: str) -> tvm.WeightsEnum:
    """The torchvision weight enum member for ``arch`` (e.g. ``resnet152``) named by ``spec``."""
    enum = tvm.get_model_weights(arch)
    member = IMAGENET_DEFAULT if spec == "imagenet" else spec.split(".")[-1]
    try:
        return enum[member]
    except KeyError:
        names = ", ".join(m.name for m in enum)
        raise ParameterError(f"weights {spec!r} is not a torchvision weight name of {arch} (it has {names}; "
                             f"or use 'imagenet', 'random' or a file path)", "weights") from None


def is_enum_spec(spec: str) -> bool:
    return spec == "imagenet" or spec.split(".")[-1].isupper()


def build_backbone(arch: str, weights: str, unused_prefixes: Iterable[str] = (),
                   **builder_options) -> tuple[nn.Module, LoadedWeights]:
    """torchvision's ``arch`` (``resnet152``, ``vgg16``, ``vgg19``) in eval mode with ``weights`` loaded.

    ``unused_prefixes``: parameters the extractor never runs (a file may omit them); ``builder_options``: for the
    builder with ``weights=None`` (e.g. ``zero_init_residual``)."""
    builder: Callable[..., nn.Module] = tvm.get_model_builder(arch)
    if weights == "random":
        model = seeded_random_model(("torchvision", arch, *sorted(builder_options.items())),
                                    lambda: builder(weights=None, **builder_options))
        loaded = LoadedWeights("random", {"weights_seed": RANDOM_SEED}, IMAGENET_MEAN, IMAGENET_STD)
    elif is_enum_spec(weights) and not Path(weights).exists():
        member = imagenet_weights(arch, weights)
        cached = fetch_imagenet_weights(arch, weights)
        check_hub_hash(cached, member.url)
        model = _skeleton(builder)
        state = member.get_state_dict(progress=False)
        load_checked(model, state, str(cached), arch, ())
        transforms = member.transforms()
        loaded = LoadedWeights(f"{type(member).__name__}.{member.name}", {"weights_url": member.url},
                               tuple(transforms.mean), tuple(transforms.std))
    else:
        path = Path(weights)
        if not path.is_file():
            raise ParameterError(f"weights {weights!r} is neither 'imagenet', 'random', a torchvision weight name, "
                                 f"nor an existing state-dict file", "weights")
        model = _skeleton(builder)
        load_checked(model, read_state_dict(path), str(path), arch, tuple(unused_prefixes))
        loaded = LoadedWeights(f"sha256:{sha256_file(path)}", {"weights_file": path.name}, IMAGENET_MEAN,
                               IMAGENET_STD)
    return model.eval(), loaded


def missing_imagenet_error(arch: str, member: tvm.Weights) -> MissingResourceError:
    """The one-line error for ImageNet weights absent from torchvision's cache while offline."""
    cached = hub_checkpoint_path(member.url)
    return MissingResourceError(
        f"ImageNet weights {type(member).__name__}.{member.name} ({cached.name})", str(cached.parent),
        f"run retr-pipeline fetch-weights {arch} on a connected machine (it downloads {member.url} into that "
        f"folder; RETR_OFFLINE is set, so retr does not here) and copy the file over, set TORCH_HOME to use "
        f"another cache, or pass --weights PATH")


def fetch_imagenet_weights(arch: str, spec: str = "imagenet", quiet: bool = False,
                           mirror: str | None = None) -> Path:
    """The cached file of ``arch``'s torchvision weights ``spec``, downloaded first (torchvision's loader, or
    ``mirror`` through :func:`retr.common.downloads.download`); offline: :func:`missing_imagenet_error`."""
    member = imagenet_weights(arch, spec)
    cached = hub_checkpoint_path(member.url)
    if cached.is_file():
        return cached
    if is_offline():
        raise missing_imagenet_error(arch, member)
    mirror = mirror or mirror_base()
    if mirror:
        known = next((s for s in SOURCES.values() if s.url == member.url), None)
        download(f"{mirror.rstrip('/')}/{cached.name}", cached, size=known.size if known else None,
                 sha256=known.sha256 if known else None, what=f"ImageNet weights {cached.name}",
                 validate=lambda path: check_hub_hash(path, member.url, name=cached.name), quiet=quiet)
        return cached
    try:   # torch.hub prints "Downloading: URL to PATH"; its bar only on a terminal (a log gets no redraws)
        member.get_state_dict(progress=not quiet and sys.stderr.isatty(), check_hash=True)
    except Exception as exc:  # noqa: BLE001 - URLError, HTTPError, hash mismatch (RuntimeError), disk errors…
        raise UserError(f"could not download {member.url} into {cached.parent} ({type(exc).__name__}: "
                        f"{first_line(exc)}); run again (torchvision restarts the file), or set RETR_MIRROR") from None
    if not cached.is_file():
        raise UserError(f"torchvision reported {member.url} downloaded but {cached} is not there")
    return cached


def _skeleton(builder: Callable[..., nn.Module]) -> nn.Module:
    """The architecture with its tensors on the ``meta`` device: no time spent on an initialisation that loading
    overwrites (VGG-19's 144M parameters take seconds to initialise)."""
    with torch.device("meta"):
        return builder(weights=None)


#: the last :data:`RANDOM_MODELS_KEPT` random models made (key → a private copy, on the CPU)
_RANDOM_MODELS: OrderedDict[tuple, nn.Module] = OrderedDict()
#: how many random models a process keeps (VGG-19's weights are 575 MB)
RANDOM_MODELS_KEPT = 2


def seeded_random_model(key: tuple, make: Callable[[], nn.Module], copy_out: bool = True) -> nn.Module:
    """``make()`` under :data:`RANDOM_SEED` (the caller's random state untouched), made once per process: a later
    call with the same ``key`` gets a copy of the same tensors instead of initialising again (ResNet-152 and VGG
    take 1–2 s on a CPU, the detector's calibration more; tests and benchmarks build them dozens of times). Every
    extractor's random weights go through this one cache (``key`` starts with the library: ``torchvision``,
    ``timm``, ``open_clip``, ``butd``). ``copy_out=False`` returns the kept model itself, to be read only (its
    state dict loaded into another model)."""
    kept = _RANDOM_MODELS.get(key)
    if kept is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(RANDOM_SEED)
            kept = make()
        _RANDOM_MODELS[key] = kept
        while len(_RANDOM_MODELS) > RANDOM_MODELS_KEPT:
            _RANDOM_MODELS.popitem(last=False)
    _RANDOM_MODELS.move_to_end(key)
    return copy.deepcopy(kept) if copy_out else kept


def _materialise_leftovers(model: nn.Module) -> None:
    """Give every tensor loading did not fill a real value: ``num_batches_tracked`` counters (absent from
    torchvision's 2017-era checkpoints, unused in eval mode) become 0, never-run head parameters zeros."""
    for module in model.modules():
        for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if tensor.is_meta:
                real = torch.zeros(tensor.shape, dtype=tensor.dtype)
                if isinstance(tensor, nn.Parameter):
                    setattr(module, name, nn.Parameter(real, requires_grad=False))
                else:
                    setattr(module, name, real)


def check_hub_hash(path: Path, url: str, name: str | None = None) -> None:
    """Check a cached file against the SHA-256 prefix in its name (``name``: when the file is under another name)."""
    match = torch.hub.HASH_REGEX.search(name or path.name)
    if match is None:
        return
    digest = sha256_file(path)
    if not digest.startswith(match.group(1)):
        raise UserError(f"cached weights {path} are damaged (sha256 {digest[:len(match.group(1))]}…, the file name "
                        f"says {match.group(1)}…); delete it and download {url} again")


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's text, or its type's name when it has none."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def numpy_array_globals() -> list:
    """What unpickling NumPy arrays needs (array reconstruction, dtypes, scalars): allowed in a weights-only
    ``torch.load`` of files that hold arrays instead of tensors (detectron2-era checkpoints). Nothing of it runs
    code: it rebuilds arrays from bytes."""
    return [_reconstruct, scalar, np.ndarray, np.dtype] + [getattr(np.dtypes, n) for n in dir(np.dtypes)
                                                            if n.endswith("DType")]


def load_torch_file(path: str | os.PathLike, what: str = "a PyTorch state dict", weights_only: bool = True,
                    trust_parameter: str | None = None, numpy_arrays: bool = False):
    """``torch.load(path)`` onto the CPU, every failure one :class:`UserError`, torch's warnings kept quiet.

    ``weights_only`` (default): the message says whether the file holds objects or is no ``torch.save`` file and
    names ``trust_parameter``; ``numpy_arrays`` also accepts NumPy arrays."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            head = handle.read(4)
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc.strerror or exc})") from None
    if not head:
        raise UserError(f"{path} is empty (0 bytes), not {what}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if weights_only and numpy_arrays:
                with torch.serialization.safe_globals(numpy_array_globals()):
                    return torch.load(path, map_location="cpu", weights_only=True)
            return torch.load(path, map_location="cpu", weights_only=weights_only)
        except pickle.UnpicklingError as exc:
            if not weights_only:
                raise UserError(f"cannot read {path} as {what} ({first_line(exc)})") from None
            detail = str(exc).split("WeightsUnpickler error:", 1)[-1] if "WeightsUnpickler error:" in str(exc) else ""
            detail = first_line(Exception(detail)) if detail.strip() else "objects beyond tensors"
            if head == b"PK\x03\x04":
                what_it_is = f"{path} holds Python objects beyond tensors ({detail[:120]})"
            elif not head.startswith(b"\x80"):  # not a pickle of protocol 2 or later either
                raise UserError(f"cannot read {path} as {what} (neither a torch.save file nor a pickle)") from None
            else:
                what_it_is = (f"{path} is not a torch.save file but another pickle (e.g. pickle.dump), which is "
                              f"read only as tensors and plain values ({detail[:120]})")
            if trust_parameter:
                raise UserError(f"{what_it_is}; if you trust the file, set {trust_parameter}",
                                parameters=[trust_parameter]) from None
            raise UserError(f"{what_it_is}; where you trust it, re-save it with torch.save(state_dict, PATH)") from None
        except Exception as exc:  # noqa: BLE001 - zip errors, truncation, unsupported formats…
            raise UserError(f"cannot read {path} as {what} ({type(exc).__name__}: {first_line(exc)})") from None


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from a ``torch.save`` file (tensors only: ``weights_only=True``, nothing executed)."""
    obj = load_torch_file(path, "a PyTorch state dict")
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UserError(f"{path} does not hold a state dict (a mapping of parameter names to tensors)")
    if obj and all(k.startswith("module.") for k in obj):
        obj = {k[len("module."):]: v for k, v in obj.items()}
    return obj


def load_checked(model: nn.Module, state: dict[str, torch.Tensor], source: str, arch: str,
                 unused_prefixes: tuple[str, ...] = ()) -> None:
    """Load ``state`` into ``model`` after checking every key and shape; one ``UserError`` lists what differs."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state and not k.startswith(unused_prefixes)
               and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in expected]
    wrong = [f"{k} {list(state[k].shape)} (model {list(expected[k].shape)})" for k in state
             if k in expected and state[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {unexpected[0]})")
        if wrong:
            parts.append(f"{len(wrong)} with other shapes (e.g. {wrong[0]})")
        raise UserError(f"{source} does not fit {arch} of this extractor: {'; '.join(parts)} — is it a state dict "
                        f"of another architecture?")
    model.load_state_dict(state, strict=False, assign=True)
    _materialise_leftovers(model)


# ------------------------------------------------------------------------------------------------ weight sources

@dataclass(frozen=True, kw_only=True)
class TorchvisionWeights(WeightSource):
    """The torchvision weight enum member ``member`` of ``arch`` (``resnet152``: ``ResNet152_Weights.IMAGENET1K_V1``),
    cached by torchvision's loader in ``$TORCH_HOME/hub/checkpoints`` (:func:`fetch_imagenet_weights`)."""

    arch: str
    member: str = IMAGENET_DEFAULT

    @property
    def recorded(self) -> str:
        member = imagenet_weights(self.arch, self.member)
        return f"{type(member).__name__}.{member.name}"

    def cached(self) -> Path:
        """Where torchvision keeps the file."""
        return hub_checkpoint_path(imagenet_weights(self.arch, self.member).url)

    def locate(self) -> Path | None:
        return self.cached() if self.cached().is_file() else None

    def fetch(self, quiet: bool = False, mirror: str | None = None) -> Path:
        return fetch_imagenet_weights(self.arch, self.member, quiet=quiet, mirror=mirror)

    def looked_in(self) -> str:
        return str(self.cached().parent)


@dataclass(frozen=True, kw_only=True)
class UrlWeights(WeightSource):
    """A file downloaded from its source's URL (size and checksums checked where the entry has them) into
    ``$RETR_WEIGHTS`` (default ``~/.cache/retr/weights``) under its file name. ``env``: an environment variable
    naming the file itself, looked at first; ``validate(path)``: a check of a downloaded file before it takes its
    name (the detector's strict key-and-shape load), a failure removing it."""

    env: str | None = None
    validate: Callable[[Path], None] | None = None

    @property
    def recorded(self) -> str:
        return f"{self.entry.filename} sha256:{self.entry.sha256 or ''}"

    def default_path(self) -> Path:
        """Where a download goes: ``$RETR_WEIGHTS/<file>``, else ``~/.cache/retr/weights/<file>``."""
        if os.environ.get("RETR_WEIGHTS"):
            return Path(os.environ["RETR_WEIGHTS"]).expanduser() / self.entry.filename
        return Path.home() / ".cache" / "retr" / "weights" / self.entry.filename

    def candidates(self) -> list[Path]:
        """Where :meth:`locate` looks, in order: ``$ENV``, :meth:`default_path`, and ``~/.cache/retr/weights/<file>``
        when ``$RETR_WEIGHTS`` names another folder."""
        candidates = [Path(os.environ[self.env]).expanduser()] if self.env and os.environ.get(self.env) else []
        candidates.append(self.default_path())
        if os.environ.get("RETR_WEIGHTS"):
            candidates.append(Path.home() / ".cache" / "retr" / "weights" / self.entry.filename)
        return candidates

    def locate(self) -> Path | None:
        return next((c for c in self.candidates() if c.is_file()), None)

    def download(self, dest: str | os.PathLike, quiet: bool = False, mirror: str | None = None) -> Path:
        """The file at ``dest``, downloaded there first unless it is there (checked before the rename: size,
        checksums, :attr:`validate`); offline, the one-line error naming ``retr-pipeline fetch-weights KEY``."""
        dest = Path(dest)
        return fetch_source(self.entry, dest.parent, filename=dest.name, mirror=mirror, quiet=quiet,
                            how=f"run retr-pipeline fetch-weights {self.key} on a connected machine and copy the file "
                                f"to {dest}, or pass --weights PATH", validate=self.validate)

    def fetch(self, quiet: bool = False, mirror: str | None = None) -> Path:
        return self.locate() or self.download(self.default_path(), quiet=quiet, mirror=mirror)

    def looked_in(self) -> str:
        return ", ".join(str(c) for c in self.candidates())
