"""Matrix products for the few rows of a decoding step on CPU (numerically the same products, faster).

    logits = linear_few_rows(hidden, weight)      # hidden (..., H), weight (V, H) → (..., V)
    route_linears(target.layers)                  # every nn.Linear inside: the same, for 2–16 rows
    with stock_products(): ...                    # F.linear everywhere (stock baselines, e.g. HF generate)

A verify pass multiplies 2–16 rows by every weight matrix of the target (and the drafter by its own). `F.linear(x,
W)` hands that to the CPU BLAS as x·Wᵀ with M = rows, and for small M > 1 the BLAS takes a path that costs far
more than streaming W once (bench/verify_cost.py: the LM head of SmolLM2 at 2–4 rows). Computing the same product
weight-stationary, (W·xᵀ)ᵀ, streams W once. Both are the float32 dot products of each row with each weight row;
only the summation order inside a dot product may differ (last-bit differences, as between any two batch shapes
of F.linear). The fast path is taken only where it applies — CPU, 2…`FEW_ROWS` rows, same dtype, no autograd —
so one-row steps (an AR step, HF `generate` at batch 1), training, capture of long sequences and GPUs run
F.linear exactly as before. `Target` routes its decoder layers and the drafter its own layers on construction;
benchmarks time stock baselines (HF `generate`, HF prompt lookup) inside `stock_products()`.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FEW_ROWS = 16
_STOCK = [0]  # > 0 inside stock_products()


@contextlib.contextmanager
def stock_products() -> Iterator[None]:
    """Within this block every product goes to F.linear (nestable)."""
    _STOCK[0] += 1
    try:
        yield
    finally:
        _STOCK[0] -= 1


def linear_few_rows(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, min_rows: int = 2) -> Tensor:
    """x (..., H) @ weight (V, H)ᵀ (+ bias) → (..., V), weight-stationary on CPU for min_rows…FEW_ROWS rows
    (`min_rows=1`: also one row — dflashkit's verifier head, where it beats the BLAS's vector product 2×)."""
    rows = x.numel() // max(1, x.shape[-1])
    if (
        _STOCK[0]
        or x.device.type != "cpu"
        or not max(1, min_rows) <= rows <= FEW_ROWS
        or x.dtype != weight.dtype
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])  # (M, H)
    # one row as a matrix product of two (the BLAS's matrix-vector path is ~2× slower here)
    cols = flat.repeat(2, 1).t() if rows == 1 else flat.t()  # (H, max(M, 2))
    out = torch.mm(weight, cols)[:, :rows].t()  # (M, V)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])  # (..., V)


def _forward(self: nn.Linear, x: Tensor) -> Tensor:
    return linear_few_rows(x, self.weight, self.bias)


def route_linears(module: nn.Module) -> int:
    """Send every plain nn.Linear under `module` through `linear_few_rows` (idempotent); returns how many."""
    n = 0
    for m in module.modules():
        if type(m) is nn.Linear and not getattr(m, "_few_rows", False):
            m.forward = types.MethodType(_forward, m)
            m._few_rows = True
            n += 1
    return n
