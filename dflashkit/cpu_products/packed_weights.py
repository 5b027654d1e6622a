"""MKL's packed GEMM as a product candidate: each weight copied once into MKL's packed layout for one row count.

    y = packed_product(x, w, b)         # x (M, in) · wᵀ + b → (M, out), w packed for M rows on first use
    release(weights, rows)              # drop the packed copies of these weights at that row count
    packed_bytes()                      # bytes held by packed copies now

MKL's ordinary `sgemm` re-packs the weight on every call; for a product of a few rows that packing is a large part
of the call. `torch.ops.mkl._mkl_reorder_linear_weight(w, M)` packs once, `torch.ops.mkl._mkl_linear` then multiplies
without it. Whether that pays depends on the CPU and the row count: it can be cheaper than stock at a few rows and
dearer at one (docs/studies.md, "Verification cost and product selection") — so it is one more candidate timed by
products.py, never a rule.

A packed copy is made for one row count (MKL's packing takes the product's M, N and K), so each width a pass group
runs packed holds a copy of that group's weights: copies are made on first use, kept while their width's choice is
`mkl_packed` or still being timed, and released when another candidate is chosen (`release`). They live within a
budget (a quarter of the machine's memory, `DFLASHKIT_PACKED_MAX_GB` to change it): past it a product is computed by
`F.linear` instead — the same values, only not faster, so a trial that runs out of budget loses to stock, and no
decoding step ever fails for want of memory. A copy is tied to its weight object and its in-place version: a weight
replaced or changed (a drafter in training) is packed again, never multiplied through a stale copy; a weight freed
(its model unloaded) takes its copies with it.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from dflashkit.errors import ConfigError

BUDGET_ENV = "DFLASHKIT_PACKED_MAX_GB"

# (id(weight), rows) → (weak reference to the weight, its _version when packed, packed copy, bytes)
_COPIES: dict[tuple[int, int], tuple[weakref.ref, int, Tensor, int]] = {}


def available() -> bool:
    """Whether this torch build has MKL's packed GEMM (x86 builds with MKL do; ARM builds do not)."""
    mkl = getattr(torch.ops, "mkl", None)
    return bool(
        torch.backends.mkl.is_available()
        and mkl is not None
        and hasattr(mkl, "_mkl_reorder_linear_weight")
        and hasattr(mkl, "_mkl_linear")
    )


_AVAILABLE = available()


def budget_bytes() -> int:
    """The most packed copies may hold: DFLASHKIT_PACKED_MAX_GB, else a quarter of physical memory."""
    value = os.environ.get(BUDGET_ENV, "").strip()
    if value:
        try:
            gb = float(value)
        except ValueError:
            gb = -1.0
        if not gb >= 0:
            raise ConfigError(f"{BUDGET_ENV}={value!r}: expected a number of GB ≥ 0 (0: never pack)")
        return int(gb * (1 << 30))
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 4 << 30  # a system without sysconf: 4 GiB


def packed_bytes() -> int:
    """Bytes of weights held in packed copies now (each as large as its weight in memory actually touched)."""
    return sum(entry[3] for entry in _COPIES.values())


def _copy_for(w: Tensor, rows: int) -> Tensor | None:
    """The packed copy of `w` for `rows` rows, made now if missing or stale; None past the budget."""
    key = (id(w), rows)
    entry = _COPIES.get(key)
    if entry is not None and entry[0]() is w and entry[1] == w._version:
        return entry[2]
    _COPIES.pop(key, None)
    need = w.numel() * w.element_size()
    if packed_bytes() + need > budget_bytes():
        return None
    with torch.inference_mode(False), torch.no_grad():  # a normal tensor: usable in and out of inference mode
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), rows)
    _COPIES[key] = (weakref.ref(w, lambda ref, key=key: _drop_dead(key, ref)), w._version, packed, need)
    return packed


def _drop_dead(key: tuple[int, int], ref: weakref.ref) -> None:
    """A weight was freed (its model unloaded): its packed copy goes with it, not at the next packing."""
    entry = _COPIES.get(key)
    if entry is not None and entry[0] is ref:  # not a newer weight that got the freed one's id
        del _COPIES[key]


def packed_product(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """x (M, in) · wᵀ (+ b) → (M, out) through MKL's packed GEMM; F.linear for what it cannot take (not float32 CPU
    tensors) or past the memory budget. Raises RuntimeError on a build without it (products.py leaves it out)."""
    if not _AVAILABLE:
        raise RuntimeError("this torch build has no MKL packed GEMM")
    rows = x.shape[0]
    if x.dtype != torch.float32 or w.dtype != torch.float32 or not (x.is_cpu and w.is_cpu):
        return F.linear(x, w, b)
    packed = _copy_for(w, rows)
    if packed is None:
        return F.linear(x, w, b)  # (M, out): the budget is spent
    return torch.ops.mkl._mkl_linear(x.contiguous(), packed, w, b, rows)  # (M, out), row-major


def release(weights: list[Tensor], rows: int) -> int:
    """Drop the packed copies of `weights` for `rows` rows; returns the bytes freed."""
    freed = 0
    for w in weights:
        entry = _COPIES.pop((id(w), rows), None)
        if entry is not None:
            freed += entry[3]
    return freed


def release_all() -> None:
    """Drop every packed copy (tests; a process that switches targets)."""
    _COPIES.clear()


__all__ = ["BUDGET_ENV", "available", "budget_bytes", "packed_bytes", "packed_product", "release", "release_all"]
