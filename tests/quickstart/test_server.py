"""The quickstart's regeneration route (`--regen-server auto|off`): llama-server only when llama.cpp is built and it
regenerates clearly faster than in-process `generate` on this machine doing the same job, decided from measurements
(injected here; tests/data/test_regenerate.py runs `in_process_rate` on a tiny target)."""

from __future__ import annotations

import pytest

import dflashkit.quickstart.rates as rates_mod
import dflashkit.quickstart.server as server_mod
from dflashkit.quickstart.run import QuickstartSettings, stage_rates


class _Target:
    tokenizer = None


@pytest.fixture
def measured(monkeypatch):
    """In process: decoding rates up to 100 tok/s (prefill and finished rows left out) and 50 tok/s doing the server's
    job at the chosen batch size; the server's rate is set per test."""
    calls = {"server": 0, "in_process_batch": []}

    def fake_measure(target, prompts, *, batches, default_batch, layer_ids, target_lse=False):
        return {"regen_tokens_per_s": {"8": 40.0, "16": 100.0}, "regen_batch": 16, "capture_tokens_per_s": 1.0}

    def fake_in_process(target, prompts, batch):
        calls["in_process_batch"].append(batch)
        return 50.0

    monkeypatch.setattr(rates_mod, "measure_rates", fake_measure)
    monkeypatch.setattr(server_mod, "in_process_rate", fake_in_process)
    monkeypatch.setattr("dflashkit.quickstart.run._train_prompts", lambda target, s: iter([("c", [1, 2, 3])] * 40))

    def with_server(rate: float, built: bool = True, per_slot: dict[int, float] | None = None):
        """The server's rate: `rate` at its best slot count (16 unless `per_slot` says otherwise)."""
        monkeypatch.setattr(server_mod, "server_built", lambda: built)

        def fake_rate(target, prompts, slots):
            calls["server"] += 1
            return (per_slot or {8: 0.9 * rate, 16: rate})[slots]

        monkeypatch.setattr(server_mod, "server_rate", fake_rate)
        return calls

    return with_server


@pytest.mark.parametrize(
    ("server_rate", "route"), [(120.0, "llama-server"), (54.0, "in-process"), (56.0, "llama-server")]
)
def test_the_server_route_needs_a_clear_win(measured, server_rate, route):
    calls = measured(server_rate)
    rates = stage_rates(_Target(), QuickstartSettings(regen_server="auto"), [1])
    assert rates["regen_route"] == route and rates["regen_server_tokens_per_s"] == server_rate
    assert calls["server"] == 2  # > (1 + BATCH_GAIN) · in process on the same job (50 tok/s) takes the server,
    assert calls["in_process_batch"] == [16]  # timed at the chosen batch size, not its decoding rate (100 tok/s)
    assert rates["regen_in_process_tokens_per_s"] == 50.0
    assert rates["regen_server_slots"] == 16
    assert rates["regen_server_tokens_per_s_by_slots"] == {"8": round(0.9 * server_rate, 2), "16": server_rate}


def test_the_faster_slot_count_is_kept_and_a_resumed_run_reuses_it(measured):
    measured(0.0, per_slot={8: 140.0, 16: 120.0})
    rates = stage_rates(_Target(), QuickstartSettings(regen_server="auto"), [1])
    assert rates["regen_server_slots"] == 8 and rates["regen_server_tokens_per_s"] == 140.0
    assert server_mod.server_slots(rates) == 8 and server_mod.server_slots({**rates, "regen_server_slots": 16}) == 16
    assert server_mod.server_slots({"regen_route": "llama-server"}) == server_mod.SERVER_SLOTS  # an older run


def test_off_or_not_built_never_starts_a_server(measured):
    calls = measured(1000.0)
    assert stage_rates(_Target(), QuickstartSettings(regen_server="off"), [1])["regen_route"] == "in-process"
    calls = measured(1000.0, built=False)
    rates = stage_rates(_Target(), QuickstartSettings(regen_server="auto"), [1])
    assert rates["regen_route"] == "in-process" and "regen_server_tokens_per_s" not in rates
    assert calls["server"] == 0 and calls["in_process_batch"] == []


def test_regen_server_setting_is_checked():
    from dflashkit.errors import ConfigError

    with pytest.raises(ConfigError, match="regen_server"):
        QuickstartSettings(regen_server="always")


def test_the_screen_names_the_route():
    from dflashkit.quickstart.screen import _data_line

    prep = {"conversations": 5, "supervised_tokens": 100}
    assert "(llama-server)" not in _data_line(prep)
    assert _data_line({**prep, "regen_route": "llama-server"}).startswith(
        "5 target-regenerated responses (llama-server)"
    )
