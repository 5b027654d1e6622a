"""bench/product_overhead.py: every path is timed on a small shape and the JSON line carries the choice made."""

from __future__ import annotations

import json

import pytest

from helpers.bench_scripts import load_bench
from helpers.choices import set_choice


def test_product_overhead_reports_every_path(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    set_choice(monkeypatch, "products", "stock")  # no measurement in a test: the forced choice is settled
    assert (
        load_bench("product_overhead").main(
            ["--rows", "2", "--in", "16", "--out", "24", "--rounds", "2", "--calls", "5"]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for name in ("f_linear", "linear_product", "routed_linear"):
        assert doc[f"{name}_us_min"] > 0 and doc[f"{name}_us_median"] >= doc[f"{name}_us_min"]
    assert doc["rows"] == 2 and doc["machine"]["cpu"]


def test_product_overhead_rejects_bad_sizes():
    with pytest.raises(SystemExit, match="--rows"):
        load_bench("product_overhead").main(["--rows", "0"])
