"""Per-call cost of dflashkit's measured products against a bare F.linear, on one shape, interleaved.

    python bench/product_overhead.py --rows 1 --in 576 --out 576 --rounds 20 --calls 500

A decoding step of a 30-layer target runs ~210 products, so microseconds of Python around each one are
milliseconds per step. Times `F.linear`, `linear_product` (settled choice: the per-call lookup) and a routed
nn.Linear (what a target layer runs), in alternating rounds on hot weights; prints the minimum and the median
microseconds per call of each, the choice made, the machine, and a JSON line last. Min is the overhead's best
estimate on a shared machine (the median carries the noise of other processes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflashkit.cpu_products.machine import describe_machine
from dflashkit.cpu_products.products import linear_product, route_linears
from dflashkit.cpu_products.report import choices_report


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - t0) / calls


@torch.no_grad()
def measure(rows: int, d_in: int, d_out: int, rounds: int, calls: int) -> dict[str, Any]:
    """Microseconds per call of each path (rounds alternate the paths), with the choice made for the shape."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, rows, d_in, generator=g)  # (1, M, in): a decoding step's rows
    layer = nn.Sequential(nn.Linear(d_in, d_out, bias=False))
    route_linears(layer)
    w = layer[0].weight
    paths: dict[str, Callable[[], object]] = {
        "f_linear": lambda: F.linear(x, w),
        "linear_product": lambda: linear_product(x, w),
        "routed_linear": lambda: layer(x),
    }
    for fn in paths.values():  # settle the choices (first sight, then the measurement) and warm up
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            times[name].append(_per_call_us(fn, calls))
    out: dict[str, Any] = {"rows": rows, "in": d_in, "out": d_out, "rounds": rounds, "calls": calls}
    for name, v in times.items():
        out[f"{name}_us_min"] = round(min(v), 2)
        out[f"{name}_us_median"] = round(statistics.median(v), 2)
    out["overhead_us_min"] = round(out["routed_linear_us_min"] - out["f_linear_us_min"], 2)
    out["choices"] = {k: v["choice"] for k, v in choices_report()["choices"].items()}
    m = describe_machine()
    out["machine"] = {k: m.get(k) for k in ("cpu", "blas", "torch", "threads")}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--in", dest="d_in", type=int, default=576)
    p.add_argument("--out", dest="d_out", type=int, default=576)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--calls", type=int, default=500)
    a = p.parse_args(argv)
    for flag, value in (("--rows", a.rows), ("--in", a.d_in), ("--out", a.d_out), ("--rounds", a.rounds)):
        if value < 1:
            raise SystemExit(f"error: {flag} {value}: expected a positive integer")
    if a.calls < 1:
        raise SystemExit(f"error: --calls {a.calls}: expected a positive integer")
    res = measure(a.rows, a.d_in, a.d_out, a.rounds, a.calls)
    print(f"machine: {res['machine']}")
    print(f"shape {a.rows}×{a.d_in}→{a.d_out}, µs per call (min / median of {a.rounds} rounds × {a.calls} calls):")
    for name in ("f_linear", "linear_product", "routed_linear"):
        print(f"  {name:<16}{res[f'{name}_us_min']:>9.2f} {res[f'{name}_us_median']:>9.2f}")
    print(f"  overhead of a routed linear (min): {res['overhead_us_min']:.2f} µs; choices: {res['choices']}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
