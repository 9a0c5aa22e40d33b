"""retr.common.devices: resolve_device, the one device resolver of extraction, parsing and training, and
exact_float32."""
from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch

from retr.common.devices import resolve_device
from retr.common.errors import ParameterError


def test_names_and_devices():
    expected = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("auto") == expected
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize("name, message", [("gpu0", "unknown device 'gpu0'"), ("meta", "unsupported device meta")])
def test_other_names_are_parameter_errors(name, message):
    with pytest.raises(ParameterError, match=message) as caught:
        resolve_device(name)
    assert isinstance(caught.value, ValueError) and caught.value.parameters == ("device",)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_names_the_parameter():
    with pytest.raises(ValueError, match=r"^device cuda:0 asked for, but CUDA is not available here") as caught:
        resolve_device("cuda:0")
    assert caught.value.parameters == ("device",)


def test_every_user_shares_the_one_resolver():
    import retr.extractors.backbone as backbone
    import retr.parsers.backends as backends
    import retr.trainers.training.loop as loop
    assert backends.resolve_device is resolve_device and loop.resolve_device is resolve_device
    assert backbone.resolve_common_device is resolve_device    # plus the extractors' half-precision check


def test_importing_the_module_does_not_import_torch():
    code = "import sys, retr.common.devices, retr.parsers.backends; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def _precisions():
    """Every TF32 setting torch has: the per-backend ones (torch >= 2.9), else the two flags."""
    b = torch.backends
    if hasattr(b.cudnn, "conv"):
        return (b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision, b.cuda.matmul.fp32_precision,
                b.fp32_precision)
    return b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32


@pytest.fixture
def saved_precisions():
    """The TF32 settings are process-wide: put back whatever a test set. torch keeps the older flags and
    ``set_float32_matmul_precision``'s value beside the per-backend settings (and refuses to read a mix of them),
    so those are restored first, then each per-backend setting."""
    b = torch.backends
    names = ["", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv",
             "mkldnn.rnn"]
    found = (functools.reduce(getattr, name.split("."), b) if name else b for name in names)
    owners = [owner for owner in found if hasattr(owner, "fp32_precision")]
    saved = [owner.fp32_precision for owner in owners]
    flags, matmul = (b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32), torch.get_float32_matmul_precision()
    yield
    b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32 = flags
    torch.set_float32_matmul_precision(matmul)
    for owner, value in zip(owners, saved):
        owner.fp32_precision = value


@pytest.mark.parametrize("setup", ["defaults", "matmul high", "conv off"])
def test_exact_float32_turns_tf32_off_inside_and_restores_every_setting(setup, saved_precisions):
    from retr.common.devices import exact_float32

    if setup == "matmul high":
        torch.set_float32_matmul_precision("high")
    elif setup == "conv off":
        torch.backends.cudnn.allow_tf32 = False
    before = _precisions()
    legacy = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    with exact_float32():
        inside = _precisions()
    with pytest.raises(KeyError):
        with exact_float32():
            raise KeyError("restored on the way out too")
    assert _precisions() == before
    # the older flags read as before: the settings were restored, not mixed (torch refuses to read mixed ones)
    assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == legacy
    if len(inside) == 4:
        assert inside[:3] == ("ieee", "ieee", "ieee")
    else:
        assert inside == (False, False)
