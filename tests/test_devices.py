"""retr.common.devices.resolve_device: the one device resolver of extraction, parsing and training."""
from __future__ import annotations

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
