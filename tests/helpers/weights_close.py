"""Tolerances for comparing training runs that should be equal up to float summation order.

Two runs that compute the same gradients in a different order (one batch of 2 rows vs 2 accumulated rows of 1;
2 ranks vs 1 process; AVX2 vs AVX-512 kernels) differ in the last bits of every gradient. How far that carries
depends on the claim:

* gradients (and the loss) of the same weights: float32 accumulation over ~10³ terms (unit roundoff 6e-8) — a
  relative error of ~1e-4 of the tensor's scale at worst. `assert_grads_close` checks that, and it is the check
  that catches a wrong normaliser (Adam below would not: it is invariant to the gradient's scale).
* weights after AdamW steps: Adam divides by √v, so a parameter whose gradient is ~0 takes an lr-sized step in
  the direction of its rounding noise. Such elements may differ by up to ~lr per step in each run; all others
  stay within float noise. `assert_close_after_adam` bounds every element by that ceiling and allows only a
  small fraction of elements past a tight tolerance.
"""

from __future__ import annotations

import torch

ADAM_STEP_CEILING = 1.5  # |m̂/√v̂| of AdamW in its first steps (β = 0.9, 0.999) stays below this


def assert_grads_close(a: list[torch.Tensor], b: list[torch.Tensor], *, rel: float = 1e-4) -> None:
    """Each gradient tensor of `a` equals `b`'s within `rel` × (b's largest magnitude) elementwise."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        scale = float(y.abs().max())
        torch.testing.assert_close(x, y, rtol=rel, atol=rel * scale + 1e-12, msg=lambda m, i=i: f"grad {i}: {m}")


def assert_close_after_adam(
    a: dict[str, torch.Tensor],
    b: dict[str, torch.Tensor],
    *,
    lr: float,
    steps: int,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    max_outlier_fraction: float = 0.01,
) -> None:
    """Weights after `steps` AdamW steps of learning rate ≤ `lr` from the same start: every element within the
    Adam ceiling (two runs moving apart: 2 · 1.5 · lr per step), and at most `max_outlier_fraction` of all
    elements past `atol + rtol·|b|`."""
    assert a.keys() == b.keys()
    ceiling = 2 * ADAM_STEP_CEILING * lr * steps
    outliers = total = 0
    for k in a:
        d = (a[k].float() - b[k].float()).abs()
        assert float(d.max()) <= ceiling, f"{k}: max |Δ| {float(d.max()):.3g} > Adam ceiling {ceiling:.3g}"
        outliers += int((d > atol + rtol * b[k].float().abs()).sum())
        total += d.numel()
    assert outliers <= max_outlier_fraction * total, (
        f"{outliers} of {total} weights differ by more than {atol} + {rtol}·|w| (allowed: "
        f"{max_outlier_fraction:.0%}, the parameters whose gradients are ~0)"
    )
