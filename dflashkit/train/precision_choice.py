"""Which precision a CPU training run computes its drafter in (`dtype: auto`), chosen by timing both on this machine.

    precision, timings = choose_precision(drafter_cfg, StepShape(rows=1, tokens=1024, blocks=128), timer)
    # "bf16" or "fp32", {"fp32": ms per step, "bf16": ms per step} (empty when stored or forced)

bf16 autocast runs the drafter's matrix products (and the loss's LM-head products) in bf16 with fp32 weights, fp32
optimizer state and an fp32 loss. Whether that is faster on a CPU depends on its bf16 arithmetic (AVX512-BF16 and
AMX do it natively; elsewhere bf16 is converted around fp32 products and is slower) and on the step's shapes, so
`dtype: auto` on a CPU times one real step of each at the run's geometry (`timer`: `step_cost.time_drafter_step`, a
few seconds) and takes bf16 only when it is at least `MARGIN` faster: bf16 rounds, so a tie goes to fp32, the reference.
On CUDA `auto` is bf16 (tensor cores compute it natively).

A choice is kept in the user cache (`~/.cache/dflashkit/train_precision/<machine>.json`, keyed by the drafter's
geometry and the step's shape) and timed again after the age limit of the measured product choices
(`DFLASHKIT_PRODUCTS_MAX_AGE_DAYS`, default 7); `dflashkit info` lists the stored ones. `DFLASHKIT_TRAIN_PRECISION`
(fp32 | bf16) replaces the measurement; an explicit `dtype` in the config always wins. A run keeps its precision for
life (the training state records it), so a resumed run continues as it began. Ranks sum their timings before
choosing, so every rank of a distributed run computes alike.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dflashkit.drafter.config import DrafterConfig
from dflashkit.train.memory import StepShape

PRECISIONS = ("fp32", "bf16")
ENV_VAR = "DFLASHKIT_TRAIN_PRECISION"
MARGIN = 1.15  # bf16 must be at least this much faster (fp32 step time ÷ bf16 step time)


def geometry_key(cfg: DrafterConfig, shape: StepShape) -> str:
    """What a step's speed depends on: the drafter's widths and depth, its head, the loss's vocabulary, the shape."""
    head = cfg.draft_vocab_size or cfg.vocab_size
    return (
        f"{cfg.kind}:h{cfg.hidden_size}:l{cfg.num_hidden_layers}:a{cfg.num_attention_heads}/{cfg.num_key_value_heads}"
        f"x{cfg.head_dim}:i{cfg.intermediate_size}:f{cfg.num_features}:v{head}:bs{cfg.block_size}"
        f":{shape.rows}x{shape.tokens}x{shape.blocks}"
    )


def store_path() -> Path | None:
    """This machine's file in the user cache (None when the products' store is off or the cache cannot be used)."""
    from dflashkit.cpu_products.machine import describe_machine
    from dflashkit.cpu_products.store import STORE_ENV
    from dflashkit.errors import ConfigError
    from dflashkit.io_utils import cache_root

    if os.environ.get(STORE_ENV, "").strip().lower() == "off":
        return None
    try:
        folder = cache_root() / "train_precision"
    except ConfigError:
        return None
    m = describe_machine()
    ident = json.dumps([m["cpu"], m["flags"], m["blas"], m["torch"], m["threads"]])
    return folder / f"{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"


def stored_choices(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """The stored choices still usable (measured within the age limit), by geometry key."""
    from dflashkit.cpu_products.store import fresh, max_age_seconds

    path = store_path() if path is None else path
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    choices = data.get("choices", {}) if isinstance(data, dict) else {}
    now, age = time.time(), max_age_seconds()
    return {
        k: e
        for k, e in (choices.items() if isinstance(choices, dict) else [])
        if isinstance(e, dict)
        and e.get("choice") in PRECISIONS
        and all(_timing(e.get(f"{p}_ms")) for p in PRECISIONS)
        and fresh(e, now, age)
    }


def _timing(ms: object) -> bool:
    return isinstance(ms, int | float) and not isinstance(ms, bool) and ms >= 0


def _store(path: Path | None, key: str, entry: dict[str, Any]) -> None:
    """Add one choice to the file, as the product choices are written (`cpu_products.store.write_choices`)."""
    from dflashkit.cpu_products.store import write_choices

    write_choices(path, {**stored_choices(path), key: entry})


def forced_precision() -> str | None:
    """DFLASHKIT_TRAIN_PRECISION's value (None when unset); an unknown one is a ConfigError naming it."""
    forced = os.environ.get(ENV_VAR, "").strip()
    if not forced:
        return None
    if forced not in PRECISIONS:
        from dflashkit.errors import ConfigError

        raise ConfigError(f"{ENV_VAR}={forced!r}: expected one of {', '.join(PRECISIONS)}")
    return forced


def choose_precision(
    cfg: DrafterConfig,
    shape: StepShape,
    timer: Callable[[DrafterConfig, StepShape, bool], float],
    *,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
    path: Path | None = None,
    use_store: bool = True,
) -> tuple[str, dict[str, float]]:
    """(the precision a CPU run of drafter `cfg` at `shape` computes in, {precision: ms per step} when timed now).
    `timer(cfg, shape, bf16)` → seconds of one real step (`step_cost.time_drafter_step`); `all_reduce` sums timings
    over ranks; `path` the store (default this machine's file), `use_store` False: neither read nor written."""
    forced = forced_precision()
    if forced:
        return forced, {}
    key = geometry_key(cfg, shape)
    path = (store_path() if path is None else path) if use_store else None
    stored = stored_choices(path).get(key) if path is not None else None
    if stored is not None and all_reduce is None:
        return str(stored["choice"]), {}
    threads = torch.get_num_threads()
    ms = torch.tensor([1000.0 * timer(cfg, shape, p == "bf16") for p in PRECISIONS], dtype=torch.float64)
    torch.set_num_threads(threads)
    if all_reduce is not None:
        ms = all_reduce(ms)
    timings = {p: round(float(t), 2) for p, t in zip(PRECISIONS, ms.tolist(), strict=True)}
    choice = "bf16" if timings["fp32"] >= MARGIN * timings["bf16"] else "fp32"
    _store(path, key, {"choice": choice, **{f"{p}_ms": t for p, t in timings.items()}, "measured_at": time.time()})
    return choice, timings


__all__ = [
    "ENV_VAR",
    "MARGIN",
    "PRECISIONS",
    "choose_precision",
    "forced_precision",
    "geometry_key",
    "store_path",
    "stored_choices",
]
