"""Reports: markdown + non-empty PNGs from a results.json (evaluation and simulation kinds); side-by-side compare;
unreadable results files are refused with a clear DataError."""

from __future__ import annotations

import json

import pytest

from dflashkit.errors import DataError
from dflashkit.evaluate.report import PLOTS, compare, load_results, render
from dflashkit.evaluate.stats import acceptance_stats


def fake_results(tau_shift: int = 0, kind: str = "evaluate") -> dict:
    def stats(lengths, max_len, speed):
        st = acceptance_stats(lengths, max_len)
        timed = kind == "evaluate"
        return {
            **st,
            "n_prompts": len(lengths),
            "tok_s": 40.0 * speed if timed else None,
            "speedup_vs_ar": speed if timed else None,
            "predicted_speedup": speed * 1.2 if timed else None,
            "efficiency": 1 / 1.2 if timed else None,
            "greedy_equal_fraction": 1.0 if timed else None,
            "timings_s": {"prefill": 0.1, "draft": 0.2, "tree_build": 0.0, "verify": 0.5, "commit": 0.01},
            "timings_per_round_s": {"prefill": 0.01, "draft": 0.02, "tree_build": 0.0, "verify": 0.05, "commit": 0.001},
            "round_s": 0.071,
            "divergences": []
            if speed < 2
            else [
                {
                    "prompt_id": "p1",
                    "index": 4,
                    "ar_token": 7,
                    "spec_token": 9,
                    "margin": 1e-5,
                    "top2": [7, 9],
                    "verdict": "near_tie",
                    "threshold": 1e-3,
                }
            ],
        }

    chain = [[1 + tau_shift, 3, 6, 2], [4, 1, 6]]
    return {
        "schema": "dflashkit.eval/1",
        "kind": kind,
        "target": {
            "source": "tiny",
            "architecture": "LlamaForCausalLM",
            "num_layers": 8,
            "hidden_size": 64,
            "dtype": "float32",
        },
        "dataset": {"name": "unit", "n_prompts": 2, "skipped": {"x": "too long"}},
        "settings": {"max_new_tokens": 16, "sampling": {"temperature": 0.0}, "tree_top_k": 8},
        "drafters": {"a": {"source": "ckpt/a", "block_size": 6, "target_layer_ids": [1, 4], "parameters": 1234}},
        "ar": {
            "n_prompts": 2,
            "tok_s": 40.0,
            "t_step_s": 0.02,
            "timings_s": {"prefill": 0.1, "verify": 0.3},
            "timings_per_round_s": {"draft": 0.0, "verify": 0.02, "commit": 0.001},
        }
        if kind == "evaluate"
        else None,
        "results": {
            "a": {"chain": stats(chain, 6, 1.5), "ddtree:4": stats([[5, 5, 2], [3]], 5, 2.1)},
            "b": {"chain": stats([[1, 1, 2]], 6, 0.8)},
        },
        "notes": ["a note"],
    }


def test_render_writes_markdown_and_plots(tmp_path):
    path = tmp_path / "run" / "results.json"
    path.parent.mkdir()
    path.write_text(json.dumps(fake_results()))
    text = render(path)
    assert (tmp_path / "run" / "report.md").read_text() == text
    for name in PLOTS:
        assert (tmp_path / "run" / name).stat().st_size > 1000, name
        assert (tmp_path / "run" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| a | ddtree:4 |" in text and "| (baseline) | ar |" in text and "near_tie" in text
    assert "![survival](survival.png)" in text and "Stage costs" in text and "a note" in text
    # a simulation document (no timings, no AR) renders too, into another directory
    sim = render(fake_results(kind="simulate"), out_dir=tmp_path / "sim")
    assert "simulation" in sim and "Stage costs" not in sim and (tmp_path / "sim" / "comparison.png").exists()


def test_compare_two_runs(tmp_path):
    paths = []
    for k in range(2):
        p = tmp_path / f"run{k}" / "results.json"
        p.parent.mkdir()
        p.write_text(json.dumps(fake_results(tau_shift=k)))
        paths.append(p)
    text = compare(paths, out_dir=tmp_path / "cmp")
    assert "| run0 | unit | a | chain |" in text and "| run1 | unit | a | chain |" in text
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 1000
    assert (tmp_path / "cmp" / "compare.md").read_text() == text
    assert "run0" in compare([paths[0]])  # no out_dir: text only


def test_bad_results_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_results(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(DataError, match="not valid JSON"):
        load_results(bad)
    bad.write_text(json.dumps({"results": {"a": {"chain": {"tau": 1}}}}))
    with pytest.raises(DataError, match=r"bad.json: results.a.chain.tau_micro: missing \(a required field\)"):
        load_results(bad)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda d: d["results"]["a"]["chain"].update(tau_micro="x"),
            'results.a.chain.tau_micro = "x": expected a number',
        ),
        (lambda d: d["results"]["a"]["chain"].update(histogram=[0, "a"]), 'histogram[1] = "a": expected a number'),
        (lambda d: d["results"]["a"]["chain"].update(histogram=[0, -2]), "histogram[1] = -2: expected a number ≥ 0"),
        (lambda d: d["results"]["a"]["chain"].update(speedup_vs_ar=True), "speedup_vs_ar = true: expected a number"),
        (lambda d: d["results"]["a"].update(chain=3), "results.a.chain = 3: expected an object"),
        (lambda d: d.update(ar=5), "ar = 5: expected an object"),
        (lambda d: d["results"]["a"]["chain"].update(per_position_acceptance=[0.5, "z"]), 'acceptance[1] = "z"'),
        (lambda d: d["results"]["a"]["chain"].update(divergences=[{"index": 1}]), "divergences[0].ar_token: missing"),
    ],
)
def test_a_field_of_the_wrong_type_is_named_with_its_path(tmp_path, change, message):
    """A hand-edited or merged results.json: the first field the report cannot read, by its path in the JSON, before
    any table or plot is drawn (these were tracebacks from the plot and table code)."""
    doc = fake_results()
    change(doc)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(DataError) as e:
        render(path)
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value)
    assert not (tmp_path / "report.md").exists()


def test_fields_the_report_does_not_read_may_hold_anything(tmp_path):
    doc = fake_results()
    doc["results"]["a"]["chain"].update(budget="x", something={"nested": [1, "a"]}, tok_s=None, tau_macro=float("nan"))
    doc["extra"] = "kept"
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    assert "| a | chain (B=x) |" in render(path)


def _with_groups(doc: dict) -> dict:
    """fake_results with per-category and per-length statistics (as evaluate/simulate write them)."""
    from dflashkit.evaluate.groups import PromptGroups, with_groups

    groups = PromptGroups.of([("p0", "math", 300), ("p1", "writing", 1500)], [512, 1024, 2048])
    for methods in doc["results"].values():
        for m, st in methods.items():
            per = {"p0": [1, 3, 6, 2], "p1": [4, 1, 6]} if m == "chain" else {"p0": [5, 5, 2], "p1": [3]}
            drafted = {"p0": 20, "p1": 15} if m == "chain" else {"p0": 12, "p1": 4}
            methods[m] = with_groups(st, per, groups, 6 if m == "chain" else 5, drafted)
    doc["settings"].update(thinking="off", length_buckets=[512, 1024, 2048])
    return doc


def test_report_has_per_category_and_per_length_sections(tmp_path):
    text = render(_with_groups(fake_results()), out_dir=tmp_path)
    for png in ("per_category.png", "tau_by_length.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"({png})" in text
    assert "## Per category" in text and "## Per context length" in text
    assert "| math | 1 |" in text and "| ≤2k | 1 |" in text  # the overview: one row per group
    # details: accepted / drafted and the per-position vector per group (chain, math: L = 1, 3, 6, 2 → 8 of 20)
    assert "| a · chain | math | 1 | 4 | 3.00 | 3.00 | 8 / 20 (0.400) |" in text
    assert "temperature 0.0" in text and "thinking mode off" in text  # the header states both
    plain = render(fake_results(), out_dir=tmp_path / "plain")  # results without groups: no such sections
    assert "## Per category" not in plain and "thinking mode not recorded" in plain  # an older results.json


def test_compare_puts_categories_side_by_side(tmp_path):
    paths = []
    for k, t in enumerate((0.0, 1.0)):
        doc = _with_groups(fake_results(tau_shift=k))
        doc["settings"]["sampling"]["temperature"] = t
        p = tmp_path / f"T{k}" / "results.json"
        p.parent.mkdir()
        p.write_text(json.dumps(doc))
        paths.append(p)
    text = compare(paths, out_dir=tmp_path / "cmp", labels=["T=0", "T=1"])
    assert "- T=0: temperature 0.0" in text and "- T=1: temperature 1.0" in text
    assert "## τ micro per category" in text and "| a · chain | math | 3.00 | 3.00 |" in text
    assert "## τ micro per prompt tokens" in text
    # every run's details per category: τ micro / macro, accepted / drafted, the per-position vector
    assert "### Details per category" in text
    assert "| T=1 · a · chain | math | 1 | 4 | 3.00 | 3.00 | 8 / 20 (0.400) |" in text
    for png in ("compare_per_category.png", "compare_tau_by_length.png", "compare.png"):
        assert (tmp_path / "cmp" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"({png})" in text
