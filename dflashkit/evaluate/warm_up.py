"""Warm-up before timing: untimed runs of a method until the CPU's product choices for the widths it meets are settled.

    settle(lambda n: generate(target, ids, drafter=d, settings=DecodeSettings(max_new_tokens=n)), max_new, device)

On CPU, the products of each decoding width are timed inside the real steps at first use (cpu_products/products.py): a
trial runs every candidate — the slower ones too — for a few steps each. A timing that caught those steps would
measure the trial, not the speed every later run on the machine gets from the store. `settle` runs a method for
SETTLE_TOKENS tokens, again while a width's trial is under way (at most SETTLE_RUNS runs); nothing where products
are not measured (GPUs, a path forced by DFLASHKIT_CHOICES=products=…).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dflashkit.cpu_products.report import products_measured, trials_pending

SETTLE_TOKENS = 24  # a run: enough steps at the method's widths for a products trial to start and advance
SETTLE_RUNS = 8  # … repeated while a trial is under way (7 rounds of up to 6 candidates a width, one width at a time)


def settle(run: Callable[[int], object], max_new_tokens: int, device: torch.device | str) -> int:
    """Call `run(n_tokens)` until no product trial is under way (at least once, at most SETTLE_RUNS times, where
    products are measured); returns how many runs it made."""
    if not products_measured(device):
        return 0
    runs = 0
    for i in range(SETTLE_RUNS):
        if i and not trials_pending(device):
            break
        run(min(SETTLE_TOKENS, max_new_tokens))
        runs += 1
    return runs


__all__ = ["SETTLE_RUNS", "SETTLE_TOKENS", "settle"]
