"""Where the measured product choices (products.py) are kept between runs, and for how long they are trusted.

    path = store_path()                            # ~/.cache/dflashkit/products/<machine>.json; None with "off"
    choices = read_choices(path, names, now=...)   # the stored entries still usable: timed with every current
                                                   # candidate, and not older than the age limit
    write_choices(path, choices)                   # atomically, under the machine's description
    DFLASHKIT_PRODUCTS_STORE=off|DIR               # default: the user cache
    DFLASHKIT_PRODUCTS_MAX_AGE_DAYS=7              # an older choice is timed again (0: every process times anew)

The file is keyed by CPU model, its flags, BLAS, torch version, thread count and the source of the compiled
candidate (native_rows.py: a changed kernel is timed anew), so another machine, build or kernel never reads it.
What the key cannot see is the machine's own drift: two close candidates can swap places from one day to the next
on the same machine (a virtual machine's neighbours, where its memory lies), so the winner of a width can become the
slower path (docs/cpu-performance.md). A choice therefore carries the time it was measured
(`measured_at`, seconds since the epoch) and is timed again after the age limit — a few seconds of trial steps a
width once a week, against a slower path for good. An entry without that time (stored before it was kept) or
stamped in the future beyond the limit (a clock that jumped) is timed again too.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from dflashkit.errors import ConfigError

STORE_ENV = "DFLASHKIT_PRODUCTS_STORE"  # "off": choices live in the process only; a directory: kept there
MAX_AGE_ENV = "DFLASHKIT_PRODUCTS_MAX_AGE_DAYS"
DEFAULT_MAX_AGE_DAYS = 7.0
DAY = 86400.0


def max_age_seconds() -> float:
    """The age limit of a stored choice, from DFLASHKIT_PRODUCTS_MAX_AGE_DAYS (days, ≥ 0; default 7)."""
    raw = os.environ.get(MAX_AGE_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_AGE_DAYS * DAY
    try:
        days = float(raw)
    except ValueError:
        days = -1.0
    if not days >= 0 or days == float("inf"):
        raise ConfigError(f"{MAX_AGE_ENV}={raw!r}: expected a number of days ≥ 0 (e.g. 7; 0 times every choice anew)")
    return days * DAY


def store_path() -> Path | None:
    """<machine>.json in ~/.cache/dflashkit/products, or in $DFLASHKIT_PRODUCTS_STORE (None when that is "off" or
    the cache cannot be used)."""
    from dflashkit.cpu_products.native_rows import source_digest

    folder = chosen_folder("products")
    kernel = source_digest()
    return None if folder is None else machine_file(folder, kernel)


def chosen_folder(name: str, *, env_subfolder: bool = False) -> Path | None:
    """Where a store of measured choices lives: None under DFLASHKIT_PRODUCTS_STORE=off; the directory it names
    (its `name` subfolder with `env_subfolder`; a file is a ConfigError); else <cache>/<name> (None when the cache
    cannot be used)."""
    from dflashkit.io_utils import cache_root

    chosen = os.environ.get(STORE_ENV, "").strip()
    if chosen.lower() == "off":
        return None
    if chosen:
        folder = Path(chosen).expanduser()
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"{STORE_ENV}={chosen!r} is a file; expected 'off' or a directory")
        return folder / name if env_subfolder else folder
    try:
        return cache_root() / name
    except ConfigError:
        return None


def machine_file(folder: Path, *extra: str) -> Path:
    """<folder>/<machine>.json, the machine being its CPU model, flags, BLAS, torch version, thread count and `extra`
    (another machine, build or thread count never reads it)."""
    from dflashkit.cpu_products.machine import describe_machine

    m = describe_machine()
    ident = json.dumps([m["cpu"], m["flags"], m["blas"], m["torch"], m["threads"], *extra])
    return folder / f"{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"


def kind_file(name: str) -> Path | None:
    """This machine's file of one kind of whole-pass choice (a precision, a compile): <cache>/<name>/, or
    <$DFLASHKIT_PRODUCTS_STORE>/<name>/ (None when that is "off" or the cache cannot be used)."""
    folder = chosen_folder(name, env_subfolder=True)
    return None if folder is None else machine_file(folder)


def read_entries(path: Path | None, usable: Callable[[object], bool]) -> dict[str, dict[str, object]]:
    """The entries of such a file a choice may be made from: those `usable` calls well-formed, measured within the
    age limit (`fresh`), by key; a missing or damaged file gives none."""
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
        if isinstance(k, str) and isinstance(e, dict) and usable(e) and fresh(e, now, age)
    }


def fresh(entry: dict[str, object], now: float, max_age: float) -> bool:
    """Whether a stored entry was measured within `max_age` seconds of `now` (either side: a clock set back)."""
    measured = entry.get("measured_at")
    if isinstance(measured, bool) or not isinstance(measured, int | float):
        return False
    return abs(now - float(measured)) <= max_age


def read_choices(
    path: Path | None, names: Callable[[str], list[str]], *, now: float, max_age: float
) -> dict[str, dict[str, object]]:
    """The entries of the store at `path` that may be used as they are: each timed with every candidate `names(key)`
    gives (one stored before a candidate joined is timed again, with it), choosing one of them, and `fresh`. A
    missing or damaged file gives none, a damaged entry (a key not of the shape-key form, a timing that is not a
    number) is dropped: measured again, never trusted."""
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        choices = data.get("choices", {}) if isinstance(data, dict) else {}
        return {
            key: entry
            for key, entry in choices.items()
            if _KEY.match(key)
            and isinstance(entry, dict)
            and all(f"{n}_ms" in entry and _timing(entry[f"{n}_ms"]) for n in names(key))
            and entry.get("choice") in names(key)
            and fresh(entry, now, max_age)
        }
    except (OSError, ValueError, AttributeError):
        return {}


_KEY = re.compile(r"^\d+x[^:]+:\w+(:b)?$")  # ROWSx…:dtype[:b], as products.shape_key and pass groups write them


def _timing(ms: object) -> bool:
    """A stored timing: milliseconds, or null for a candidate that failed on this shape."""
    return ms is None or (isinstance(ms, int | float) and not isinstance(ms, bool) and math.isfinite(ms) and ms >= 0)


def write_choices(path: Path | None, choices: dict[str, dict[str, object]]) -> None:
    """The choices, atomically, with the machine they were measured on; a read-only cache only costs the timing
    again next time."""
    if path is None:
        return
    try:
        from dflashkit.cpu_products.machine import describe_machine
        from dflashkit.io_utils import atomic_write_text

        doc = {"machine": describe_machine(), "choices": choices}
        atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    except OSError:
        pass


__all__ = [
    "DAY",
    "DEFAULT_MAX_AGE_DAYS",
    "MAX_AGE_ENV",
    "STORE_ENV",
    "chosen_folder",
    "fresh",
    "kind_file",
    "machine_file",
    "max_age_seconds",
    "read_choices",
    "read_entries",
    "store_path",
    "write_choices",
]
