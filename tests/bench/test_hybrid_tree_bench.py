"""bench/hybrid_tree.py on a tiny random hybrid: every method × budget is measured, outputs equal AR, and the last
line is the JSON summary (with the 27B-size state estimate per budget)."""

from __future__ import annotations

import json

import pytest

from helpers.bench_scripts import load_bench


def test_hybrid_tree_bench_reports_every_budget(capsys):
    bench = load_bench("hybrid_tree")
    assert (
        bench.main(
            [
                "--hidden",
                "64",
                "--layers",
                "4",
                "--vocab",
                "97",
                "--prompts",
                "1",
                "--prompt-len",
                "8",
                "--max-new-tokens",
                "12",
                "--budgets",
                "2,6",
                "--block-size",
                "6",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    doc = json.loads(lines[-1])
    assert doc["greedy_equal"] is True and doc["budgets"] == [2, 6]
    assert doc["spine"]["verify_ratio"] == 1.0 and doc["spine"]["verify_ms"] > 0
    for mode in ("levels", "scan", "paths"):
        assert len(doc[mode]["verify_ms"]) == 2 and all(t > 0 for t in doc[mode]["verify_ms"])
        assert doc[mode]["tau"] == doc["scan"]["tau"]  # every verifier accepts the same tokens
    assert set(doc["gpu_27b_state_per_round"]) == {"2", "6"}
    assert any(line.startswith("scan:6") for line in lines)


def test_hybrid_tree_bench_rejects_bad_arguments():
    bench = load_bench("hybrid_tree")
    with pytest.raises(SystemExit, match="--budgets"):
        bench.main(["--budgets", "0"])
    with pytest.raises(SystemExit, match="--modes"):
        bench.main(["--modes", "beam"])
