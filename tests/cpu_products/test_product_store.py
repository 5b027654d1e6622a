"""Where measured product choices are kept and for how long: the user cache (DFLASHKIT_CACHE) holds the file unless
DFLASHKIT_CHOICES says store=off, each choice is stamped with when it was measured and timed again past max_age_days
(a machine drifts), an entry without a stamp or stamped in the future beyond the limit is timed again, a bad limit is
refused by name."""

import json
import os
import subprocess
import sys

import pytest
import torch

from dflashkit.cpu_products import native_rows, products
from dflashkit.cpu_products.choice import DAY, Store, fresh, max_age_seconds
from dflashkit.cpu_products.products import CANDIDATES, Chooser, store_path, usable
from dflashkit.errors import ConfigError, TargetError
from helpers.choices import set_choice

N = len(CANDIDATES)
T0 = 1_800_000_000.0  # a wall-clock time (2027): the injected `now` of the choosers below


def _timer(speeds: dict[str, float], calls: list[str]):
    def timer(name, fn):
        fn()
        calls.append(name)
        return speeds.get(name, 50.0)

    return timer


def _settle(c: Chooser, x, w) -> str:
    c.choose(x, w, None)  # first sight: stock, unmeasured
    return c.choose(x, w, None)


def test_where_choices_are_kept_follows_the_cache_and_store_off(monkeypatch, tmp_path):
    """store=off in DFLASHKIT_CHOICES keeps choices in the process (the suite sets it, so processes it starts inherit
    it); otherwise the machine's file is in <DFLASHKIT_CACHE>/products; a cache that is a file is refused by name."""
    assert "store=off" in os.environ["DFLASHKIT_CHOICES"] and store_path() is None
    child = "from dflashkit.cpu_products.products import store_path; print(store_path())"
    assert subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120).stdout == "None\n"
    set_choice(monkeypatch, "store", None)
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "cache"))
    path = store_path()
    assert path.parent == tmp_path / "cache" / "products" and path.suffix == ".json"
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "file"))
    with pytest.raises(TargetError, match=r"DFLASHKIT_CACHE=.* is a file; expected a directory"):
        store_path()


def test_a_changed_kernel_source_reads_another_file(monkeypatch, tmp_path):
    """Choices timed with one version of the compiled kernel are not those of the next (an upgrade re-times them)."""
    set_choice(monkeypatch, "store", None)
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "cache"))
    before = store_path()
    for i, original in enumerate(native_rows.SOURCES):  # the product's kernel, then the layer's
        source = tmp_path / original.name
        source.write_bytes(original.read_bytes() + b"// changed\n")
        changed = list(native_rows.SOURCES)
        changed[i] = source
        with monkeypatch.context() as m:
            m.setattr(native_rows, "SOURCES", tuple(changed))
            after = store_path()
        assert after.parent == before.parent and after != before


def test_a_stored_choice_is_used_for_a_week_then_timed_again(monkeypatch, tmp_path):
    set_choice(monkeypatch, "max_age_days", None)
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(200, 32, generator=g), torch.randn(2, 32, generator=g)
    store, key = tmp_path / "c.json", "2x32x200:float32"
    first = Chooser(timer=_timer({"stock": 1.0, "few_rows": 0.5}, calls := []), store=store, repeats=3, now=lambda: T0)
    assert _settle(first, x, w) == "few_rows" and len(calls) == 3 * N
    assert json.loads(store.read_text())["choices"][key]["measured_at"] == int(T0)

    six_days = Chooser(
        timer=_timer({"stock": 0.5, "few_rows": 1.0}, calls := []), store=store, now=lambda: T0 + 6 * DAY
    )
    assert six_days.choose(x, w, None) == "few_rows" and calls == []  # from the store, untimed (no first sight)

    later = T0 + 8 * DAY  # past the default week: the machine may have changed its mind
    eight_days = Chooser(
        timer=_timer({"stock": 0.5, "few_rows": 1.0}, calls), store=store, repeats=3, now=lambda: later
    )
    assert _settle(eight_days, x, w) == "stock" and len(calls) == 3 * N  # timed again: stock is faster now
    saved = json.loads(store.read_text())["choices"][key]
    assert saved["choice"] == "stock" and saved["measured_at"] == int(later)


def test_the_age_limit_follows_its_entry_and_refuses_a_bad_one(monkeypatch, tmp_path):
    set_choice(monkeypatch, "max_age_days", None)
    assert max_age_seconds() == 7 * DAY
    set_choice(monkeypatch, "max_age_days", "0.5")
    assert max_age_seconds() == 0.5 * DAY
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(200, 32, generator=g), torch.randn(2, 32, generator=g)
    store = tmp_path / "c.json"
    _settle(Chooser(timer=_timer({"stock": 1.0, "few_rows": 0.5}, []), store=store, repeats=3, now=lambda: T0), x, w)
    day_later = Chooser(timer=_timer({"stock": 1.0, "few_rows": 0.5}, calls := []), store=store, now=lambda: T0 + DAY)
    assert day_later.choose(x, w, None) == "stock" and calls == []  # older than half a day: first sight again
    set_choice(monkeypatch, "max_age_days", "0")
    assert max_age_seconds() == 0.0
    for bad in ("a week", "-1", "nan", "inf"):
        set_choice(monkeypatch, "max_age_days", bad)
        with pytest.raises(ConfigError, match=rf"DFLASHKIT_CHOICES: max_age_days='{bad}': expected a number of days"):
            max_age_seconds()
        with pytest.raises(ConfigError, match="DFLASHKIT_CHOICES: max_age_days"):
            Chooser(store=store).choose(x, w, None)  # named when the store is read, not a traceback from inside


def test_entries_without_a_time_from_the_future_or_damaged_are_timed_again(monkeypatch, tmp_path):
    monkeypatch.setattr(products, "_names", lambda key: ["stock", "few_rows"])
    good = {"choice": "few_rows", "stock_ms": 2.0, "few_rows_ms": 1.0, "measured_at": int(T0)}
    choices = {
        "1x8x8:float32": good,
        "2x8x8:float32": {k: v for k, v in good.items() if k != "measured_at"},  # stored before times were kept
        "3x8x8:float32": {**good, "measured_at": int(T0 + 30 * DAY)},  # a clock that was set far ahead
        "4x8x8:float32": {**good, "measured_at": True},  # not a time
        "5x8x8:float32": {**good, "measured_at": int(T0 - DAY)},  # a day old: kept
        "6x8x8:float32": {k: v for k, v in good.items() if k != "few_rows_ms"},  # a candidate not timed
        "7x8x8:float32": {**good, "choice": "gone"},  # a candidate this build lacks
        "8x8x8:float32": "few_rows",  # not an entry
        "9x8x8:float32": {**good, "stock_ms": "x"},  # a timing that is not a number
        "10x8x8:float32": {**good, "few_rows_ms": -1.0},  # … or negative
        "11x8x8:float32:b": {**good, "stock_ms": None},  # a candidate that failed on this shape: kept
        "abc": good,  # not a shape key (`dflashkit info` read its row count from the key)
    }
    store = tmp_path / "c.json"
    store.write_text(json.dumps({"machine": {}, "choices": choices}))
    got = Store(store).read(usable, now=T0)
    assert sorted(got) == ["11x8x8:float32:b", "1x8x8:float32", "5x8x8:float32"]
    assert fresh({"measured_at": T0 + DAY}, T0, 7 * DAY)  # a clock set back a little: still within the limit
    store.write_text('{"choices": [1, 2]}')
    assert Store(store).read(usable, now=T0) == {}
    store.write_text("{not json")
    assert Store(store).read(usable, now=T0) == {}
    assert Store(tmp_path / "none.json").read(usable, now=T0) == {}


def test_info_says_where_choices_are_kept_and_how_old_they_are(monkeypatch, tmp_path):
    import time

    from dflashkit.diagnose.info import _machine, _machine_lines

    monkeypatch.setattr(products.SPEED, "choosers", {})  # choosers read the store variable when made
    lines = "\n".join(_machine_lines(_machine()))
    assert "choices kept      in this process only (DFLASHKIT_CHOICES=store=off" in lines  # as the suite runs
    set_choice(monkeypatch, "store", None)
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    set_choice(monkeypatch, "max_age_days", "10")
    monkeypatch.setattr(products.SPEED, "choosers", {})
    entry = {"choice": "stock", **{f"{n}_ms": 1.0 for n in CANDIDATES}, "measured_at": int(time.time() - 2 * DAY)}
    Store(store_path()).write({"3x8x8:float32": entry})
    lines = "\n".join(_machine_lines(_machine()))
    assert f"choices kept      {store_path()} (timed again after 10 days; the oldest 2 days old)" in lines
    assert "3 rows: stock 1" in lines


def test_a_lone_products_unclear_verdict_is_timed_for_more_rounds_before_stock_is_kept():
    """A candidate ahead of stock in the median but behind it in more than a quarter of the first rounds (a noisy
    machine) is timed further, as a pass's trial is; it is kept when the further rounds confirm the lead."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(40, 16, generator=g), torch.randn(1, 16, generator=g)
    ms = 1e-3
    first = [0.7, 0.8, 1.2, 0.8, 1.3, 0.9, 1.1]  # median 0.9, lost in 3 of 7 rounds: unclear
    calls: list[str] = []

    def timer(name, fn):
        fn()
        calls.append(name)
        if name == "stock":
            return 1 * ms
        if name != "few_rows":
            return 2 * ms
        round_ = calls.count(name) - 1
        return (first[round_] if round_ < len(first) else 0.8) * ms

    c = Chooser(timer=timer, store=None, repeats=7)
    assert _settle(c, x, w) == "few_rows"
    assert calls.count("stock") == 14  # one extension of 7 rounds
    entry = c.choices["1x16x40:float32"]
    assert entry["few_rows_vs_stock"] == 0.8
    steady: list[str] = []
    c2 = Chooser(timer=_timer({"stock": 1.0, "few_rows": 0.8}, steady), store=None, repeats=7)
    assert _settle(c2, x, w) == "few_rows" and steady.count("stock") == 7  # clear at once: no extension
