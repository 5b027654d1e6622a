"""Evaluation harness: results.json carries every statistic, greedy outputs equal AR, resume skips finished
prompts, divergences are triaged (near-tie vs bug), prompts and methods are validated before any work."""

from __future__ import annotations

import json
from itertools import count, pairwise

import pytest
import torch

import dflashkit.evaluate.evaluate as ev
import dflashkit.evaluate.warm_up as warm_up
from dflashkit.decode.generate import DecodeSettings, generate
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import ConfigError, DataError, TargetError
from dflashkit.evaluate.evaluate import EvalSettings, evaluate
from dflashkit.evaluate.stats import acceptance_stats, load_prompts, parse_methods, prompts_for, read_prompts
from dflashkit.evaluate.triage import first_divergence, logit_margin, triage_divergence
from dflashkit.sampling import SamplingParams
from dflashkit.target.model import Target
from helpers.choices import set_choice
from helpers.oracles import drafter_config, make_prompts, oracle_for

REQUIRED = (
    "tau_micro",
    "tau_macro",
    "histogram",
    "survival",
    "per_position_acceptance",
    "full_block_fraction",
    "zero_accept_fraction",
    "tokens_per_round",
    "timings_s",
    "timings_per_round_s",
    "tok_s",
    "speedup_vs_ar",
    "predicted_speedup",
    "efficiency",
    "greedy_equal_fraction",
    "divergences",
    "n_prompts",
)


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return Target.load(tiny_llama_dir)


def test_evaluate_results_and_resume(llama, tmp_path, monkeypatch):
    prompts = make_prompts(3, seed=7)
    n_new = 16
    torch.manual_seed(0)
    drafters = {
        "oracle": oracle_for(llama, prompts, n_new, p_correct=0.8, seed=2),
        "random": DFlashDrafter(drafter_config()).eval(),
    }
    calls = []
    real_generate = ev.generate
    monkeypatch.setattr(ev, "generate", lambda *a, **k: calls.append(k["settings"].method) or real_generate(*a, **k))
    set_choice(monkeypatch, "products", "stock")  # no products timed: the warm-up is one short run per method
    doc = evaluate(
        llama,
        drafters,
        prompts,
        out_dir=tmp_path,
        dataset="unit",
        settings=EvalSettings(methods="ar,chain,ddtree:4", max_new_tokens=n_new, progress=False, stop_token_ids=()),
    )
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(doc))
    assert set(on_disk) >= {"target", "dataset", "settings", "ar", "results"}
    assert on_disk["ar"]["n_prompts"] == 3 and on_disk["ar"]["tok_s"] > 0
    for name in drafters:
        assert set(on_disk["results"][name]) == {"chain", "ddtree:4"}
        for method, st in on_disk["results"][name].items():
            assert all(k in st for k in REQUIRED), (name, method)
            assert st["greedy_equal_fraction"] == 1.0 and st["divergences"] == [] and st["n_prompts"] == 3
            assert sum(st["histogram"]) == st["rounds"] > 0
            assert st["survival"][0] == 1.0
            assert all(a >= b for a, b in pairwise(st["survival"]))
            assert len(st["survival"]) == (6 if method == "chain" else 5)
            assert st["tok_s"] > 0 and st["speedup_vs_ar"] > 0 and st["predicted_speedup"] > 0
            assert set(st["timings_s"]) == {"prefill", "draft", "tree_build", "verify", "commit"}
    assert on_disk["results"]["oracle"]["chain"]["tau_micro"] > 1.5
    assert on_disk["results"]["random"]["chain"]["tau_micro"] < on_disk["results"]["oracle"]["chain"]["tau_micro"]
    # 1 warm-up AR + 4 warm-up drafter runs, then 3 prompts × (1 AR + 4 drafter runs)
    assert len(calls) == 5 + 3 * 5
    assert len((tmp_path / "progress.jsonl").read_text().splitlines()) == 3

    with open(tmp_path / "progress.jsonl", "a") as f:  # a kill mid-write leaves a torn last line
        f.write('{"key": "abc", "id": "p')
    calls.clear()  # resume: nothing left to do
    again = evaluate(
        llama,
        drafters,
        prompts,
        out_dir=tmp_path,
        settings=EvalSettings(methods="ar,chain,ddtree:4", max_new_tokens=n_new, progress=False, stop_token_ids=()),
    )
    assert (
        calls == []
        and again["results"]["oracle"]["chain"]["tau_micro"] == doc["results"]["oracle"]["chain"]["tau_micro"]
    )
    more = prompts + make_prompts(4, seed=8)[3:]  # one new prompt: only it runs (after warm-up)
    evaluate(
        llama,
        drafters,
        more,
        out_dir=tmp_path,
        settings=EvalSettings(
            methods="ar,chain,ddtree:4", max_new_tokens=n_new, progress=False, stop_token_ids=(), warmup=False
        ),
    )
    assert len(calls) == 5 and len((tmp_path / "progress.jsonl").read_text().splitlines()) == 4  # tail repaired
    with pytest.raises(DataError, match="other settings"):  # resume with other settings is refused
        evaluate(
            llama,
            drafters,
            prompts,
            out_dir=tmp_path,
            settings=EvalSettings(methods="ar,chain", max_new_tokens=n_new, progress=False, stop_token_ids=()),
        )
    fresh = evaluate(
        llama,
        {"random": drafters["random"]},
        prompts[:1],
        out_dir=tmp_path,
        settings=EvalSettings(
            methods="chain", max_new_tokens=4, resume=False, progress=False, stop_token_ids=(), warmup=False
        ),
    )
    assert fresh["ar"]["n_prompts"] == 1 and len((tmp_path / "progress.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("settle_runs", [warm_up.SETTLE_RUNS, 0])
def test_warm_up_settles_the_measured_products(tiny_llama_dir, tmp_path, monkeypatch, settle_runs):
    """On CPU the products of each decoding width are timed in the real steps at first use (target/products.py).
    The warm-up runs every method until no such timing is under way, so the widths every round meets — the AR step
    (1 row) and the chain's verify of a block (6 rows) — are settled before anything is timed, as every later run
    on the machine gets them from the store. Without the settling runs (the warm-up before: 4 tokens a method)
    their trials land in the timed runs."""
    from dflashkit.cpu_products import products

    # every step "takes" one tick of this clock: all candidates tie, so no trial is extended for unclear timings
    # (StepTrial.extend) — on a busy machine real timings could extend trials beyond the warm-up's runs
    ticks = count()
    chooser = products.Chooser(store=None, repeats=2, clock=lambda: float(next(ticks)))
    monkeypatch.setattr(products, "chooser", lambda: chooser)
    set_choice(monkeypatch, "products", "auto")
    monkeypatch.setattr(warm_up, "SETTLE_RUNS", settle_runs)
    target = Target.load(tiny_llama_dir)  # its own routed linears: pass groups of this test's chooser only
    group = target.layers[0].mlp.up_proj._pass_group
    every_round = {group.key(1, torch.float32), group.key(6, torch.float32)}
    prompts = make_prompts(2, seed=3)
    torch.manual_seed(0)
    drafter = oracle_for(target, prompts, 16, p_correct=0.7, seed=1)
    settled_before = []  # per generate call: were the widths of every round settled when it started?
    real_generate = ev.generate
    monkeypatch.setattr(
        ev,
        "generate",
        lambda *a, **k: settled_before.append(every_round <= set(chooser.choices)) or real_generate(*a, **k),
    )
    doc = evaluate(
        target,
        {"d": drafter},
        prompts,
        out_dir=tmp_path,
        settings=EvalSettings(methods="ar,chain,ddtree:4", max_new_tokens=16, progress=False, stop_token_ids=()),
    )
    assert doc["results"]["d"]["chain"]["greedy_equal_fraction"] == 1.0
    timed = settled_before[-2 * 3 :]  # 2 prompts × (AR, chain, DDTree-4), after the warm-up
    if settle_runs:
        assert all(timed), settled_before
        assert all(chooser.choices[k]["timed"] == "steps" for k in every_round)
        assert len(settled_before) > 3 + len(timed)  # the warm-up ran more than one short run per method
    else:
        assert not all(timed), settled_before  # the short warm-up alone leaves trials to the timed runs


def test_triage_near_tie_and_bug(llama):
    prompt = make_prompts(1, seed=3)[0].ids
    ref = generate(llama, prompt, settings=DecodeSettings(method="ar", max_new_tokens=12)).tokens
    assert triage_divergence(llama, prompt, ref, list(ref)) is None
    i = 5
    margin, top2 = logit_margin(llama, prompt + ref[:i])
    assert top2[0] == ref[i] and margin > 0
    swapped = [*ref[:i], top2[1], *ref[i + 1 :]]
    near = triage_divergence(llama, prompt, ref, swapped, threshold=margin * 2)
    assert near["index"] == i and near["verdict"] == "near_tie" and near["spec_token"] == top2[1]
    assert triage_divergence(llama, prompt, ref, swapped, threshold=margin / 2)["verdict"] == "bug"
    junk = next(t for t in range(97) if t not in top2)
    assert triage_divergence(llama, prompt, ref, [*ref[:i], junk], threshold=1e9)["verdict"] == "bug"
    assert first_divergence([1, 2, 3], [1, 2]) == 2 and first_divergence([1, 2], [1, 2]) is None


def test_divergence_is_reported_in_results(llama, tmp_path, monkeypatch):
    """A decoder that corrupts one token: the mismatch lands in results.json with its triage."""
    prompts = make_prompts(2, seed=9)
    real_generate = ev.generate

    def broken(*a, **k):
        res = real_generate(*a, **k)
        if k["settings"].method == "chain" and len(res.tokens) > 3:
            res.tokens[3] = (res.tokens[3] + 1) % 97
        return res

    monkeypatch.setattr(ev, "generate", broken)
    torch.manual_seed(0)
    doc = evaluate(
        llama,
        {"d": DFlashDrafter(drafter_config())},
        prompts,
        out_dir=tmp_path,
        settings=EvalSettings(methods="chain", max_new_tokens=8, progress=False, stop_token_ids=(), warmup=False),
    )
    st = doc["results"]["d"]["chain"]
    assert st["greedy_equal_fraction"] == 0.0 and len(st["divergences"]) == 2
    assert {d["index"] for d in st["divergences"]} == {3} and st["divergence_verdicts"]["bug"] == 2


def test_validation_before_work(llama, tmp_path):
    with pytest.raises(ConfigError, match=r"valid forms are ar, chain, ddtree:B"):
        parse_methods("ar,beam")
    with pytest.raises(ConfigError, match="unknown method 'ddtree:0'"):
        parse_methods(["ddtree:0"])
    assert [m.name for m in parse_methods("ar, chain,ddtree:8,tree-8")] == ["ar", "chain", "ddtree:8"]
    bad = DFlashDrafter(
        DrafterConfig(
            hidden_size=32,
            vocab_size=97,
            num_target_layers=8,
            target_layer_ids=[1],
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            intermediate_size=32,
            block_size=4,
        )
    )
    with pytest.raises(TargetError, match="drafter 'bad': hidden_size 32"):
        evaluate(llama, {"ok": DFlashDrafter(drafter_config()), "bad": bad}, make_prompts(1), out_dir=tmp_path)
    assert not (tmp_path / "progress.jsonl").exists()
    with pytest.raises(ConfigError, match="need at least one drafter"):
        evaluate(llama, {}, make_prompts(1), out_dir=tmp_path, settings=EvalSettings(methods="chain"))


def test_sampled_evaluation_has_no_greedy_check(llama, tmp_path):
    doc = evaluate(
        llama,
        {"d": DFlashDrafter(drafter_config())},
        make_prompts(2),
        out_dir=tmp_path,
        settings=EvalSettings(
            methods="ar,chain",
            max_new_tokens=6,
            sampling=SamplingParams(temperature=1.0),
            progress=False,
            stop_token_ids=(),
            warmup=False,
        ),
    )
    st = doc["results"]["d"]["chain"]
    assert (
        st["greedy_equal_fraction"] is None
        and st["n_prompts"] == 2
        and doc["settings"]["sampling"]["temperature"] == 1.0
    )


def test_load_prompts(llama, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps({"id": "a", "prompt_ids": [3, 4, 5]})
        + "\n\n"
        + json.dumps({"prompt_ids": [6] * 500})
        + "\n"
        + json.dumps({"id": "c", "prompt_ids": [7, 8]})
        + "\n"
    )
    prompts, skipped = load_prompts(llama, path, max_new_tokens=32)
    assert [p.id for p in prompts] == ["a", "c"] and prompts[0].ids == [3, 4, 5]
    assert list(skipped) == ["prompts-3"] and "context window of 512" in skipped["prompts-3"]
    assert [p.id for p in load_prompts(llama, path, limit=1)[0]] == ["a"]
    path.write_text(json.dumps({"prompt_ids": [3, 4]}) + "\n" + json.dumps({"prompt_ids": [3, 400]}) + "\n")
    with pytest.raises(DataError, match=r"prompts.jsonl:2: field 'prompt_ids': expected token ids in \[0, 97\)"):
        load_prompts(llama, path)
    # read without a target; an id outside the vocabulary is found with it, and under "skip" does not count
    # towards the limit
    lines = [json.dumps({"id": i, "prompt_ids": ids}) for i, ids in enumerate([[400], [3], [4]])]
    path.write_text("\n".join([lines[0], "{", *lines[1:], "{", ""]))  # lines 2 and 5: not JSON
    records = read_prompts(path, limit=2, on_error="skip")
    prompts, skipped = prompts_for(llama, records, max_new_tokens=32)
    assert [p.id for p in prompts] == ["1", "2"]
    assert list(skipped) == ["unreadable-record-0", "unreadable-record-1"]  # line 5 lies beyond the limit
    assert "prompts.jsonl:2: invalid JSON" in skipped["unreadable-record-1"]
    assert skipped["unreadable-record-0"].endswith(
        "prompts.jsonl:1: field 'prompt_ids': expected token ids in [0, 97) (the target's vocabulary); found 400"
    )
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": "hello"}) + "\n")
    with pytest.raises(DataError, match="no tokenizer with a chat template; give pre-tokenised"):
        load_prompts(llama, chat)
    with pytest.raises(DataError, match="unknown dataset 'nope'"):
        load_prompts(llama, "nope")


def test_acceptance_stats_by_hand():
    st = acceptance_stats([[1, 3, 4], [2]], max_length=4)
    assert st["histogram"] == [0, 1, 1, 1, 1] and st["rounds"] == 4
    assert st["tau_micro"] == 2.5 and st["tau_macro"] == pytest.approx((8 / 3 + 2) / 2)
    assert st["survival"] == [1.0, 0.75, 0.5, 0.25]
    assert st["per_position_acceptance"] == pytest.approx([0.75, 2 / 3, 0.5])
    assert st["full_block_fraction"] == 0.25 and st["zero_accept_fraction"] == 0.25


# ---------------------------------------------------------------------------------------------- CLI
def test_cli_eval_simulate_report_generate(tiny_llama_dir, tmp_path, capsys):
    from dflashkit.cli import main
    from dflashkit.drafter.checkpoint import save_drafter

    torch.manual_seed(0)
    a = save_drafter(DFlashDrafter(drafter_config()), tmp_path / "a")
    b = save_drafter(DFlashDrafter(drafter_config([2, 7], bs=4)), tmp_path / "b")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": p.id, "prompt_ids": p.ids}) + "\n" for p in make_prompts(2)))
    common = [
        "--target",
        str(tiny_llama_dir),
        "--drafter",
        f"a={a}",
        "--drafter",
        f"b={b}",
        "--dataset",
        str(data),
        "--max-new-tokens",
        "8",
        "--ignore-eos",
        "--quiet",
    ]
    assert main(["eval", *common, "--methods", "ar,chain,ddtree:4", "--out", str(tmp_path / "eval")]) == 0
    out = capsys.readouterr().out
    assert "| a | ddtree:4 |" in out and "| b | chain |" in out and "results.json" in out
    doc = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert doc["drafters"]["a"]["source"] == str(a) and doc["results"]["b"]["chain"]["greedy_equal_fraction"] == 1.0
    assert doc["dataset"]["n_prompts"] == 2 and len(doc["results"]["b"]["chain"]["survival"]) == 4
    for name in ("report.md", "progress.jsonl", "survival.png", "comparison.png"):
        assert (tmp_path / "eval" / name).stat().st_size > 0

    assert (
        main(
            [
                "simulate",
                *common,
                "--cache",
                str(tmp_path / "cache"),
                "--budgets",
                "2,4",
                "--out",
                str(tmp_path / "sim"),
            ]
        )
        == 0
    )
    sim = json.loads((tmp_path / "sim" / "results.json").read_text())
    assert set(sim["results"]["a"]) == {"chain", "ddtree:2", "ddtree:4"} and sim["kind"] == "simulate"
    assert sim["results"]["a"]["chain"]["histogram"] == doc["results"]["a"]["chain"]["histogram"]  # same loop
    capsys.readouterr()

    assert (
        main(["report", str(tmp_path / "eval" / "results.json"), str(tmp_path / "sim"), "--out", str(tmp_path / "cmp")])
        == 0
    )
    assert "| eval |" in capsys.readouterr().out and (tmp_path / "cmp" / "compare.png").exists()
    assert main(["report", str(tmp_path / "eval" / "results.json"), "--out", str(tmp_path / "rep")]) == 0
    assert (tmp_path / "rep" / "report.md").exists()
    capsys.readouterr()

    assert (
        main(
            [
                "generate",
                "--target",
                str(tiny_llama_dir),
                "--drafter",
                str(a),
                "--prompt-ids",
                "3,4,5",
                "--max-new-tokens",
                "6",
                "--method",
                "tree",
                "--tree-budget",
                "3",
                "--ignore-eos",
            ]
        )
        == 0
    )
    assert "τ = " in capsys.readouterr().out


def test_cli_errors(tiny_llama_dir, tmp_path, capsys):
    from dflashkit.cli import main

    base = ["--target", str(tiny_llama_dir), "--drafter", f"a={tmp_path}", "--out", str(tmp_path / "o")]
    assert main(["eval", *base, "--dataset", "mtbenchh"]) == 2
    err = capsys.readouterr().err
    assert (
        "unknown dataset 'mtbenchh'" in err and "mtbench, humaneval" in err and err[-1] == "\n" and err.count("\n") == 1
    )
    assert main(["eval", *base, "--dataset", "mtbench", "--methods", "ar,medusa"]) == 2
    assert "valid forms are ar, chain, ddtree:B" in capsys.readouterr().err
    assert main(["simulate", *base, "--dataset", "nope", "--cache", str(tmp_path / "c")]) == 2
    assert "unknown dataset 'nope'" in capsys.readouterr().err
    assert main(["eval", "--target", str(tiny_llama_dir), "--dataset", "mtbench", "--out", str(tmp_path)]) == 2
    assert "needs at least one --drafter" in capsys.readouterr().err
    assert main(["generate", "--target", str(tiny_llama_dir), "--prompt", "hi"]) == 2
    assert "needs --drafter" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_ar_only_with_hf_baseline(llama, tmp_path):
    from dflashkit.evaluate.report import render

    doc = evaluate(
        llama,
        {},
        make_prompts(1),
        out_dir=tmp_path,
        settings=EvalSettings(
            methods="ar", max_new_tokens=6, progress=False, stop_token_ids=(), hf_baseline=True, warmup=False
        ),
    )
    assert doc["results"] == {} and doc["ar"]["hf_generate"]["equal_to_ar_fraction"] == 1.0
    assert "(baseline) | ar" in render(tmp_path / "results.json")


def test_deadline_time_boxes_and_resumes(llama, tmp_path):
    """A passed deadline: one prompt is still evaluated, the results say 1 of 3; a resume does the other two."""
    import time
    from dataclasses import replace

    prompts = make_prompts(3, seed=5)
    drafters = {"random": DFlashDrafter(drafter_config()).eval()}
    base = EvalSettings(methods="ar,chain", max_new_tokens=6, progress=False, stop_token_ids=(), warmup=False)
    doc = evaluate(llama, drafters, prompts, out_dir=tmp_path, settings=replace(base, deadline=time.monotonic()))
    assert doc["dataset"]["n_prompts"] == 1 and doc["dataset"]["time_boxed"] == {"requested": 3, "evaluated": 1}
    assert doc["results"]["random"]["chain"]["n_prompts"] == 1
    full = evaluate(llama, drafters, prompts, out_dir=tmp_path, settings=base)
    assert full["dataset"]["n_prompts"] == 3 and "time_boxed" not in full["dataset"]


def test_cli_eval_at_two_temperatures_by_category_and_length(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    """`eval --temperatures 0,1`: the same prompts at each temperature (DDTree included: exact at T = 1), one
    directory each and compare.md side by side, with per-category and per-length tables in every report."""
    from dflashkit.cli import main
    from dflashkit.drafter.checkpoint import save_drafter

    torch.manual_seed(0)
    a = save_drafter(DFlashDrafter(drafter_config()), tmp_path / "a")
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": p.id, "prompt_ids": p.ids, "category": c}) + "\n"
            for p, c in zip(make_prompts(3), ["math", "code", "math"], strict=True)
        )
    )
    argv = ["eval", "--target", str(tiny_llama_dir), "--drafter", f"a={a}", "--dataset", str(data)]
    argv += ["--max-new-tokens", "8", "--ignore-eos", "--quiet", "--no-warmup", "--methods", "ar,chain,ddtree:3"]
    assert main([*argv, "--temperatures", "0,1", "--by-length", "6,7", "--out", str(tmp_path / "e")]) == 0
    out = capsys.readouterr().out
    assert "temperature 0:" in out and "temperature 1:" in out and "compare.md" in out
    for t, temperature in (("T0", 0.0), ("T1", 1.0)):
        doc = json.loads((tmp_path / "e" / t / "results.json").read_text())
        assert doc["settings"]["sampling"]["temperature"] == temperature
        tree = doc["results"]["a"]["ddtree:3"]
        assert set(tree["by_category"]) == {"math", "code"} and tree["by_category"]["math"]["n_prompts"] == 2
        assert list(tree["by_length"]) == ["≤6", "≤7", ">7"]
        report = (tmp_path / "e" / t / "report.md").read_text()
        assert "## Per category" in report and f"temperature {temperature}" in report
    assert (
        json.loads((tmp_path / "e" / "T0" / "results.json").read_text())["results"]["a"]["ddtree:3"][
            "greedy_equal_fraction"
        ]
        == 1.0
    )
    text = (tmp_path / "e" / "compare.md").read_text()
    assert "| T=0 | " in text and "| T=1 | " in text and "## τ micro per category" in text
    # ddtree:auto: the budget chosen at the first temperature is the one every temperature runs (measured once)
    import dflashkit.evaluate.evaluate as evaluate_mod

    chooser, calls = evaluate_mod.choose_tree_budget, []
    monkeypatch.setattr(evaluate_mod, "choose_tree_budget", lambda *a, **k: calls.append(1) or chooser(*a, **k))
    auto = [*argv[:-1], "ar,ddtree:auto", "--temperatures", "0,1", "--out", str(tmp_path / "auto")]
    assert main(auto) == 0 and len(calls) == 1
    capsys.readouterr()
    budgets = [
        json.loads((tmp_path / "auto" / t / "results.json").read_text())["results"]["a"]["ddtree:auto"]["budget"]
        for t in ("T0", "T1")
    ]
    assert budgets[0] == budgets[1]
    bad = ["--temperature", "0.5", "--temperatures", "0,1", "--out", str(tmp_path / "x")]
    assert main([*argv, *bad]) == 2
    assert "--temperatures replaces --temperature" in capsys.readouterr().err
    assert main([*argv, "--temperatures", "0,-1", "--out", str(tmp_path / "x")]) == 2
    assert "expected 0 (greedy) or a number from 0.0001 to 100" in capsys.readouterr().err
