"""bench/speed.py end to end on a tiny target: every method runs, the last line is the JSON summary with the
required keys, and greedy dflashkit outputs equal HF generate's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflashkit.drafter.checkpoint import save_drafter
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.model import DFlashDrafter
from helpers.bench_scripts import load_bench
from helpers.choices import set_choice

REQUIRED = (
    "tau_chain_macro",
    "tau_ddtree_best",
    "ddtree_best_budget",
    "hf_ar_tok_s",
    "chain_tok_s",
    "speedup_chain_vs_hf_ar",
    "speedup_ddtree_vs_hf_ar",
    "speedup_prompt_lookup_vs_hf_ar",
    "efficiency",
    "greedy_equal_fraction",
    "n_prompts",
    "dflashkit_ar_tok_s",
    "ddtree_tok_s",
    "ddtree",
    "threads",
    "round_cost_vs_ar",
    "best_method",
    "speedup_best_vs_hf_ar",
)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    cfg = DrafterConfig(
        hidden_size=64,
        vocab_size=97,
        num_target_layers=8,
        target_layer_ids=[1, 4, 6],
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=32,
        block_size=4,
        mask_token_id=5,
    )
    return save_drafter(DFlashDrafter(cfg), tmp_path_factory.mktemp("drafter"))


def write_prompts(path: Path, n: int) -> Path:
    g = torch.Generator().manual_seed(3)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            ids = torch.randint(3, 97, (6 + 2 * i,), generator=g).tolist()  # no special ids (0 pad, 1 bos, 2 eos)
            f.write(json.dumps({"id": f"p{i}", "prompt_ids": ids}) + "\n")
    return path


def test_speed_bench_tiny(tiny_llama_dir, drafter_dir, tmp_path, capsys):
    bench = load_bench("speed")
    prompts = write_prompts(tmp_path / "prompts.jsonl", 3)
    doc = bench.main(
        [
            "--target",
            str(tiny_llama_dir),
            "--drafter",
            str(drafter_dir),
            "--dataset",
            str(prompts),
            "--prompts",
            "2",
            "--repeats",
            "2",
            "--max-new-tokens",
            "12",
            "--budgets",
            "2,4",
            "--threads",
            "1",
        ]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    last = json.loads(lines[-1])
    assert last == json.loads(json.dumps(doc))
    assert all(k in last for k in REQUIRED), [k for k in REQUIRED if k not in last]
    assert last["n_prompts"] == 2 and last["threads"] == 1 and last["ddtree_best_budget"] in (2, 4)
    assert last["repeats"] == 2
    # one paired ratio per prompt and round, for every method but the baseline itself
    assert set(last["paired_vs_hf_ar"]) == {"dflashkit_ar", "hf_prompt_lookup", "chain", "ddtree:2", "ddtree:4"}
    for p in last["paired_vs_hf_ar"].values():
        assert p["n"] == 4 and 0 < p["min"] <= p["q1"] <= p["median"] <= p["q3"] <= p["max"], p
    assert set(last["ddtree"]) == {"2", "4"}
    # greedy: every dflashkit method reproduces HF generate exactly (and HF AR agrees with dflashkit AR)
    assert last["greedy_equal_fraction"] == 1.0 and last["hf_ar_equals_dflashkit_ar_fraction"] == 1.0
    assert all(t["greedy_equal_fraction"] == 1.0 for t in last["ddtree"].values())
    assert last["divergence_bugs"] == 0
    assert 1.0 <= last["tau_chain_macro"] <= 4.0 and 1.0 <= last["tau_ddtree_best"] <= 5.0
    for k in (
        "hf_ar_tok_s",
        "chain_tok_s",
        "ddtree_tok_s",
        "dflashkit_ar_tok_s",
        "speedup_chain_vs_hf_ar",
        "speedup_prompt_lookup_vs_hf_ar",
        "efficiency",
    ):
        assert last[k] > 0, k
    assert last["round_cost_vs_ar"] > 0 and last["best_method"] in ("chain", "ddtree:2", "ddtree:4")
    assert last["speedup_best_vs_hf_ar"] == max(last["speedup_chain_vs_hf_ar"], last["speedup_ddtree_vs_hf_ar"])
    assert any(line.startswith("chain") for line in lines[:-1])  # the human table precedes the JSON line


def test_missing_drafter_tells_how_to_fix(tmp_path, monkeypatch):
    bench = load_bench("speed")
    monkeypatch.chdir(tmp_path)  # no runs/quickstart/drafter here
    with pytest.raises(SystemExit, match="quickstart"):
        bench.main([])


def test_without_a_drafter_only_the_autoregressive_methods_run(tiny_llama_dir, tmp_path, capsys):
    bench = load_bench("speed")
    prompts = write_prompts(tmp_path / "prompts.jsonl", 2)
    argv = ["--target", str(tiny_llama_dir), "--drafter", "none", "--dataset", str(prompts), "--prompts", "2"]
    doc = bench.main([*argv, "--max-new-tokens", "8", "--threads", "1"])
    out = capsys.readouterr().out
    assert doc["drafter"] == "none" and "tau_chain_macro" not in doc
    assert set(doc["paired_vs_hf_ar"]) == {"dflashkit_ar", "hf_prompt_lookup"}
    assert doc["hf_ar_equals_dflashkit_ar_fraction"] == 1.0 and doc["speedup_dflashkit_ar_vs_hf_ar"] > 0
    assert "chain" not in out and "dflashkit_ar" in out


def test_paired_ratios_against_a_hand_computed_summary():
    bench = load_bench("speed")

    def rec(tokens: int, wall: float) -> dict:
        return {"n_tokens": tokens, "wall_s": wall}

    hf = [rec(10, 1.0), rec(10, 2.0), rec(10, 1.0), rec(10, 1.0), rec(10, 1.0)]
    method = [rec(10, 0.5), rec(10, 2.0), rec(10, 1.25), rec(10, 1.0), rec(20, 1.0)]
    p = bench.paired_ratios(method, hf)  # ratios 2.0, 1.0, 0.8, 1.0, 2.0 → sorted 0.8, 1, 1, 2, 2
    assert p["n"] == 5 and p["min"] == 0.8 and p["max"] == 2.0 and p["median"] == 1.0
    assert p["q1"] == 1.0 and p["q3"] == 2.0 and p["above_1"] == 0.4
    one = bench.paired_ratios([rec(12, 1.0)], [rec(10, 1.0)])
    assert one["median"] == one["q1"] == one["q3"] == 1.2 and one["n"] == 1
    assert bench.paired_ratios([], [])["median"] is None


def test_speed_bench_adds_the_budget_ddtree_auto_chooses(tiny_llama_dir, drafter_dir, tmp_path, capsys, monkeypatch):
    set_choice(monkeypatch, "products", "stock")
    bench = load_bench("speed")
    prompts = write_prompts(tmp_path / "prompts.jsonl", 3)
    argv = ["--target", str(tiny_llama_dir), "--drafter", str(drafter_dir), "--dataset", str(prompts)]
    argv += ["--budget-prompts", str(prompts), "--prompts", "1", "--max-new-tokens", "8", "--threads", "1"]
    doc = bench.main([*argv, "--budgets", "auto,8"])
    out = capsys.readouterr().out
    chosen = doc["ddtree_auto_budget"]
    assert chosen in (1, 2, 3, 4, 6, 8) and doc["ddtree_auto_choice"]["budget"] == chosen
    assert [r["budget"] for r in doc["ddtree_auto_choice"]["rows"]] == [1, 2, 3, 4, 6, 8]  # block 4: 3 slots
    assert set(doc["ddtree"]) == {str(chosen), "8"} and f"ddtree:auto chose budget {chosen}" in out
    with pytest.raises(SystemExit, match="--budgets"):
        bench.main([*argv, "--budgets", "auto,0"])
