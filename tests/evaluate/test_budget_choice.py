"""ddtree:auto: the budget choice (τ per budget replayed exactly, round times interleaved, the fastest wins, ties to
the smaller budget) and its use in `evaluate` (lossless, recorded, kept on resume, never re-measured when given)."""

from __future__ import annotations

import json

import pytest
import torch

import dflashkit.evaluate.evaluate as ev
from dflashkit.decode.generate import DecodeSettings, GenerationResult, generate
from dflashkit.errors import DataError
from dflashkit.evaluate.budget_choice import (
    BudgetChoice,
    best_budget,
    candidate_budgets,
    choose_tree_budget,
    replayed_taus,
    round_times,
)
from dflashkit.evaluate.evaluate import EvalSettings, evaluate
from dflashkit.evaluate.simulate import simulate
from dflashkit.evaluate.stats import Method, parse_method, parse_methods
from dflashkit.evaluate.transcripts import build_transcripts, transcript_of
from dflashkit.target.model import Target
from helpers.choices import set_choice
from helpers.oracles import drafter_config, make_prompts, oracle_for


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return Target.load(tiny_llama_dir)


def test_candidates_and_the_rule_with_injected_numbers():
    assert candidate_budgets(3) == [1, 2, 3, 4, 6, 8]  # block 4: 3 drafted slots
    assert candidate_budgets(15) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert candidate_budgets(1) == [1, 2, 3] and candidate_budgets(0) == [1]
    taus = {1: 1.3, 2: 1.4, 3: 1.6, 8: 1.7}
    # cheap rows (a GPU): the widest tree is fastest
    assert best_budget(taus, {1: 0.010, 2: 0.010, 3: 0.010, 8: 0.010}) == 8
    # expensive rows: the τ gain of 8 does not pay for its 9-row verify
    assert best_budget(taus, {1: 0.060, 2: 0.070, 3: 0.072, 8: 0.120}) == 3
    # within the tie margin of the fastest: the smaller budget
    assert best_budget({1: 1.0, 2: 1.01}, {1: 0.1, 2: 0.1}) == 1
    assert best_budget({1: 1.0, 2: 1.05}, {1: 0.1, 2: 0.1}) == 2
    assert best_budget({1: 1.0, 2: 1.05}, {1: 0.1, 2: 0.1}, tie=0.1) == 1
    with pytest.raises(ValueError, match="same budgets"):
        best_budget({1: 1.0}, {2: 0.1})


def test_round_times_interleave_and_take_medians():
    order, walls = [], {1: iter([0.5, 0.9, 0.7]), 4: iter([1.1, 1.3, 1.2])}

    def run(budget, n):
        order.append(budget)
        res = GenerationResult(prompt_len=3, tokens=[0] * n, acceptance_lengths=[2] * 5)
        res.timings["prefill"] = 0.1
        return res, next(walls[budget])

    times = round_times(run, [1, 4], repeats=3, n_tokens=10)
    assert order == [1, 4, 4, 1, 1, 4]  # ABBA…: a drift reaches both alike
    assert times == pytest.approx({1: (0.7 - 0.1) / 5, 4: (1.2 - 0.1) / 5})

    def no_rounds(budget, n):
        return GenerationResult(prompt_len=3, tokens=[0]), 0.1

    with pytest.raises(DataError, match=r"budgets \[1, 4\] made no speculative round"):
        round_times(no_rounds, [1, 4], repeats=1)


def test_replayed_taus_equal_real_tree_decoding(llama):
    prompts = make_prompts(2, seed=3)
    n_new = 20
    drafter = oracle_for(llama, prompts[:1], n_new, p_correct=0.7, seed=1)
    transcripts = [transcript_of(llama, p, [1, 4, 6], max_new_tokens=n_new) for p in prompts]
    taus, rounds = replayed_taus(
        drafter,
        transcripts,
        [1, 2, 5],
        embed_weight=llama.embed_weight,
        lm_head_weight=llama.lm_head_weight,
        max_new_tokens=n_new,
    )
    for b in (1, 2, 5):
        lengths = [
            L
            for p in prompts
            for L in generate(
                llama,
                p.ids,
                drafter=drafter,
                settings=DecodeSettings(method="tree", tree_budget=b, max_new_tokens=n_new),
            ).acceptance_lengths
        ]
        assert rounds[b] == len(lengths) and taus[b] == pytest.approx(sum(lengths) / len(lengths))
    assert taus[5] > taus[1] > 1.0  # the oracle's drafts are accepted; a wider tree recovers more of them


def test_transcript_of_equals_the_cached_transcript(llama, tmp_path):
    p = make_prompts(1, seed=5)[0]
    cache = build_transcripts(llama, [p], tmp_path, max_new_tokens=12, layer_ids=[4, 1], progress=False)
    stored, fresh = cache.load(0), transcript_of(llama, p, [1, 4], max_new_tokens=12)
    assert (stored.ids, stored.prompt_len, stored.stop_reason) == (fresh.ids, fresh.prompt_len, fresh.stop_reason)
    for layer in (1, 4):
        assert torch.equal(stored.layers[layer], fresh.layers[layer])


def test_choose_tree_budget_measures_every_candidate(llama, monkeypatch):
    set_choice(monkeypatch, "products", "stock")
    prompts = make_prompts(3, seed=11)
    drafter = oracle_for(llama, prompts, 24, p_correct=0.8, seed=4)
    choice = choose_tree_budget(llama, drafter, prompts, max_new_tokens=24, budgets=[4, 1, 2], repeats=1)
    assert [r["budget"] for r in choice.rows] == [1, 2, 4]
    assert choice.prompts == [prompts[0].id, prompts[1].id]  # the first two calibration prompts
    rate = {r["budget"]: r["tokens_per_s"] for r in choice.rows}
    assert all(r["round_ms"] > 0 and r["tau"] >= 1.0 for r in choice.rows)
    assert choice.budget == best_budget(
        {r["budget"]: r["tau"] for r in choice.rows}, {r["budget"]: r["round_ms"] for r in choice.rows}
    )
    assert rate[choice.budget] >= 0.98 * max(rate.values())
    assert BudgetChoice.from_dict(json.loads(json.dumps(choice.as_dict()))) == choice
    with pytest.raises(DataError, match="no calibration prompts"):
        choose_tree_budget(llama, drafter, [], max_new_tokens=8)
    first = [
        generate(llama, p.ids, settings=DecodeSettings(method="ar", max_new_tokens=1)).tokens[0] for p in prompts[:2]
    ]
    with pytest.raises(DataError, match=r"calibration prompts \['p0', 'p1'\] with at most one token"):
        choose_tree_budget(llama, drafter, prompts, max_new_tokens=8, stop_token_ids=first)  # both stop at once


def test_evaluate_with_ddtree_auto(llama, tmp_path, monkeypatch):
    set_choice(monkeypatch, "products", "stock")
    prompts = make_prompts(3, seed=7)
    n_new = 16
    drafter = oracle_for(llama, prompts, n_new, p_correct=0.8, seed=2)
    measured = []
    real_choose = ev.choose_tree_budget
    monkeypatch.setattr(ev, "choose_tree_budget", lambda *a, **k: measured.append(a[2]) or real_choose(*a, **k))
    budgets = []
    real_generate = ev.generate
    monkeypatch.setattr(ev, "generate", lambda *a, **k: _record(budgets, k) or real_generate(*a, **k))
    kw = dict(settings=EvalSettings(methods="ar,ddtree:auto", max_new_tokens=n_new, progress=False, stop_token_ids=()))
    doc = evaluate(llama, {"o": drafter}, prompts, out_dir=tmp_path, **kw)
    st = doc["results"]["o"]["ddtree:auto"]
    chosen = st["budget"]
    assert chosen in candidate_budgets(5) and st["budget_choice"]["budget"] == chosen
    assert [r["budget"] for r in st["budget_choice"]["rows"]] == candidate_budgets(5)
    assert st["greedy_equal_fraction"] == 1.0 and st["n_prompts"] == 3
    assert set(budgets) == {chosen}  # every evaluated tree run used the chosen budget
    assert len(measured) == 1 and [p.id for p in measured[0]] == [p.id for p in prompts]
    assert len(st["survival"]) == 1 + min(chosen, 5)  # P(L ≥ 1 … max), max = 1 + min(B, block − 1)
    kept = json.loads((tmp_path / ev.BUDGET_CHOICE).read_text())
    assert kept["drafters"]["o"]["budget"] == chosen

    # a resumed run keeps the choice (nothing measured again) and extends the same results
    progress = (tmp_path / ev.PROGRESS).read_text().splitlines()
    (tmp_path / ev.PROGRESS).write_text("\n".join(progress[:2]) + "\n")
    budgets.clear()
    doc2 = evaluate(llama, {"o": drafter}, prompts, out_dir=tmp_path, **kw)
    assert len(measured) == 1 and set(budgets) == {chosen}
    assert doc2["results"]["o"]["ddtree:auto"]["budget"] == chosen

    # a choice given by the caller is used as it is; calibration prompts can be other prompts
    given = BudgetChoice(2, [{"budget": 2, "tau": 1.5, "round_ms": 10.0, "tokens_per_s": 150.0}], ["x"], 7)
    budgets.clear()
    doc3 = evaluate(llama, {"o": drafter}, prompts[:1], out_dir=tmp_path / "given", budget_choices={"o": given}, **kw)
    assert len(measured) == 1 and set(budgets) == {2}
    assert doc3["results"]["o"]["ddtree:auto"]["budget_choice"] == given.as_dict()
    other = make_prompts(2, seed=99)
    evaluate(llama, {"o": drafter}, prompts[:1], out_dir=tmp_path / "other", budget_prompts=other, **kw)
    assert [p.id for p in measured[-1]] == [p.id for p in other]


def _record(budgets, kw):
    if kw["settings"].method == "tree":
        budgets.append(kw["settings"].tree_budget)


def test_ddtree_auto_is_parsed_and_refused_where_nothing_is_timed(llama, tmp_path):
    m = parse_method("ddtree:auto")
    assert m == Method("ddtree:auto", "tree") and m.is_auto and not parse_method("ddtree:3").is_auto
    assert m.with_budget(3) == Method("ddtree:auto", "tree", 3) and not m.with_budget(3).is_auto
    assert [x.name for x in parse_methods("ar,DDTree-auto,ddtree:auto")] == ["ar", "ddtree:auto"]
    cache = build_transcripts(llama, make_prompts(1), tmp_path, max_new_tokens=4, layer_ids=[1, 4, 6], progress=False)
    torch.manual_seed(0)
    from dflashkit.drafter.model import DFlashDrafter

    with pytest.raises(DataError, match="ddtree:auto is chosen from measured round times"):
        simulate(DFlashDrafter(drafter_config()).eval(), cache, methods=["chain", "ddtree:auto"])


def test_cli_eval_ddtree_auto(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    from dflashkit.cli import main
    from dflashkit.drafter.checkpoint import save_drafter
    from dflashkit.drafter.model import DFlashDrafter

    set_choice(monkeypatch, "products", "stock")
    torch.manual_seed(0)
    a = save_drafter(DFlashDrafter(drafter_config([2, 7], bs=3)), tmp_path / "a")
    data, calib = tmp_path / "prompts.jsonl", tmp_path / "calib.jsonl"
    data.write_text("".join(json.dumps({"id": p.id, "prompt_ids": p.ids}) + "\n" for p in make_prompts(2)))
    calib.write_text(
        "".join(json.dumps({"id": f"c{i}", "prompt_ids": p.ids}) + "\n" for i, p in enumerate(make_prompts(3, 4)))
    )
    common = ["--target", str(tiny_llama_dir), "--drafter", f"a={a}", "--dataset", str(data), "--max-new-tokens", "8"]
    common += ["--ignore-eos", "--quiet", "--out", str(tmp_path / "eval")]
    assert main(["eval", *common, "--methods", "ar,chain", "--budget-prompts", str(calib)]) == 2
    assert "--budget-prompts is for ddtree:auto" in capsys.readouterr().err
    assert main(["eval", *common, "--methods", "ar,ddtree:auto", "--budget-prompts", str(tmp_path / "no")]) == 2
    assert "unknown dataset" in capsys.readouterr().err
    assert main(["eval", *common, "--methods", "ar,ddtree:auto", "--budget-prompts", str(calib)]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "eval" / "results.json").read_text())
    st = doc["results"]["a"]["ddtree:auto"]
    assert st["budget_choice"]["prompts"] == ["c0", "c1"] and st["budget"] in candidate_budgets(2)
    assert f"| a | ddtree:auto (B={st['budget']}) |" in out
    report = (tmp_path / "eval" / "report.md").read_text()
    assert "## DDTree budget chosen (ddtree:auto)" in report and f"| {st['budget']} ← |" in report


def test_a_resumed_run_reruns_the_prompts_of_another_budget(llama, tmp_path, monkeypatch):
    """budget_choice.json damaged between two runs → the budget is measured again; where it comes out different,
    the prompts evaluated with the old one run again (no statistic mixes two budgets); where it is the same, or the
    choice was kept, nothing runs again — records written before runs kept their budget included."""
    set_choice(monkeypatch, "products", "stock")
    prompts = make_prompts(3, seed=7)
    drafter = oracle_for(llama, prompts, 12, p_correct=0.8, seed=2)
    row = {"tau": 1.5, "round_ms": 10.0, "tokens_per_s": 150.0}
    choice = {"budget": 2}
    monkeypatch.setattr(
        ev, "choose_tree_budget", lambda *a, **k: BudgetChoice(choice["budget"], [dict(row, budget=choice["budget"])])
    )
    budgets = []
    real_generate = ev.generate
    monkeypatch.setattr(ev, "generate", lambda *a, **k: _record(budgets, k) or real_generate(*a, **k))
    kw = dict(
        settings=EvalSettings(
            methods="ar,ddtree:auto", max_new_tokens=12, progress=False, stop_token_ids=(), warmup=False
        )
    )
    evaluate(llama, {"o": drafter}, prompts, out_dir=tmp_path, **kw)
    progress = tmp_path / ev.PROGRESS
    assert [json.loads(x)["runs"]["o"]["ddtree:auto"]["budget"] for x in progress.read_text().splitlines()] == [2] * 3

    def damage_and_resume(budget):
        (tmp_path / ev.BUDGET_CHOICE).write_text("{damaged")
        choice["budget"] = budget
        budgets.clear()
        return evaluate(llama, {"o": drafter}, prompts, out_dir=tmp_path, **kw)

    doc = damage_and_resume(2)  # measured again, the same budget: every record resumed, nothing runs
    assert budgets == [] and doc["results"]["o"]["ddtree:auto"]["n_prompts"] == 3
    doc = damage_and_resume(3)  # another budget: all three prompts run again with it
    assert budgets == [3] * 3 and doc["results"]["o"]["ddtree:auto"]["budget"] == 3
    assert doc["results"]["o"]["ddtree:auto"]["n_prompts"] == 3
    latest = {}
    for line in progress.read_text().splitlines():
        rec = json.loads(line)
        latest[rec["id"]] = rec["runs"]["o"]["ddtree:auto"]["budget"]
    assert latest == {p.id: 3 for p in prompts}

    # records without a budget (written before runs kept it): trusted with the kept choice, run again when re-measured
    lines = [json.loads(x) for x in progress.read_text().splitlines()][-3:]
    for rec in lines:
        del rec["runs"]["o"]["ddtree:auto"]["budget"]
    progress.write_text("".join(json.dumps(r) + "\n" for r in lines))
    budgets.clear()
    evaluate(llama, {"o": drafter}, prompts, out_dir=tmp_path, **kw)  # budget_choice.json kept: budget 3
    assert budgets == []
    assert damage_and_resume(3)["results"]["o"]["ddtree:auto"]["n_prompts"] == 3 and budgets == [3] * 3
