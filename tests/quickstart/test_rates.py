"""The quickstart's start-of-run measurements and last-screen notes (`dflashkit.quickstart.rates`): the regeneration
batch size changes only when another is clearly faster, the decode rate leaves the prefill out, a DSpark run's
capture rate includes its log-sum-exp pass, and a stage is named when it got much less than at its own start."""

from __future__ import annotations

import pytest


def test_quickstart_shortfall_notes_compare_each_stage_with_its_own_start():
    """The last screen names a stage that got much less over its budget than at its start on this very machine
    (regeneration's first chunk, training's first steps) — no constant from another CPU."""
    from dflashkit.quickstart.rates import shortfall_notes

    steady = {
        "done": {
            "prepare": {"regen_batch": 16, "regen_tokens_per_s": 45.0, "regen_first_chunk_tokens_per_s": 50.0},
            "train": {"steps_per_min": 70.0, "first_steps_per_min": 80.0},
            "eval": {"mtbench": {"prompts": 8, "requested": 8}},
        },
    }
    assert shortfall_notes(steady) == []
    busy = {
        "done": {
            "prepare": {"regen_batch": 16, "regen_tokens_per_s": 20.0, "regen_first_chunk_tokens_per_s": 50.0},
            "train": {"steps_per_min": 30.0, "first_steps_per_min": 80.0},
            "eval": {"mtbench": {"prompts": 3, "requested": 8}},
        },
    }
    notes = shortfall_notes(busy)
    assert len(notes) == 3
    assert "20 tok/s" in notes[0] and "first batches ran at 50 tok/s" in notes[0]
    assert "30 steps/min" in notes[1] and "first steps ran at 80" in notes[1]
    assert "3 of 8 prompts" in notes[2]
    unmeasured = {"done": {**busy["done"], "prepare": {"regen_batch": 16, "regen_tokens_per_s": 20.0}}}
    assert shortfall_notes(unmeasured) == notes[1:]  # no first-chunk rate recorded: no regeneration claim


def test_rates_pick_a_batch_size_only_when_it_is_clearly_faster(monkeypatch):
    from dflashkit.quickstart import rates as qr

    speeds = {8: 40.0, 16: 50.0, 32: 54.0}  # 32 is 8 % faster: within BATCH_GAIN, keep 16
    calls = []
    monkeypatch.setattr(
        qr, "_decode_rate", lambda target, prompts: calls.append(("rate", len(prompts))) or speeds[len(prompts)]
    )
    monkeypatch.setattr(qr, "_regen_rate", lambda target, prompts, n: calls.append((len(prompts), n)) or 1.0)
    monkeypatch.setattr(qr, "_capture_rate", lambda target, ids, **kw: 900.0)
    r = qr.measure_rates(None, [list(range(100))] * 32, batches=(8, 16, 32), default_batch=16, layer_ids=[1])
    # every batch size runs once untimed first (its product choice is timed then, not inside its rate)
    assert calls == [(8, 2), (16, 2), (32, 2), ("rate", 8), ("rate", 16), ("rate", 32)]
    assert r["regen_batch"] == 16 and r["regen_tokens_per_s"] == {"8": 40.0, "16": 50.0, "32": 54.0}
    speeds[32] = 70.0
    assert qr.measure_rates(None, [[1]] * 32, batches=(8, 16, 32), default_batch=16, layer_ids=[1])["regen_batch"] == 32
    assert qr.original_token_budget(r) == int(900 * 60 * qr.ORIGINAL_CAPTURE_MINUTES)
    assert qr.first_steps_rate([9.0] * 5 + [0.5] * 20 + [2.0] * 100) == 120.0 and qr.first_steps_rate([1.0] * 6) is None


def test_the_capture_rate_of_a_dspark_run_includes_the_log_sum_exp(tiny_llama_dir, monkeypatch):
    """A DSpark quickstart's capture also stores the target's log-sum-exp (one more LM-head pass): the start-of-run
    capture rate, which sizes the original-text data, times that pass too."""
    from dflashkit.quickstart import rates as qr
    from dflashkit.target import logsumexp as lse_mod
    from dflashkit.target.model import Target

    target = Target.load(tiny_llama_dir)
    calls, real = [], lse_mod.row_logsumexp
    monkeypatch.setattr(lse_mod, "row_logsumexp", lambda t, h, chunk=None: calls.append(tuple(h.shape)) or real(t, h))
    assert qr._capture_rate(target, [1], tokens=16) > 0 and calls == []
    assert qr._capture_rate(target, [1], tokens=16, target_lse=True) > 0
    assert calls == [(16, target.hidden_size)] * 2  # the best of two timed runs, each with the pass
    seen = []
    monkeypatch.setattr(qr, "_capture_rate", lambda target, ids, **kw: seen.append(kw) or 1.0)
    monkeypatch.setattr(qr, "_decode_rate", lambda target, prompts: 1.0)
    monkeypatch.setattr(qr, "_regen_rate", lambda target, prompts, n: 1.0)
    qr.measure_rates(None, [[1]] * 8, batches=(8,), default_batch=8, layer_ids=[1], target_lse=True)
    assert seen == [{"target_lse": True}]


def test_the_decode_rate_leaves_the_prefill_out(monkeypatch):
    """Runs of 2 and 2 + CALIBRATION_TOKENS new tokens: the rate is the extra tokens over the extra seconds, so a
    slow prefill (here 10 s) does not count; prompts are cut to their last CALIBRATION_PROMPT tokens."""
    from dflashkit.quickstart import rates as qr

    seen = []

    def timed(target, prompts, n):  # 10 s prefill + 0.5 s per step, whatever the batch
        seen.append(max(len(p) for p in prompts))
        return len(prompts) * n / (10.0 + 0.5 * n)

    monkeypatch.setattr(qr, "_regen_rate", timed)
    assert qr._decode_rate(None, [[1] * 5] * 8) == pytest.approx(8 / 0.5)
    monkeypatch.setattr(qr, "_decode_rate", lambda target, prompts: 1.0)
    monkeypatch.setattr(qr, "_capture_rate", lambda target, ids, **kw: 1.0)
    seen.clear()
    qr.measure_rates(None, [list(range(500))] * 8, batches=(8,), default_batch=8, layer_ids=[1])
    assert seen == [qr.CALIBRATION_PROMPT]
