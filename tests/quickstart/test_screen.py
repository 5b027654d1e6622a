"""The quickstart's last screen (`dflashkit.quickstart.screen`): the settings every report states in its header, and
the per-category split in one line per dataset of several categories (the full table stays in the report)."""

from __future__ import annotations

import json
from pathlib import Path

from dflashkit.evaluate.groups import PromptGroups, with_groups
from dflashkit.quickstart.screen import summary_screen
from tests.evaluate.test_report import fake_results


def _eval(tmp_path: Path, name: str, categories: list[str]) -> dict[str, str]:
    doc = fake_results()
    doc["settings"].update(thinking="off")
    groups = PromptGroups.of([("p0", categories[0], 30), ("p1", categories[-1], 40)], [512])
    for methods in doc["results"].values():
        for m, st in methods.items():
            per = {"p0": [1, 3, 6, 2], "p1": [4, 1, 6]} if m == "chain" else {"p0": [5, 5, 2], "p1": [3]}
            methods[m] = with_groups(st, per, groups, 6 if m == "chain" else 5, {"p0": 20, "p1": 15})
            st = methods[m]
            st.update(tok_s=40.0, speedup_vs_ar=1.5, greedy_equal_fraction=1.0)
    path = tmp_path / name / "results.json"
    path.parent.mkdir()
    path.write_text(json.dumps(doc))
    return {"results": str(path), "report": str(path.with_name("report.md"))}


def test_the_screen_states_the_settings_and_the_categories_in_one_line(tmp_path: Path) -> None:
    state = {
        "done": {
            "eval": {
                "mtbench": _eval(tmp_path, "mtbench", ["writing", "math"]),
                "humaneval": _eval(tmp_path, "humaneval", ["humaneval"]),
            },
            "prepare": {"conversations": 4, "supervised_tokens": 1234},
            "train": {"steps": 10, "stopped": "time"},
            "export": {"dir": str(tmp_path / "drafter")},
        },
        "elapsed_minutes_last_run": 1.0,
    }
    screen = summary_screen(state)
    assert "held-out prompts (temperature 0.0, thinking mode off, max_new_tokens 16)" in screen
    lines = [line for line in screen.splitlines() if "by category" in line]
    assert lines == ["  mtbench    chain τ micro by category: writing 3.00 · math 3.67"]  # one category: no line
