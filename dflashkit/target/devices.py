"""Devices a user names (`--device`, `drafter_device`, `target_device`): checked before anything is placed there.

    device_problem("cuda:3")   # → "this machine has 1 CUDA device (cuda:0)" or None when it can be used

A device string torch cannot parse, CUDA on a machine without it (torch's own words: "Torch not compiled with CUDA
enabled", deep inside the first `.to()`), an index past the last GPU, or MPS where there is none: each is one line
naming the device and what this machine has, before a model is loaded. `resolve_device("auto", rank)` is the one
place "auto" becomes a device (this rank's GPU when CUDA is there, else the CPU). `synchronize(device)` waits for a
device's queued work (a no-op off CUDA), so wall-clock timings include it.
"""

from __future__ import annotations

import torch

KINDS = ("cpu", "cuda", "mps")


def device_problem(spec: str, *, allow_auto: bool = False) -> str | None:
    """Why `spec` cannot be used on this machine ("expected …"), or None when it can."""
    if allow_auto and spec == "auto":
        return None
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError, TypeError):
        return "expected a device: cpu, cuda, cuda:N" + (" or auto" if allow_auto else "")
    if device.type not in KINDS:
        return f"expected a device of kind {', '.join(KINDS)} (got kind {device.type!r})"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            return f"expected a device this machine has: {why}; use cpu"
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            return f"expected a device this machine has: {count} CUDA device(s), cuda:0 … cuda:{count - 1}"
    if device.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        return "expected a device this machine has: MPS is not available; use cpu"
    return None


def resolve_device(spec: str, local_rank: int = 0, *, cuda_available: bool | None = None) -> torch.device:
    """The device `spec` means here: "auto" is `cuda:<local_rank>` when CUDA is available (`cuda_available`, asked of
    torch when None), else the CPU; any other spec as torch parses it."""
    if spec == "auto":
        cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
        return torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
    return torch.device(spec)


def synchronize(device: torch.device) -> None:
    """Wait until `device` has finished its queued work (CUDA); nothing to wait for elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["KINDS", "device_problem", "resolve_device", "synchronize"]
