"""The compile choice's rule (cpu_products.compile_choice) with injected step times: forced settings, the gate that
keeps a short run from risking a compile, the trial's schedule and verdict (compiled only when faster beyond the
noise), stored entries deciding later runs by the work they have left, failures recorded unusable."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dflashkit.cpu_products.compile_choice import (
    COMPILED,
    EAGER,
    EAGER_STEPS,
    ROUNDS,
    TRIAL_FACTOR,
    UNKNOWN_COMPILE_S,
    WARM_STEPS,
    MeasuredCompile,
)
from dflashkit.errors import ConfigError
from helpers.choices import set_choice

KIND = MeasuredCompile("train_compile")
LONG = 100 * TRIAL_FACTOR * UNKNOWN_COMPILE_S  # seconds of work: any trial fits


def _run(trial, eager: float, compiled: float, compile_s: float, steps: int = 40) -> list[str]:
    """Feed `steps` steps: each takes `eager` or `compiled` seconds as it runs, the first compiled one plus
    `compile_s`. Returns what each step ran."""
    ran, compiled_yet = [], False
    for _ in range(steps):
        what = trial.current
        ran.append(what)
        t = eager if what == EAGER else compiled
        if what == COMPILED and not compiled_yet:
            t, compiled_yet = t + compile_s, True
        trial.finished(t)
    return ran


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    set_choice(monkeypatch, KIND.name, None)


def test_settings_and_the_environment_force_a_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s.json"
    assert KIND.start("k", "on", lambda s: 0.0, path=path).choice == COMPILED
    assert KIND.start("k", "off", lambda s: LONG, path=path).choice == EAGER
    set_choice(monkeypatch, KIND.name, "on")
    trial = KIND.start("k", "auto", lambda s: 0.0, path=path)
    assert trial.choice == COMPILED and "train_compile=on (DFLASHKIT_CHOICES)" in trial.message
    assert KIND.start("k", "off", lambda s: 0.0, path=path).choice == EAGER  # the config's own value wins
    set_choice(monkeypatch, KIND.name, "sometimes")
    with pytest.raises(
        ConfigError, match=r"DFLASHKIT_CHOICES: train_compile='sometimes': expected one of on, off, measure"
    ):
        KIND.start("k", "auto", lambda s: 0.0, path=path)
    with pytest.raises(ConfigError, match="compile: 'maybe'"):
        KIND.start("k", "maybe", lambda s: 0.0, path=path)
    assert not path.exists()


def test_a_short_run_never_risks_a_compile(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    asked: list[float] = []

    def remaining(step_s: float) -> float:
        asked.append(step_s)
        return 500 * step_s  # 500 steps of 0.4 s: 200 s, less than ten times the assumed compile

    trial = KIND.start("k", "auto", remaining, path=path)
    ran = _run(trial, 0.4, 0.2, 100.0, steps=10)
    assert ran == [EAGER] * 10 and trial.choice == EAGER
    assert asked == [0.4]  # asked once, after the timed eager steps, at their median
    assert "too little to risk compiling" in trial.message and "assumed" in trial.message
    assert not path.exists()  # nothing measured, nothing stored


def test_a_rate_known_beforehand_goes_straight_to_the_gate(tmp_path: Path) -> None:
    """An evaluation's warm-up has timed the eager work already: no eager steps, the gate decides at once."""
    short = KIND.start("k", "auto", lambda rate: 500 * rate, path=tmp_path / "s.json")
    short.known_rate(0.4)
    assert short.choice == EAGER and "too little to risk compiling" in short.message
    asked: list[float] = []
    long = KIND.start("k", "auto", lambda rate: asked.append(rate) or LONG, path=tmp_path / "s.json")
    long.known_rate(0.4)
    assert asked == [0.4] and not long.settled and long.current == COMPILED  # the compile is the next step
    ran = _run(long, 0.4, 0.2, 5.0)
    assert ran[: 2 + 2 * ROUNDS] == [
        COMPILED,
        COMPILED,
        *[COMPILED, EAGER, EAGER, COMPILED, COMPILED, EAGER][: 2 * ROUNDS],
    ]
    assert long.choice == COMPILED and long.compile_s == pytest.approx(5.0 + 0.2 - 0.4)  # its excess over eager
    started = KIND.start("k2", "auto", lambda rate: LONG, path=tmp_path / "s.json")
    started.finished(0.4)  # once steps were timed the rate known elsewhere is not used
    started.known_rate(9.0)
    assert started.pos == 1 and started.eager_s == []


def test_a_long_run_times_both_and_keeps_the_faster(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    trial = KIND.start("k", "auto", lambda s: LONG, path=path)
    ran = _run(trial, 0.4, 0.3, 50.0)
    rounds = [x for r in range(ROUNDS) for x in ((COMPILED, EAGER) if r % 2 == 0 else (EAGER, COMPILED))]
    head = WARM_STEPS + EAGER_STEPS
    assert ran[: head + 2 + 2 * ROUNDS] == [EAGER] * head + [COMPILED, COMPILED] + rounds
    assert trial.choice == COMPILED and set(ran[head + 2 + 2 * ROUNDS :]) == {COMPILED}
    entry = KIND.stored_choices(path)["k"]
    assert entry["choice"] == COMPILED and entry["eager_ms"] == 400 and entry["compiled_ms"] == 300
    assert entry["compile_s"] == pytest.approx(50.0 + 0.3 - 0.4)  # the first compiled step's excess over eager
    assert "timed now" in trial.message


def test_a_compiled_step_not_faster_beyond_the_noise_stays_eager(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    trial = KIND.start("k", "auto", lambda s: LONG, path=path)
    ran = _run(trial, 0.40, 0.395, 20.0)  # 1.25 % faster: within the margin
    assert trial.choice == EAGER and ran[-1] == EAGER
    assert KIND.stored_choices(path)["k"]["choice"] == EAGER


def test_a_stored_trial_decides_by_the_work_left(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    KIND.record(path, "k", {"choice": COMPILED, "eager_ms": 400.0, "compiled_ms": 300.0, "compile_s": 100.0})
    # saves 25 % of the work left: pays from 400 s of eager work on
    short = KIND.start("k", "auto", lambda s: 399.0, path=path)
    assert short.choice == EAGER and "less than it costs" in short.message
    long = KIND.start("k", "auto", lambda s: 2000.0, path=path)
    assert long.choice == COMPILED and "saves ~500 s" in long.message
    KIND.record(path, "slow", {"choice": EAGER, "eager_ms": 400.0, "compiled_ms": 390.0, "compile_s": 10.0})
    assert KIND.start("slow", "auto", lambda s: LONG, path=path).choice == EAGER


def test_the_risk_is_the_longest_compile_recorded_here(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    KIND.record(path, "other", {"choice": EAGER, "eager_ms": 10.0, "compiled_ms": 10.0, "compile_s": 30.0})
    trial = KIND.start("k", "auto", lambda s: TRIAL_FACTOR * 30.0 + 1, path=path)
    assert trial.risk_s == 30.0
    _run(trial, 0.4, 0.2, 30.0, steps=WARM_STEPS + EAGER_STEPS + 1)
    assert trial.schedule[WARM_STEPS + EAGER_STEPS] == COMPILED  # 301 s left ≥ 10 × 30 s: tried
    shorter = KIND.start("k", "auto", lambda s: TRIAL_FACTOR * 30.0 - 1, path=path)
    _run(shorter, 0.4, 0.2, 30.0, steps=WARM_STEPS + EAGER_STEPS)
    assert shorter.choice == EAGER and "recorded" in shorter.message


def test_measure_tries_whatever_the_length(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    set_choice(monkeypatch, KIND.name, "measure")
    path = tmp_path / "s.json"
    KIND.record(path, "k", {"choice": EAGER, "eager_ms": 1.0, "compiled_ms": 1.0, "compile_s": 1.0})
    trial = KIND.start("k", "auto", lambda s: 1.0, path=path)  # a stored entry and a short run: timed anyway
    _run(trial, 0.4, 0.2, 5.0)
    assert trial.choice == COMPILED and KIND.stored_choices(path)["k"]["compile_s"] == pytest.approx(4.8)


def test_a_failed_compile_is_recorded_and_keeps_later_runs_eager(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    trial = KIND.start("k", "auto", lambda s: LONG, path=path)
    for _ in range(WARM_STEPS + EAGER_STEPS):
        trial.finished(0.4)
    assert trial.current == COMPILED
    trial.failed("InvalidCxxCompiler: no working C++ compiler found")
    assert trial.choice == EAGER and "failed" in trial.message
    later = KIND.start("k", "auto", lambda s: LONG, path=path)
    assert later.choice == EAGER and "InvalidCxxCompiler" in later.message


def test_a_distributed_run_reads_no_store_and_a_stale_entry_is_timed_again(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    KIND.record(path, "k", {"choice": COMPILED, "eager_ms": 400.0, "compiled_ms": 100.0, "compile_s": 1.0})
    assert not KIND.start("k", "auto", lambda s: LONG, path=path, distributed=True).settled
    data = json.loads(path.read_text())
    data["choices"]["k"]["measured_at"] = time.time() - 30 * 86400
    path.write_text(json.dumps(data))
    assert not KIND.start("k", "auto", lambda s: LONG, path=path).settled
    path.write_text("{not json")
    assert KIND.stored_choices(path) == {}


def _failing_compiled(calls: list[str], eager_fails: bool = False, error: type[BaseException] = RuntimeError):
    def step(compiled: bool) -> str:
        calls.append("compiled" if compiled else "eager")
        if compiled or eager_fails:
            raise error("boom\ndetail")
        return "ok"

    return step


def test_run_step_reruns_a_failed_compiled_step_eagerly_and_records_it_only_then(tmp_path: Path) -> None:
    path, said = tmp_path / "s.json", []
    trial = KIND.start("k", "on", lambda s: LONG, path=path)
    calls: list[str] = []
    assert trial.run_step(_failing_compiled(calls), say=said.append) == "ok"
    assert calls == ["compiled", "eager"] and trial.choice == EAGER and "that step ran again eagerly" in said[0]
    assert KIND.stored_choices(path)["k"]["unusable"] == "RuntimeError: boom"
    # an eager rerun that fails too: its own error, nothing recorded (not a compile failure)
    path2, calls = tmp_path / "t.json", []
    trial = KIND.start("k", "on", lambda s: LONG, path=path2)
    with pytest.raises(RuntimeError, match="boom"):
        trial.run_step(_failing_compiled(calls, eager_fails=True))
    assert calls == ["compiled", "eager"] and KIND.stored_choices(path2) == {}


def test_run_step_keeps_the_callers_errors_and_out_of_memory_and_stops_a_multi_rank_run(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "s.json"
    for error in (ConfigError, torch.OutOfMemoryError):
        calls: list[str] = []
        trial = KIND.start("k", "on", lambda s: LONG, path=path)
        with pytest.raises(error):
            trial.run_step(_failing_compiled(calls, error=error), keep=(ConfigError,))
        assert calls == ["compiled"] and trial.choice == COMPILED
    assert KIND.stored_choices(path) == {}
    calls = []
    trial = KIND.start("k", "on", lambda s: LONG, path=path)
    with pytest.raises(ConfigError, match=r"torch.compile failed in a step of a multi-rank run \(RuntimeError: boom\)"):
        trial.run_step(_failing_compiled(calls), retry=False)
    assert calls == ["compiled"] and KIND.stored_choices(path)["k"]["unusable"] == "RuntimeError: boom"


def test_a_cheaper_compile_measured_later_keeps_the_recorded_compile_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Graphs or an inductor cache from earlier make a later compile look cheap: a fresh process pays the full one, so
    the key keeps the largest compile time measured; the message says what was timed now."""
    path = tmp_path / "s.json"
    _run(KIND.start("k", "auto", lambda s: LONG, path=path), 0.4, 0.2, 50.0)
    assert KIND.stored_choices(path)["k"]["compile_s"] == pytest.approx(50.0 + 0.2 - 0.4)
    set_choice(monkeypatch, KIND.name, "measure")
    again = KIND.start("k", "auto", lambda s: LONG, path=path)
    _run(again, 0.4, 0.2, 1.0)
    assert KIND.stored_choices(path)["k"]["compile_s"] == pytest.approx(50.0 + 0.2 - 0.4)
    assert "after 1 s compiling (timed now)" in again.message
