"""Devices a user names: `resolve_device` ("auto" → this rank's GPU or the CPU) and `device_problem` (one line)."""

from __future__ import annotations

import torch

from dflashkit.target.devices import device_problem, resolve_device


def test_auto_is_this_ranks_gpu_when_cuda_is_there_and_the_cpu_otherwise():
    assert resolve_device("auto", 3, cuda_available=True) == torch.device("cuda:3")
    assert resolve_device("auto", cuda_available=True) == torch.device("cuda:0")
    assert resolve_device("auto", 3, cuda_available=False) == torch.device("cpu")
    expected = torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto") == expected  # asks torch when not told


def test_a_named_device_is_taken_as_torch_parses_it():
    assert resolve_device("cpu", 2, cuda_available=True) == torch.device("cpu")
    assert resolve_device("cuda:1", 0, cuda_available=False) == torch.device("cuda:1")


def test_device_problem_names_what_was_expected():
    assert device_problem("cpu") is None
    assert device_problem("auto", allow_auto=True) is None
    assert "or auto" in device_problem("gpu0", allow_auto=True)
    assert device_problem("auto").startswith("expected a device")
    if not torch.cuda.is_available():
        assert "use cpu" in device_problem("cuda:0")
