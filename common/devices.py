"""Device names → ``torch.device``: one resolver for extraction, parsing and training; and
:func:`exact_float32`, CUDA arithmetic without TF32 where a discrete choice follows it.

torch is imported when :func:`resolve_device` is called, not when this module is imported, so a module that only
passes a device name along (the stanza backend) does not pay for torch at import time."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Iterator

from retr.common.errors import ParameterError

if TYPE_CHECKING:
    import torch


def resolve_device(name: str | torch.device) -> torch.device:
    """``"auto"`` → ``cuda`` when CUDA is available, else ``cpu``; ``cpu``, ``cuda`` and ``cuda:N`` as given.

    Raises :class:`~retr.common.errors.ParameterError` (a ``ValueError`` naming the parameter ``device``) for a name
    that is not a CPU or CUDA device, and for a CUDA device asked for on a machine without CUDA:
    ``device cuda:0 asked for, but CUDA is not available here``."""
    import torch  # cost: torch (importing this module loads no torch)

    if isinstance(name, str) and name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ParameterError(f"unknown device {name!r} (expected auto, cpu, cuda or cuda:N)", "device") from None
    if device.type not in ("cpu", "cuda"):
        raise ParameterError(f"unsupported device {device} (expected auto, cpu, cuda or cuda:N)", "device")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ParameterError(f"device {device} asked for, but CUDA is not available here (use device cpu)",
                             "device")
    return device


@contextmanager
def exact_float32() -> Iterator[None]:
    """Inside: CUDA convolutions (cuDNN) and matrix products in full float32, never TF32; restored on exit.

    PyTorch lets cuDNN convolutions use TF32 by default (10-bit mantissas on Ampere and later GPUs). Where a
    discrete choice follows the arithmetic (the detector's top-k, NMS and box selection), that rounding chooses
    other boxes for one image alone than for the same image in a batch (docs/butd.md, TF32). No effect on a CPU.

    The settings are process-wide, so this is not for threads running CUDA work side by side. On torch >= 2.9 it
    sets torch's per-backend precisions (the older ``allow_tf32`` flags, mixed in, make torch refuse to read
    either); inside, reading ``torch.backends.cudnn.allow_tf32`` raises, and on exit each setting gets back the
    value it read as on entry (one that followed its parent's then keeps that value)."""
    import torch  # cost: torch

    backends = torch.backends
    if hasattr(backends.cudnn, "conv"):     # torch >= 2.9: per-backend precisions (mixing in the old flags breaks them)
        settings = [(backends.cudnn.conv, "fp32_precision"), (backends.cudnn.rnn, "fp32_precision"),
                    (backends.cuda.matmul, "fp32_precision")]
        exact = "ieee"
    else:
        settings = [(backends.cudnn, "allow_tf32"), (backends.cuda.matmul, "allow_tf32")]
        exact = False
    saved = [getattr(owner, name) for owner, name in settings]
    for owner, name in settings:
        setattr(owner, name, exact)
    try:
        yield
    finally:
        for (owner, name), value in zip(settings, saved):
            setattr(owner, name, value)


def float32_arithmetic(tf32: bool = False):
    """The context that CUDA float32 work runs in: :func:`exact_float32`, unless ``tf32`` (a recorded speed
    option: PyTorch's defaults then, with cuDNN's convolutions and RNNs in TF32). Evaluation uses it, so the
    same run scores the same on a CPU and on a GPU (docs/trainer.md#evaluation)."""
    return nullcontext() if tf32 else exact_float32()
