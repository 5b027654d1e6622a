"""Acceptance per category and per context length: the grouped statistics equal a slow reference computed by
hand, `simulate` and `eval` agree per category on the same prompts, and categories enter from every prompt
format (bundled MT-Bench, a chat JSONL's `category`, a pre-tokenised line's) with one-line errors for bad ones."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from dflashkit.errors import DataError
from dflashkit.evaluate.evaluate import EvalSettings, evaluate
from dflashkit.evaluate.groups import PromptGroups, bucket_order, grouped_stats, length_bucket
from dflashkit.evaluate.simulate import simulate_many
from dflashkit.evaluate.stats import Prompt, acceptance_stats, load_prompts
from dflashkit.evaluate.transcripts import build_transcripts
from dflashkit.target.model import Target
from helpers.oracles import PositionalOracle, drafter_config, make_prompts


def _reference(lengths: list[list[int]], max_length: int, drafted: list[int]) -> dict:
    """τ micro / macro, per-position acceptance and accepted / drafted by plain loops over rounds, exact fractions."""
    rounds = [x for per in lengths for x in per]
    survive = [sum(1 for x in rounds if x >= k + 1) for k in range(max_length)]  # rounds with L ≥ k + 1
    return {
        "tau_micro": Fraction(sum(rounds), len(rounds)),
        "tau_macro": sum(Fraction(sum(per), len(per)) for per in lengths) / len(lengths),
        "per_position_acceptance": [
            Fraction(survive[k], survive[k - 1]) if survive[k - 1] else None for k in range(1, max_length)
        ],
        "accepted_drafts": sum(x - 1 for x in rounds),
        "drafted": sum(drafted),
    }


def test_grouped_statistics_equal_a_reference_by_hand():
    lengths = {"a": [1, 4, 2], "b": [3, 3], "c": [1, 1, 1, 2], "d": [4]}
    drafted = {"a": 9, "b": 5, "c": 12, "d": 2}  # the last round of b and d verified fewer drafts
    groups = {"a": "math", "b": "writing", "c": "math", "d": "writing"}
    got = grouped_stats(lengths, groups, max_length=4, drafted=drafted)
    assert list(got) == ["math", "writing"]  # first appearance
    for g in ("math", "writing"):
        members = [lengths[p] for p in lengths if groups[p] == g]
        ref = _reference(members, 4, [drafted[p] for p in lengths if groups[p] == g])
        st = got[g]
        assert st["n_prompts"] == len(members) and st["rounds"] == sum(map(len, members))
        assert st["tau_micro"] == pytest.approx(float(ref["tau_micro"]), abs=1e-12)
        assert st["tau_macro"] == pytest.approx(float(ref["tau_macro"]), abs=1e-12)
        assert st["accepted_drafts"] == ref["accepted_drafts"] and st["drafted"] == ref["drafted"]
        assert st["acceptance_rate"] == pytest.approx(ref["accepted_drafts"] / ref["drafted"])
        for x, y in zip(st["per_position_acceptance"], ref["per_position_acceptance"], strict=True):
            assert (x is None and y is None) or x == pytest.approx(float(y), abs=1e-12)
    # the groups partition the rounds: their counts add up to the overall statistics
    overall = acceptance_stats(list(lengths.values()), 4, list(drafted.values()))
    assert sum(st["rounds"] for st in got.values()) == overall["rounds"]
    assert sum(st["accepted_drafts"] for st in got.values()) == overall["accepted_drafts"]


def test_drafted_counts_what_the_loop_verified(llama):
    """drafted = the drafts each round put before the target: the chain's bs − 1, fewer in a last round cut by
    max_new_tokens; the tree's nodes (≤ B, fewer when few prefixes exist)."""
    from dflashkit.decode.generate import DecodeSettings, generate
    from dflashkit.drafter.model import DFlashDrafter

    drafter = DFlashDrafter(drafter_config(bs=6)).eval()
    prompt = make_prompts(1)[0].ids
    res = generate(llama, prompt, drafter=drafter, settings=DecodeSettings(max_new_tokens=9, stop_token_ids=()))
    room, want = 8, []  # the prefill gives the first token
    for L in res.acceptance_lengths:
        want.append(min(5, room))
        room -= L
    assert res.drafted == want and res.drafted[-1] < 5 <= res.drafted[0]
    tree = DecodeSettings(method="tree", tree_budget=6, tree_top_k=1, max_new_tokens=9, stop_token_ids=())
    res = generate(llama, prompt, drafter=drafter, settings=tree)
    assert res.drafted[0] == 5  # top-1 per depth: one path of bs − 1 nodes, not the budget's 6


def test_length_buckets():
    edges = (512, 1024, 2048)
    assert [length_bucket(n, edges) for n in (1, 512, 513, 1024, 2000, 2049)] == [
        "≤512",
        "≤512",
        "≤1k",
        "≤1k",
        "≤2k",
        ">2k",
    ]
    assert bucket_order(edges) == ["≤512", "≤1k", "≤2k", ">2k"]
    groups = PromptGroups.of([("a", "x", 3000), ("b", "x", 100)], edges)
    st = grouped_stats({"a": [2], "b": [1]}, groups.length, 3, order=groups.length_order)
    assert list(st) == ["≤512", ">2k"]  # ascending, empty buckets left out


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return Target.load(tiny_llama_dir)


def test_simulate_and_eval_agree_per_category(llama, tmp_path):
    prompts = [
        Prompt(p.id, p.ids, cat) for p, cat in zip(make_prompts(4), ["math", "code", "math", "code"], strict=True)
    ]
    n_new = 24
    cache = build_transcripts(
        llama, prompts, tmp_path / "tr", max_new_tokens=n_new, layer_ids=[1, 4, 6], progress=False
    )
    ref = prompts[0].ids + cache.load(0).ids[len(prompts[0].ids) :]
    drafter = PositionalOracle(drafter_config(), ref, p_correct=0.8, seed=1).eval()
    sim = simulate_many({"d": drafter}, cache, tree_budgets=[4], progress=False, length_buckets=[6, 8])
    doc = evaluate(
        llama,
        {"d": drafter},
        prompts,
        out_dir=tmp_path / "ev",
        settings=EvalSettings(methods="ar,chain,ddtree:4", max_new_tokens=n_new, warmup=False, progress=False,
                              length_buckets=[6, 8]),
    )  # fmt: skip
    for method in ("chain", "ddtree:4"):
        s, e = sim["d"][method], doc["results"]["d"][method]
        assert list(s["by_category"]) == list(e["by_category"]) == ["math", "code"]
        for cat in ("math", "code"):
            for key in ("rounds", "tau_micro", "tau_macro", "accepted_drafts", "drafted", "per_position_acceptance"):
                assert s["by_category"][cat][key] == e["by_category"][cat][key], (method, cat, key)
        assert s["by_length"] == e["by_length"] and list(e["by_length"]) == ["≤6", "≤8", ">8"]
        assert max(s["by_category"]["math"]["per_position_acceptance"][:1]) > 0  # the oracle's prompt accepts
    assert doc["dataset"]["categories"] == {p.id: p.category for p in prompts}
    assert doc["settings"]["length_buckets"] == [6, 8]


def test_categories_from_every_prompt_format(llama, tmp_path):
    pre = tmp_path / "pre.jsonl"
    pre.write_text(
        json.dumps({"id": "a", "prompt_ids": [5, 6, 7], "category": "math"})
        + "\n"
        + json.dumps({"id": "b", "prompt_ids": [5, 6]})
        + "\n"
    )
    prompts, _ = load_prompts(llama, pre)
    assert [p.category for p in prompts] == ["math", "pre"]  # no field: the file's name
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt_ids": [5], "category": 3}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: field 'category': expected a non-empty string"):
        load_prompts(llama, bad)


def test_chat_records_and_mtbench_carry_their_category(tmp_path):
    from dflashkit.data.conversations import read_jsonl_conversations
    from dflashkit.data.datasets import load_mtbench

    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "category": "greeting"})
        + "\n"
        + json.dumps({"prompt": "x", "category": ""})
        + "\n"
    )
    with pytest.raises(DataError, match=r"chat.jsonl:2: field 'category': expected a non-empty string"):
        read_jsonl_conversations(path, categories=True)
    convs, problems = read_jsonl_conversations(path, on_error="skip", categories=True)
    assert convs[0].meta["category"] == "greeting" and len(problems) == 1
    convs, problems = read_jsonl_conversations(path)  # training reads past the field
    assert len(convs) == 2 and not problems and "category" not in convs[0].meta
    cats = {c.meta["category"] for c in load_mtbench()}
    assert cats == {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
