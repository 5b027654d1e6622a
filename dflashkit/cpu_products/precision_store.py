"""fp32 or bf16 autocast for a whole pass, chosen by timing both on this machine and kept in the user cache: the one
rule behind the training step's precision (`train.precision_choice`) and the capture's (`features.capture_precision`).

    TRAINING = MeasuredPrecision("train_precision", "DFLASHKIT_TRAIN_PRECISION")
    choice, timings = TRAINING.choose(key, timer)   # timer(bf16) → seconds of one real pass in that precision
    # "bf16" or "fp32", {"fp32": ms, "bf16": ms} (empty when stored or forced)

Whether bf16 pays on a CPU depends on its bf16 arithmetic (AVX512-BF16 and AMX do it natively; elsewhere bf16 is
converted around fp32 products and is slower) and on the shapes, so nothing is assumed: both are timed and bf16 is
taken only when at least `MARGIN` faster (bf16 rounds, so a tie goes to fp32, the reference). A choice is kept per
key in `<cache>/<folder>/<machine>.json` and timed again after the age limit of the product choices
(`DFLASHKIT_PRODUCTS_MAX_AGE_DAYS`, default 7; `DFLASHKIT_PRODUCTS_STORE=off` keeps nothing, a directory keeps them
in its `<folder>` subfolder); the kind's environment
variable (fp32 | bf16) replaces the measurement. `all_reduce` sums the timings of every rank before choosing, so
ranks of one run compute alike (a multi-rank choice is timed, never read from one rank's store).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dflashkit.cpu_products.store import kind_file, read_entries, write_choices
from dflashkit.errors import ConfigError

PRECISIONS = ("fp32", "bf16")
MARGIN = 1.15  # bf16 must be at least this much faster (fp32 time ÷ bf16 time)


@dataclass(frozen=True)
class MeasuredPrecision:
    """One kind of pass whose precision is measured: its folder in the user cache and its environment variable."""

    folder: str
    env_var: str

    def store_path(self) -> Path | None:
        """This machine's file: <cache>/<folder>/, or <$DFLASHKIT_PRODUCTS_STORE>/<folder>/ (None when "off")."""
        return kind_file(self.folder)

    def stored_choices(self, path: Path | None = None) -> dict[str, dict[str, Any]]:
        """The stored choices still usable (measured within the age limit), by key."""
        return read_entries(self.store_path() if path is None else path, _usable)

    def forced(self) -> str | None:
        """The environment variable's value (None when unset); an unknown one is a ConfigError naming it."""
        forced = os.environ.get(self.env_var, "").strip()
        if not forced:
            return None
        if forced not in PRECISIONS:
            raise ConfigError(f"{self.env_var}={forced!r}: expected one of {', '.join(PRECISIONS)}")
        return forced

    def choose(
        self,
        key: str,
        timer: Callable[[bool], float],
        *,
        all_reduce: Callable[[Tensor], Tensor] | None = None,
        path: Path | None = None,
        use_store: bool = True,
    ) -> tuple[str, dict[str, float]]:
        """(the precision for `key`, {precision: ms} when timed now). `timer(bf16)` → seconds of one real pass;
        `path` the store (default this machine's file), `use_store` False: neither read nor written."""
        forced = self.forced()
        if forced:
            return forced, {}
        path = (self.store_path() if path is None else path) if use_store else None
        stored = self.stored_choices(path).get(key) if path is not None else None
        if stored is not None and all_reduce is None:
            return str(stored["choice"]), {}
        threads = torch.get_num_threads()
        ms = torch.tensor([1000.0 * timer(p == "bf16") for p in PRECISIONS], dtype=torch.float64)
        torch.set_num_threads(threads)  # a timer may change it (a trial at another thread count)
        if all_reduce is not None:
            ms = all_reduce(ms)
        timings = {p: round(float(t), 2) for p, t in zip(PRECISIONS, ms.tolist(), strict=True)}
        choice = "bf16" if timings["fp32"] >= MARGIN * timings["bf16"] else "fp32"
        entry = {"choice": choice, **{f"{p}_ms": t for p, t in timings.items()}, "measured_at": time.time()}
        write_choices(path, {**self.stored_choices(path), key: entry})
        return choice, timings


def _usable(e: dict[str, Any]) -> bool:
    return e.get("choice") in PRECISIONS and all(_timing(e.get(f"{p}_ms")) for p in PRECISIONS)


def _timing(ms: object) -> bool:
    return isinstance(ms, int | float) and not isinstance(ms, bool) and ms >= 0


__all__ = ["MARGIN", "PRECISIONS", "MeasuredPrecision"]
