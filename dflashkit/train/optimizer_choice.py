"""Which AdamW implementation a run steps with, chosen by timing the candidates on this machine.

    impl, timings = choose_adamw_impl(list(drafter.parameters()), device)   # "fused" or "foreach", ms per step
    optimizer = make_adamw(drafter.parameters(), impl, lr=…, betas=…, weight_decay=…)

torch offers AdamW as one fused kernel per parameter ("fused": one pass over parameter, gradient and both moments) or as
multi-tensor loops ("foreach": ~10 passes, one per arithmetic step); "default" is torch's own pick (a for loop on CPU,
foreach on CUDA) — also what a resumed run whose state records no implementation steps with. All give the same update up
to float rounding. Which is faster depends on the machine (memory bandwidth, vector units, the device), so
`optimizer_impl: auto` times one step of each candidate on scratch tensors shaped like the drafter's parameters, on the
run's device, at the start of a fresh run (a fraction of a second for a SmolLM2-sized drafter); a DSpark drafter's
Markov embedding (vocabulary × rank) makes the optimizer step a large share of a CPU training step.

A run keeps its choice for life (stored in the training state), so a resumed run continues bit for bit; ranks
sum their timings before choosing, so every rank of a distributed run steps the same way.
`DFLASHKIT_CHOICES=optimizer=fused|foreach|default` replaces the measurement of `auto` (the test suite pins it so runs
compared bit for bit cannot choose differently on a busy machine); an explicit `optimizer_impl` in the config always
wins. The override and the pick are the measured-choice mechanism's (`cpu_products.choice`); nothing is stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from dflashkit.cpu_products.choice import Choice
from dflashkit.target.devices import synchronize

IMPLS = ("fused", "foreach", "default")
OPTIMIZER = Choice("optimizer", IMPLS, stored=False)  # the fastest, no gate (every candidate is exact)
_MEASURE_ELEMENTS = 1 << 26  # at most this many scratch elements per candidate (4 copies live: 1 GiB in fp32)


def make_adamw(
    params: Iterable[Tensor], impl: str, *, lr: float, betas: tuple[float, float], weight_decay: float
) -> torch.optim.AdamW:
    """AdamW stepping with `impl` (one of IMPLS)."""
    if impl not in IMPLS:
        raise ValueError(f"optimizer impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    kw = {"fused": {"fused": True}, "foreach": {"foreach": True}, "default": {}}[impl]
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, **kw)


def available_impls(device: torch.device, dtype: torch.dtype = torch.float32) -> list[str]:
    """The candidates `auto` measures on `device`: fused where torch has the kernel, and foreach."""
    out = []
    for impl in ("fused", "foreach"):
        try:
            p = torch.zeros(2, device=device, dtype=dtype, requires_grad=True)
            p.grad = torch.zeros_like(p)
            make_adamw([p], impl, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0).step()
        except (RuntimeError, ValueError):
            continue
        out.append(impl)
    return out


def _scratch(params: list[Tensor]) -> list[Tensor]:
    """Tensors shaped like `params` (the largest first, up to _MEASURE_ELEMENTS in all, at least one) with a
    gradient — the optimizer's memory traffic per element and per tensor, without touching the drafter."""
    chosen, total = [], 0
    for p in sorted(params, key=lambda t: -t.numel()):
        if chosen and total + p.numel() > _MEASURE_ELEMENTS:
            continue
        chosen.append(p)
        total += p.numel()
    out = []
    for p in chosen:
        s = torch.zeros_like(p, requires_grad=True)
        s.grad = torch.full_like(p, 1e-3)
        out.append(s)
    return out


def time_adamw_step(params: list[Tensor], impl: str, repeats: int = 3) -> float:
    """Seconds of one AdamW step with `impl` over scratch copies of `params` (the fastest of `repeats`, after one
    warm-up step that allocates the moments)."""
    scratch = _scratch(params)
    opt = make_adamw(scratch, impl, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
    best = float("inf")
    for i in range(repeats + 1):
        synchronize(scratch[0].device)
        t0 = time.perf_counter()
        opt.step()
        synchronize(scratch[0].device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


def choose_adamw_impl(
    params: list[Tensor],
    *,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
    timer: Callable[[list[Tensor], str], float] | None = None,
) -> tuple[str, dict[str, float]]:
    """(the faster implementation, {impl: ms per step}) on the parameters' device. `all_reduce` sums the
    timings over ranks (so all choose alike); `timer` measures one candidate (default `time_adamw_step`);
    `DFLASHKIT_CHOICES=optimizer=…` names the implementation instead (no measurement, empty timings)."""
    forced = OPTIMIZER.override()
    if forced:
        return forced, {}
    timer = timer or time_adamw_step
    live = [p for p in params if p.requires_grad]
    device, dtype = live[0].device, live[0].dtype
    impls = available_impls(device, dtype)
    return OPTIMIZER.measure("", impls, lambda impl: timer(live, impl), all_reduce=all_reduce, device=device)


__all__ = ["IMPLS", "OPTIMIZER", "available_impls", "choose_adamw_impl", "make_adamw", "time_adamw_step"]
