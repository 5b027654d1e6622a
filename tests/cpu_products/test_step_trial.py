"""The step-trial rule alone (step_trial.py): the schedule of a trial's rounds (ABBA, extended), what it records,
and `decide` / `unclear` on given timings — paired by round, never slower than stock beyond the noise."""

from __future__ import annotations

import pytest

from dflashkit.cpu_products.step_trial import StepTrial, decide, unclear


def test_decide_picks_the_faster_only_when_it_wins_round_by_round():
    ms = 1e-3
    clear = decide({"stock": [10 * ms] * 7, "few_rows": [6 * ms] * 7})
    assert clear["choice"] == "few_rows" and clear["stock_ms"] == 10.0 and clear["few_rows_vs_stock"] == 0.6
    within = decide({"stock": [10 * ms] * 7, "few_rows": [9.8 * ms] * 7})  # 2 % faster: within MIN_GAIN
    assert within["choice"] == "stock"
    slower = decide({"stock": [10 * ms] * 7, "few_rows": [14 * ms] * 7})
    assert slower["choice"] == "stock"
    # a machine slowing down over the trial: every round slower than the one before, the candidate 20 % faster in
    # each round — paired by round it wins, though its times spread over stock's
    drift = [10 * ms * (1 + 0.3 * r) for r in range(7)]
    paired = decide({"stock": drift, "few_rows": [0.8 * t for t in drift]})
    assert paired["choice"] == "few_rows" and paired["few_rows_vs_stock"] == 0.8
    # faster in the median, but slower than stock in 2 rounds of 7: not beyond the noise
    mixed = decide({"stock": [10 * ms] * 7, "few_rows": [ms * t for t in (7, 7, 8, 8, 9, 11, 12)]})
    assert mixed["choice"] == "stock" and mixed["few_rows_vs_stock"] == 0.8


def test_unclear_and_extended_schedule():

    ms = 1e-3
    assert unclear({"stock": [10 * ms] * 7, "few_rows": [ms * t for t in (7, 7, 8, 8, 9, 11, 12)]})
    assert not unclear({"stock": [10 * ms] * 7, "few_rows": [6 * ms] * 7})  # clear: chosen
    assert not unclear({"stock": [10 * ms] * 7, "few_rows": [9.8 * ms] * 7})  # within MIN_GAIN: stock, settled
    assert not unclear({"stock": [10 * ms] * 7, "few_rows": [14 * ms] * 7})  # slower
    assert not unclear({"stock": [10 * ms] * 7})
    t = StepTrial(["a", "b"], repeats=3)
    assert t.schedule == ["a", "b", "b", "a", "a", "b"] and t.extensions == 0
    t.extend(2)
    assert t.schedule == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"] and t.extensions == 1


def test_step_trial_schedule_and_recording():

    t = StepTrial(["a", "b", "c"], repeats=2)
    assert t.schedule == ["a", "b", "c", "c", "b", "a"] and t.current == "a"
    t.opened(0.0, unbroken=True)  # the first opening only starts a step
    t.opened(1.5, unbroken=True)
    t.opened(9.0, unbroken=False)  # broken: not recorded, b runs again
    assert t.times == {"a": [1.5], "b": [], "c": []} and t.current == "b"
    for now in (10.0, 11.0, 12.0, 13.0, 14.0):
        t.opened(now, unbroken=True)
    assert t.done and t.times == {"a": [1.5, 1.0], "b": [1.0, 1.0], "c": [1.0, 1.0]}
    with pytest.raises(ValueError):
        StepTrial([], repeats=1)


def test_decide_takes_the_fastest_of_several_candidates_only_beyond_the_noise():
    ms = 1e-3
    three = decide({"stock": [10 * ms] * 7, "few_rows": [8 * ms] * 7, "onednn": [6 * ms] * 7})
    assert three["choice"] == "onednn"
    assert (three["stock_ms"], three["few_rows_ms"], three["onednn_ms"]) == (10.0, 8.0, 6.0)
    assert decide({"stock": [10 * ms] * 7, "few_rows": [12 * ms] * 7, "onednn": [9.9 * ms] * 7})["choice"] == "stock"
    assert decide({"stock": [10 * ms] * 7})["choice"] == "stock"  # no other candidate on this build
