"""What the measured products (products.py) chose so far, and whether a choice is still being timed.

    choices_report()      # {"machine", "mode", "store", "choices": {shape or pass-group key: entry}}
    choices_by_rows()     # {rows: {"stock": 3, "few_rows": 2}}: how many shapes took each path, per row count
    products_measured()   # whether products on a device are chosen by measurement at all (CPU, mode auto)
    trials_pending()      # a pass group's choice being timed in real decoding steps right now

A benchmark or an evaluation warms up until `trials_pending()` is False, so it times the settled choices — what
every later run on this machine gets from the store — not the candidates' turns of a trial.
"""

from __future__ import annotations

import torch

import dflashkit.cpu_products.products as products


def choices_report() -> dict[str, object]:
    """What was chosen so far (this process and the store), for `dflashkit info` and the benchmarks."""
    from dflashkit.cpu_products.machine import describe_machine

    c = products.chooser()
    if not c._loaded:
        c._load()
    return {
        "machine": describe_machine(),
        "mode": products.mode(),
        "store": str(c.store) if c.store else None,
        "choices": dict(sorted(c.choices.items())),
    }


def choices_by_rows(report: dict[str, object] | None = None) -> dict[int, dict[str, int]]:
    """rows → {choice: how many shapes} (a compact view of `choices_report`)."""
    out: dict[int, dict[str, int]] = {}
    for key, entry in (report or choices_report())["choices"].items():
        rows = int(key.split("x", 1)[0])
        out.setdefault(rows, {}).setdefault(str(entry["choice"]), 0)
        out[rows][str(entry["choice"])] += 1
    return dict(sorted(out.items()))


def products_measured(device: torch.device | str = "cpu") -> bool:
    """Whether products on `device` are chosen by measurement: CPU with products auto (other devices run
    F.linear; a forced path is not timed)."""
    return torch.device(device).type == "cpu" and products.mode() == "auto"


def trials_pending(device: torch.device | str = "cpu") -> bool:
    """Whether a pass group's row count is being timed in real steps right now (in this thread count's chooser).
    A trial paused because its width stopped coming (a width met now and then: the drafter's context rows, a last
    round cut short) does not count: waiting for it would hold a warm-up for a width the timed runs barely meet.
    Never where products are not measured."""
    if not products_measured(device):
        return False
    return products.chooser().trial_running()


__all__ = ["choices_by_rows", "choices_report", "products_measured", "trials_pending"]
