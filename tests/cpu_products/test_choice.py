"""The measured-choice mechanism (cpu_products/choice.py): a trial keeps the winner only past its gate, a store keeps
entries per machine and key for the age limit, and DFLASHKIT_CHOICES carries every override, a bad entry refused in
one line naming the variable, the entry and what was expected."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from dflashkit.cpu_products.choice import (
    DAY,
    ENV,
    Choice,
    Store,
    max_age_seconds,
    overrides,
    stores_kept,
    with_override,
)
from dflashkit.errors import ConfigError
from helpers.choices import set_choice

PRECISION = Choice("train_precision", ("fp32", "bf16"), default="fp32", gate=1.15)


def test_the_gate_keeps_the_default_unless_the_winner_beats_it_by_the_gate() -> None:
    assert PRECISION.pick({"fp32": 30.0, "bf16": 20.0}) == "bf16"  # 1.5× faster
    assert PRECISION.pick({"fp32": 11.0, "bf16": 10.0}) == "fp32"  # 1.1×: within the gate
    assert PRECISION.pick({"fp32": 11.5, "bf16": 10.0}) == "bf16"  # exactly the gate
    assert PRECISION.pick({"fp32": 10.0, "bf16": 20.0}) == "fp32"
    fastest = Choice("optimizer", ("fused", "foreach", "default"))  # no default: the fastest, the first of a tie
    assert fastest.pick({"fused": 2.0, "foreach": 1.0}) == "foreach"
    assert fastest.pick({"fused": 1.0, "foreach": 1.0}) == "fused"
    assert PRECISION.pick({"bf16": 5.0}) == "bf16"  # the default not among the candidates


def test_a_trial_times_every_candidate_once_stores_the_winner_and_reads_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_choice(monkeypatch, "train_precision", None)
    store, calls = Store(tmp_path / "c.json"), []

    def timer(name: str) -> float:
        calls.append(name)
        torch.set_num_threads(1)  # a timer may change the thread count: restored after
        return {"fp32": 0.030, "bf16": 0.010}[name]

    threads = torch.get_num_threads()
    assert PRECISION.measure("k", ("fp32", "bf16"), timer, store=store) == ("bf16", {"fp32": 30.0, "bf16": 10.0})
    assert calls == ["fp32", "bf16"] and torch.get_num_threads() == threads
    entry = json.loads(store.path.read_text())["choices"]["k"]
    assert entry["choice"] == "bf16" and abs(entry["measured_at"] - time.time()) < 60
    assert PRECISION.measure("k", ("fp32", "bf16"), timer, store=store) == ("bf16", {})  # read back, untimed
    assert calls == ["fp32", "bf16"]

    def slower_peer(ms: torch.Tensor) -> torch.Tensor:  # ranks sum their timings and never read the store
        return ms + torch.tensor([0.0, 100.0], dtype=ms.dtype)

    assert PRECISION.measure("k", ("fp32", "bf16"), timer, store=store, all_reduce=slower_peer)[0] == "fp32"
    set_choice(monkeypatch, "train_precision", "bf16")
    assert PRECISION.measure("other", ("fp32", "bf16"), timer, store=store) == ("bf16", {})  # the override: untimed
    assert calls == ["fp32", "bf16"] * 2


def test_a_store_keeps_fresh_usable_entries_and_drops_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    set_choice(monkeypatch, "max_age_days", None)
    store, now = Store(tmp_path / "sub" / "c.json"), time.time()
    usable = PRECISION.usable_entry(("fp32", "bf16"))
    assert store.read(usable) == {}  # no file yet
    good = {"choice": "bf16", "fp32_ms": 2.0, "bf16_ms": 1.0, "measured_at": now}
    store.write({"a": good, "old": {**good, "measured_at": now - 8 * DAY}, "bad": {**good, "bf16_ms": "x"}})
    assert set(store.read(usable)) == {"a"}
    assert json.loads(store.path.read_text())["machine"]["cpu"]  # the machine it was measured on
    store.record("b", {"choice": "fp32", "fp32_ms": 1.0, "bf16_ms": 1.0}, usable)
    assert set(store.read(usable)) == {"a", "b"}  # the stale and damaged entries are not kept
    store.path.write_text("{not json")
    assert store.read(usable) == {}


def test_the_store_lives_in_the_cache_unless_store_is_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not stores_kept() and PRECISION.store() is None  # as the suite runs
    set_choice(monkeypatch, "store", None)
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    store = PRECISION.store()
    assert store is not None and store.path.parent == tmp_path / "train_precision"
    assert PRECISION.store("kernel-a").path != PRECISION.store("kernel-b").path  # more of the key in the file name
    assert Choice("optimizer", ("fused",), stored=False).store() is None


def test_overrides_parse_and_a_bad_entry_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, " products=Stock , train_compile=off,,store=off ")
    assert overrides() == {"products": "stock", "train_compile": "off", "store": "off"}
    assert with_override("products", None) == "train_compile=off,store=off"
    assert with_override("optimizer", "fused", "store=off") == "store=off,optimizer=fused"
    for bad, expected in [
        ("products", "entry 'products': expected name=value with a name among products, native"),
        ("turbo=on", "entry 'turbo=on': expected name=value with a name among products"),
        ("products=", "entry 'products=': expected name=value"),
    ]:
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ConfigError) as e:
            overrides()
        assert str(e.value).startswith(f"DFLASHKIT_CHOICES: {expected}") and "\n" not in str(e.value)
    monkeypatch.setenv(ENV, "train_precision=fp16")
    with pytest.raises(ConfigError, match=r"^DFLASHKIT_CHOICES: train_precision='fp16': expected one of fp32, bf16$"):
        PRECISION.override()
    for bad in ("store=maybe", "max_age_days=-1"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ConfigError, match=f"^DFLASHKIT_CHOICES: {bad.split('=')[0]}="):
            stores_kept() if bad.startswith("store") else max_age_seconds()
    monkeypatch.setenv(ENV, "max_age_days=0.5")
    assert max_age_seconds() == 0.5 * DAY
    with pytest.raises(ValueError, match="not among"):
        Choice("unknown", ("a",))
