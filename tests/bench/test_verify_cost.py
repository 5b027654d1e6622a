"""bench/verify_cost.py on a tiny target: every size is timed, the cache is cropped back after each pass, and the
last line is the JSON summary."""

from __future__ import annotations

import json

import pytest

from helpers.bench_scripts import load_bench


def test_verify_cost_reports_every_size(tiny_llama_dir, capsys):
    bench = load_bench("verify_cost")
    assert bench.main(["--target", str(tiny_llama_dir), "--tokens", "1,3,5", "--context", "16", "--repeats", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    doc = json.loads(lines[-1])
    assert doc["tokens"] == [1, 3, 5] and doc["context"] == 16
    from dflashkit.cpu_products.products import CANDIDATES

    for key in ("forward_s", *(f"{name}_s" for name in CANDIDATES), "body_s", "head_s"):
        assert len(doc[key]) == 3 and all(t > 0 for t in doc[key])
    assert doc["ratio"][0] == 1.0 and doc["stock_ratio"][0] == 1.0
    assert doc["floor_s"] > 0 and doc["weight_bytes"] > 0 and doc["machine"]
    assert set(doc["chosen"]) == {"1", "3", "5"}  # the path chosen per width is reported
    assert any(line.split()[:1] == ["5"] for line in lines)  # one table row per size


def test_verify_cost_rejects_bad_sizes():
    with pytest.raises(SystemExit, match="--tokens"):
        load_bench("verify_cost").main(["--tokens", "0,2"])
