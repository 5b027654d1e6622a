"""`eval --compile auto` (evaluate.decode_compile): the trial runs in the warm-up and never in a timed prompt, its
compiled runs decode what the eager runs decode (a stand-in for torch.compile), a failing compile reruns eagerly and
is recorded, a short evaluation never tries, a stored verdict compiles before the first timed run; one slow test runs
torch.compile itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dflashkit.evaluate.evaluate as ev
from dflashkit.cpu_products.compile_choice import COMPILED, ROUNDS
from dflashkit.evaluate.decode_compile import DECODE_COMPILE, compile_key
from dflashkit.evaluate.evaluate import EvalSettings, evaluate
from dflashkit.evaluate.report import render
from dflashkit.evaluate.stats import verify_width
from dflashkit.target.compiled_layers import GRAPHS_PER_LAYER, compiled_layers
from dflashkit.target.model import Target
from helpers.choices import set_choice
from helpers.fake_compile import fake_layer_compile
from helpers.oracles import make_prompts, oracle_for

METHODS = "ar,chain,ddtree:4"
RUNS = 3  # AR, chain, DDTree-4 per prompt
N_NEW = 12


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return Target.load(tiny_llama_dir)


@pytest.fixture(scope="module")
def setup(llama):
    prompts = make_prompts(2, seed=11)
    torch.manual_seed(0)
    return prompts, {"d": oracle_for(llama, prompts, N_NEW, p_correct=0.7, seed=4)}


@pytest.fixture(scope="module")
def key(llama, setup) -> str:
    """The store's key of these evaluations: the runs' verify widths (the chain's block, the tree's budget)."""
    return compile_key(llama, ["ar", f"chain:{verify_width(setup[1]['d'], None)}", "ddtree:4"])


@pytest.fixture
def fake_compile(llama, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """(calls, set_fail): torch.compile replaced by a counting (or failing) stand-in; the store in tmp_path; products
    not measured (their settling runs are not what these tests look at)."""
    set_choice(monkeypatch, "products", "stock")
    with fake_layer_compile(
        llama, monkeypatch, tmp_path / "store", "decode_compile", "InductorError: lowering failed"
    ) as f:
        yield f


def _evaluate(llama, setup, out: Path, **kw) -> dict:
    prompts, drafters = setup
    settings = EvalSettings(methods=METHODS, max_new_tokens=N_NEW, progress=False, stop_token_ids=(), **kw)
    return evaluate(llama, drafters, prompts, out_dir=out, settings=settings)


def _decoded(out: Path) -> list:
    """What each prompt's runs decoded (not their times)."""
    keep = ("n_tokens", "acceptance_lengths", "drafted", "stop_reason", "greedy_equal")
    recs = [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines()]
    return [
        (r["id"], r["ar"]["n_tokens"], {m: {k: v.get(k) for k in keep} for m, v in r["runs"]["d"].items()})
        for r in recs
    ]


def _compiled_probe(llama, monkeypatch: pytest.MonkeyPatch, before_call=lambda i: None) -> list[bool]:
    """Per generate call: were the target's layers compiled ones (an instance `forward`) when it started?
    `before_call(i)` runs before the i-th call."""
    seen: list[bool] = []
    real = ev.generate
    layer = llama.text_model.layers[0]

    def probe(*a, **k):
        before_call(len(seen))
        seen.append("forward" in layer.__dict__)
        return real(*a, **k)

    monkeypatch.setattr(ev, "generate", probe)
    return seen


def test_a_measured_trial_decodes_as_eager_and_stores_its_verdict(
    llama, key, setup, tmp_path: Path, fake_compile, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    calls, _ = fake_compile
    eager = _evaluate(llama, setup, tmp_path / "eager", compile="off")
    assert calls == [] and eager["decode_compile"]["choice"] == "eager"
    set_choice(monkeypatch, "decode_compile", "measure")
    seen = _compiled_probe(llama, monkeypatch)
    doc = _evaluate(llama, setup, tmp_path / "measured")
    assert _decoded(tmp_path / "measured") == _decoded(tmp_path / "eager")
    entry = DECODE_COMPILE.stored_choices()[key]
    assert entry["eager_ms"] > 0 and entry["compile_s"] >= 0
    assert doc["decode_compile"]["choice"] == entry["choice"] and "timed now" in doc["decode_compile"]["why"]
    assert "decode: torch.compile:" in capsys.readouterr().out
    runs = RUNS
    timed = seen[-2 * runs :]  # 2 prompts × (AR, chain, DDTree-4), after the warm-up
    warm = seen[: -2 * runs]
    assert sum(warm) == (2 + ROUNDS) * runs  # the compile, one untimed round, a compiled one in each ABBA round
    assert all(timed) if entry["choice"] == COMPILED else not any(timed)
    assert len(calls) >= (2 + ROUNDS) * runs * llama.num_layers  # the compiled rounds ran through the stand-in


def test_a_failing_compile_reruns_eagerly_and_is_recorded(
    llama, key, setup, tmp_path: Path, fake_compile, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls, set_fail = fake_compile
    _evaluate(llama, setup, tmp_path / "eager", compile="off")
    set_fail(True)
    set_choice(monkeypatch, "decode_compile", "measure")
    doc = _evaluate(llama, setup, tmp_path / "failed")
    assert _decoded(tmp_path / "failed") == _decoded(tmp_path / "eager") and len(calls) == 1
    assert doc["decode_compile"]["choice"] == "eager" and "failed" in doc["decode_compile"]["why"]
    report = render(tmp_path / "failed" / "results.json")
    assert "- torch.compile of the target's layers while decoding: eager: the compiled step failed (Runtime" in report
    set_choice(monkeypatch, "decode_compile", None)
    entry = DECODE_COMPILE.stored_choices()[key]
    assert entry["unusable"] == "RuntimeError: InductorError: lowering failed"


def test_a_short_auto_evaluation_never_compiles(
    llama, setup, tmp_path: Path, fake_compile, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls, _ = fake_compile
    seen = _compiled_probe(llama, monkeypatch)
    doc = _evaluate(llama, setup, tmp_path / "auto")
    assert calls == [] and DECODE_COMPILE.stored_choices() == {} and not any(seen)
    assert doc["decode_compile"]["choice"] == "eager" and "too little to risk" in doc["decode_compile"]["why"]
    # the warm-up's eager rate came from one timed round, no trial rounds: 4-token runs, then one round a method
    assert len(seen) == 2 * RUNS + 2 * RUNS


def test_a_stored_compiled_verdict_compiles_in_the_warm_up_before_anything_is_timed(
    llama, key, setup, tmp_path: Path, fake_compile, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls, _ = fake_compile
    entry = {"choice": COMPILED, "eager_ms": 4000.0, "compiled_ms": 1000.0, "compile_s": 0.01}
    DECODE_COMPILE.record(DECODE_COMPILE.store_path(), key, entry)
    seen = _compiled_probe(llama, monkeypatch)
    doc = _evaluate(llama, setup, tmp_path / "stored")
    runs = RUNS
    assert doc["decode_compile"]["choice"] == COMPILED and "timed before" in doc["decode_compile"]["why"]
    assert seen[-3 * runs :] == [True] * 3 * runs  # one compiled warm-up round, then every timed run
    assert not any(seen[: -3 * runs])  # the 4-token first runs stay eager
    assert calls


def test_without_a_warm_up_auto_stays_eager_and_on_compiles(
    llama, setup, tmp_path: Path, fake_compile, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls, _ = fake_compile
    set_choice(monkeypatch, "decode_compile", "measure")  # even a trial asked for has nowhere to run
    doc = _evaluate(llama, setup, tmp_path / "a", warmup=False)
    assert doc["decode_compile"]["choice"] == "eager" and "--no-warmup" in doc["decode_compile"]["why"] and not calls
    set_choice(monkeypatch, "decode_compile", None)
    seen = _compiled_probe(llama, monkeypatch)
    doc = _evaluate(llama, setup, tmp_path / "b", warmup=False, compile="on")
    assert doc["decode_compile"] == {"choice": COMPILED, "why": "compile: on → compiled", "prompts_compiled": 2}
    assert seen == [True] * (RUNS + 2 * RUNS) and calls  # one untimed compiled round pays the compile first


def test_a_compile_failing_in_a_timed_prompt_runs_that_prompt_again_eagerly(
    llama, key, setup, tmp_path: Path, fake_compile, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AR and the methods of one prompt run alike: the prompt whose chain run failed compiled runs again, all eager;
    the records and results.json say which prompts ran compiled."""
    _, set_fail = fake_compile
    _evaluate(llama, setup, tmp_path / "eager", compile="off")
    DECODE_COMPILE.record(
        DECODE_COMPILE.store_path(),
        key,
        {"choice": COMPILED, "eager_ms": 4000.0, "compiled_ms": 1000.0, "compile_s": 0.01},
    )
    warm = RUNS + RUNS  # the 4-token runs, then the compiled round
    seen = _compiled_probe(llama, monkeypatch, lambda i: i == warm + RUNS + 1 and set_fail(True))  # prompt 2's chain
    doc = _evaluate(llama, setup, tmp_path / "failed")
    assert _decoded(tmp_path / "failed") == _decoded(tmp_path / "eager")
    # prompt 2: AR compiled, the chain's compiled run fails and runs again eagerly, DDTree eager; then all of it eager
    assert seen[warm:] == [True] * RUNS + [True, True, False, False] + [False] * RUNS
    records = [json.loads(line) for line in (tmp_path / "failed" / "progress.jsonl").read_text().splitlines()]
    assert [r["compiled"] for r in records] == [True, False]
    assert doc["decode_compile"]["choice"] == "eager" and doc["decode_compile"]["prompts_compiled"] == 1
    assert DECODE_COMPILE.stored_choices()[key]["unusable"].startswith("RuntimeError: InductorError")


def test_a_second_evaluation_in_the_process_counts_the_compile_as_paid(
    llama, key, setup, tmp_path: Path, fake_compile, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stored verdict whose compile this evaluation could not repay is still taken once this process compiled the
    same runs (a second temperature): its graphs exist."""
    entry = {"choice": COMPILED, "eager_ms": 4000.0, "compiled_ms": 3900.0, "compile_s": 1e6}
    DECODE_COMPILE.record(DECODE_COMPILE.store_path(), key, entry)
    first = _evaluate(llama, setup, tmp_path / "a")
    assert first["decode_compile"]["choice"] == "eager" and "less than it costs" in first["decode_compile"]["why"]
    _evaluate(llama, setup, tmp_path / "b", compile="on")
    again = _evaluate(llama, setup, tmp_path / "c")
    assert again["decode_compile"]["choice"] == COMPILED and "compiled already" in again["decode_compile"]["why"]


def test_the_compiled_layers_raise_the_recompile_limit_only_inside(llama) -> None:
    """Over a KV cache each layer gets graphs of its own (its index is a constant to torch.compile): the default limit
    (8 for all layers) would leave every layer past the eighth eager."""
    config = torch._dynamo.config
    before = (config.recompile_limit, config.accumulated_recompile_limit)
    with compiled_layers(llama):
        assert config.recompile_limit >= GRAPHS_PER_LAYER * llama.num_layers
        assert config.accumulated_recompile_limit >= config.recompile_limit
    assert (config.recompile_limit, config.accumulated_recompile_limit) == before
    llama.__dict__.pop("_compiled_layer_forwards", None)


@pytest.mark.slow
def test_really_compiled_decoding_decodes_as_eager(
    llama, key, setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.compile itself (inductor), every timed run through it: the decoded tokens are the eager ones; then a
    measured trial stores its verdict."""
    llama.__dict__.pop("_compiled_layer_forwards", None)
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "store"))
    set_choice(monkeypatch, "store", None)
    _evaluate(llama, setup, tmp_path / "eager", compile="off")
    doc = _evaluate(llama, setup, tmp_path / "real", compile="on")
    assert doc["decode_compile"] == {"choice": COMPILED, "why": "compile: on → compiled", "prompts_compiled": 2}
    assert _decoded(tmp_path / "real") == _decoded(tmp_path / "eager")
    set_choice(monkeypatch, "decode_compile", "measure")
    doc = _evaluate(llama, setup, tmp_path / "measured")
    llama.__dict__.pop("_compiled_layer_forwards", None)
    assert _decoded(tmp_path / "measured") == _decoded(tmp_path / "eager")
    set_choice(monkeypatch, "decode_compile", None)
    assert "unusable" not in DECODE_COMPILE.stored_choices()[key]


def test_info_lists_the_decode_compile_choices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dflashkit.diagnose.info import _compile_lines, _measured_compile

    def lines() -> list[str]:
        return _compile_lines(_measured_compile("decode", DECODE_COMPILE), "decode")

    assert lines() == [
        "  decode compile    decode_compile=off (DFLASHKIT_CHOICES) under compile auto"
    ]  # as the suite runs
    set_choice(monkeypatch, "decode_compile", None)
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    set_choice(monkeypatch, "store", None)
    assert lines() == ["  decode compile    compile auto: timed in a long evaluation's warm-up (none stored yet)"]
    entry = {"choice": "eager", "eager_ms": 2791.0, "compiled_ms": 2801.0, "compile_s": 81.0}
    DECODE_COMPILE.record(DECODE_COMPILE.store_path(), "k", entry)
    assert lines()[1] == "    k: eager (eager 2791 ms, compiled 2801 ms per 1k tokens, 81 s to compile)"
