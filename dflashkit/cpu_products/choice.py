"""A choice made by measurement at run time: its candidates, its override, its store and its gate, one mechanism for
every such choice dflashkit makes (docs/cpu-performance.md, "Environment variables").

    TRAIN_PRECISION = Choice("train_precision", ("fp32", "bf16"), default="fp32", gate=1.15)
    TRAIN_PRECISION.override()              # "bf16" under DFLASHKIT_CHOICES=train_precision=bf16, else None
    choice, ms = TRAIN_PRECISION.measure(key, timer)   # override, else the stored entry, else timed and gated
    TRAIN_PRECISION.pick({"fp32": 30.0, "bf16": 20.0})  # the fastest, kept only when the default takes `gate`× as
                                                        # long: "bf16"
    store = TRAIN_PRECISION.store()         # <cache>/train_precision/<machine>.json (None: DFLASHKIT_CHOICES=store=off)
    store.read(usable), store.record(key, entry)        # the entries still usable (fresh, well-formed), by key

What a measurement depends on is its key: the machine (the store's file name digests the CPU model, its
instruction-set flags, the BLAS, the torch version and the thread count, so another machine or build never reads
it) and the choice's own part (shapes, geometry, precision, device), each entry's key in the file. What the key
cannot see is the machine drifting (a virtual machine's neighbours), so every entry carries the time it was measured
and is measured again after `max_age_days` (7), or when stamped in the future beyond that (a clock that jumped).

Every override lives in one environment variable, `DFLASHKIT_CHOICES`: comma-separated `name=value` entries
(`products=stock,train_compile=off,store=off`), each name one of `NAMES` and its value one the choice allows, else a
ConfigError of one line naming the variable, the entry and what was expected. Beside the choices' own names:
`store=off` keeps every measured choice in the process only, `max_age_days=N` sets the age limit. The stores live
in the user cache (`io_utils.cache_root()`: `DFLASHKIT_CACHE`), one folder per choice.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflashkit.errors import ConfigError

ENV = "DFLASHKIT_CHOICES"
# every name an entry may have: the choices (each declared where it is made) and the two settings of their stores
NAMES = (
    "products",
    "native",
    "optimizer",
    "train_precision",
    "capture_precision",
    "train_compile",
    "capture_compile",
    "regenerate_compile",
    "decode_compile",
    "store",
    "max_age_days",
)
DEFAULT_MAX_AGE_DAYS = 7.0
DAY = 86400.0
# a whole pass (a training step, a capture forward) in fp32 or under bf16 autocast: bf16 rounds, so it is kept only
# when at least BF16_GATE times faster (a tie goes to fp32, the reference)
PRECISIONS = ("fp32", "bf16")
BF16_GATE = 1.15


def overrides() -> dict[str, str]:
    """The entries of DFLASHKIT_CHOICES by name (values lower-cased); an entry that is not `name=value` with a known
    name is a ConfigError."""
    return _parse(os.environ.get(ENV, ""))


@functools.lru_cache(maxsize=16)
def _parse(raw: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            continue
        name, eq, value = (s.strip() for s in entry.partition("="))
        if not eq or not value or name.lower() not in NAMES:
            raise ConfigError(f"{ENV}: entry {entry!r}: expected name=value with a name among {', '.join(NAMES)}")
        out[name.lower()] = value.lower()
    return out


def with_override(name: str, value: str | None, raw: str | None = None) -> str:
    """DFLASHKIT_CHOICES (`raw`, default the environment's) with `name` set to `value` (None: removed)."""
    entries = {**_parse(os.environ.get(ENV, "") if raw is None else raw)}
    entries.pop(name, None)
    if value is not None:
        entries[name] = value
    return ",".join(f"{k}={v}" for k, v in entries.items())


def max_age_seconds() -> float:
    """The age limit of a stored entry: `max_age_days` in DFLASHKIT_CHOICES (days ≥ 0; default 7)."""
    raw = overrides().get("max_age_days")
    if raw is None:
        return DEFAULT_MAX_AGE_DAYS * DAY
    try:
        days = float(raw)
    except ValueError:
        days = -1.0
    if not days >= 0 or days == float("inf"):
        raise ConfigError(f"{ENV}: max_age_days={raw!r}: expected a number of days ≥ 0 (0: every choice timed anew)")
    return days * DAY


def stores_kept() -> bool:
    """Whether measured choices are written to the user cache (DFLASHKIT_CHOICES=store=off: the process only)."""
    value = overrides().get("store", "on")
    if value not in ("on", "off"):
        raise ConfigError(f"{ENV}: store={value!r}: expected one of on, off")
    return value == "on"


def machine_file(folder: Path, *extra: str) -> Path:
    """<folder>/<machine>.json, the machine being its CPU model, flags, BLAS, torch version, thread count and `extra`
    (another machine, build or thread count never reads it)."""
    from dflashkit.cpu_products.machine import describe_machine

    m = describe_machine()
    ident = json.dumps([m["cpu"], m["flags"], m["blas"], m["torch"], m["threads"], *extra])
    return folder / f"{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"


def fresh(entry: dict[str, object], now: float, max_age: float) -> bool:
    """Whether a stored entry was measured within `max_age` seconds of `now` (either side: a clock set back)."""
    measured = entry.get("measured_at")
    if isinstance(measured, bool) or not isinstance(measured, int | float):
        return False
    return abs(now - float(measured)) <= max_age


def is_ms(ms: object) -> bool:
    """A stored timing: a number of milliseconds ≥ 0."""
    return isinstance(ms, int | float) and not isinstance(ms, bool) and ms >= 0


@dataclass(frozen=True)
class Store:
    """One choice's entries on this machine: a JSON file `{"machine": …, "choices": {key: entry}}`, written
    atomically; a damaged file or entry is measured again, never trusted; a read-only cache costs only the timing."""

    path: Path

    def read(
        self, usable: Callable[[str, dict[str, Any]], bool], *, now: float | None = None
    ) -> dict[str, dict[str, Any]]:
        """The entries `usable(key, entry)` accepts that were measured within the age limit, by key."""
        if not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        entries = data.get("choices", {}) if isinstance(data, dict) else {}
        now, age = time.time() if now is None else now, max_age_seconds()
        return {
            k: e
            for k, e in (entries.items() if isinstance(entries, dict) else [])
            if isinstance(k, str) and isinstance(e, dict) and usable(k, e) and fresh(e, now, age)
        }

    def write(self, entries: dict[str, dict[str, Any]]) -> None:
        """Every entry, with the machine they were measured on."""
        try:
            from dflashkit.cpu_products.machine import describe_machine
            from dflashkit.io_utils import atomic_write_text

            doc = {"machine": describe_machine(), "choices": entries}
            atomic_write_text(self.path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
        except OSError:
            pass

    def record(self, key: str, entry: dict[str, Any], usable: Callable[[str, dict[str, Any]], bool]) -> None:
        """`entry` for `key`, stamped with the time it was measured, beside the `usable` entries kept."""
        self.write({**self.read(usable), key: {**entry, "measured_at": time.time()}})


@dataclass(frozen=True)
class Choice:
    """One choice made by measurement: its name (its DFLASHKIT_CHOICES entry and its store's folder), the values an
    override may name, the `default` a measured winner must beat by `gate` (its time ÷ the winner's), and whether
    its measurements are kept (`stored`)."""

    name: str
    values: tuple[str, ...]
    default: str | None = None
    gate: float = 1.0
    stored: bool = True

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ValueError(f"{self.name}: not among {ENV}'s names")

    def override(self) -> str | None:
        """The value DFLASHKIT_CHOICES names for this choice (None: measured), validated."""
        value = overrides().get(self.name)
        if value is not None and value not in self.values:
            raise ConfigError(f"{ENV}: {self.name}={value!r}: expected one of {', '.join(self.values)}")
        return value

    def why(self, value: str) -> str:
        """How an override reads in a message: `train_compile=off (DFLASHKIT_CHOICES)`."""
        return f"{self.name}={value} ({ENV})"

    def store(self, *extra: str) -> Store | None:
        """This machine's store of the choice, <cache>/<name>/<machine>.json (`extra`: more the file depends on);
        None under store=off, for a choice never stored, or where the cache cannot be used."""
        from dflashkit.io_utils import cache_root

        if not self.stored or not stores_kept():
            return None
        try:
            folder = cache_root() / self.name
        except ConfigError:
            return None
        return Store(machine_file(folder, *extra))

    def pick(self, ms: dict[str, float]) -> str:
        """The fastest candidate of `ms` (the first of a tie), kept only when the default takes at least `gate`
        times as long; else the default."""
        winner = min(ms, key=ms.__getitem__)
        if self.default in ms and winner != self.default and ms[self.default] < self.gate * ms[winner]:
            return self.default
        return winner

    def measure(
        self,
        key: str,
        candidates: Sequence[str],
        timer: Callable[[str], float],
        *,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        store: Store | None = None,
        device: torch.device | str = "cpu",
    ) -> tuple[str, dict[str, float]]:
        """(the choice for `key`, {candidate: ms} when timed now): the override, else `store`'s fresh entry (not for
        ranks that `all_reduce` their timings: each node has its own store), else every candidate timed once
        (`timer(name)` → seconds; a timer may change the thread count, restored after), the timings summed over
        ranks, `pick`ed and recorded in `store`."""
        forced = self.override()
        if forced:
            return forced, {}
        usable = self.usable_entry(candidates)
        entry = store.read(usable).get(key) if store is not None else None
        if entry is not None and all_reduce is None:
            return str(entry["choice"]), {}
        threads = torch.get_num_threads()
        ms = torch.tensor([1000.0 * timer(c) for c in candidates], dtype=torch.float64, device=device)
        torch.set_num_threads(threads)
        if all_reduce is not None:
            ms = all_reduce(ms)
        timings = {c: round(float(t), 2) for c, t in zip(candidates, ms.tolist(), strict=True)}
        choice = self.pick(timings)
        if store is not None:
            store.record(key, {"choice": choice, **{f"{c}_ms": t for c, t in timings.items()}}, usable)
        return choice, timings

    @staticmethod
    def usable_entry(candidates: Sequence[str]) -> Callable[[str, dict[str, Any]], bool]:
        """A stored entry of `measure`: one of `candidates` chosen, each timed."""
        return lambda _key, e: e.get("choice") in candidates and all(is_ms(e.get(f"{c}_ms")) for c in candidates)


__all__ = [
    "BF16_GATE",
    "DAY",
    "DEFAULT_MAX_AGE_DAYS",
    "ENV",
    "NAMES",
    "PRECISIONS",
    "Choice",
    "Store",
    "fresh",
    "is_ms",
    "machine_file",
    "max_age_seconds",
    "overrides",
    "stores_kept",
    "with_override",
]
