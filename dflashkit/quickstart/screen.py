"""The quickstart's last screen: τ and speed per dataset and method, the data and training it got, where things are,
and notes for the stages that got much less than an idle machine gives them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflashkit.evaluate.report import header_settings
from dflashkit.quickstart.rates import shortfall_notes


def summary_screen(state: dict[str, Any]) -> str:
    """The one screen: τ, tokens/s, speedup, greedy equality, τ by category, where things are."""
    docs = [json.loads(Path(w["results"]).read_text()) for w in state["done"]["eval"].values()]
    settings = f" ({header_settings(docs[0])})" if docs else ""
    lines = ["", f"dflashkit quickstart — SmolLM2-135M-Instruct target, held-out prompts{settings}", ""]
    head = f"  {'dataset':<10} {'method':<14} {'τ macro':>8} {'τ micro':>8} {'tok/s':>7} {'speedup':>8} {'greedy=':>8}"
    lines.append(head)
    for dataset, where in state["done"]["eval"].items():
        doc = json.loads(Path(where["results"]).read_text())
        ar = doc["ar"]
        lines.append(f"  {dataset:<10} {'ar':<14} {1.0:>8.2f} {1.0:>8.2f} {ar['tok_s']:>7.1f} {1.0:>7.2f}× {'—':>8}")
        for methods in doc["results"].values():
            for method, r in methods.items():
                lines.append(
                    f"  {dataset:<10} {_label(method, r):<14} {r['tau_macro']:>8.2f} {r['tau_micro']:>8.2f} "
                    f"{r['tok_s']:>7.1f} {r['speedup_vs_ar']:>7.2f}× {r['greedy_equal_fraction']:>7.0%}"
                )
    d = state["done"]
    lines += [line for dataset, where in d["eval"].items() if (line := _category_line(dataset, where))]
    best = []
    for dataset, where in d["eval"].items():
        doc = json.loads(Path(where["results"]).read_text())
        trees = {m: r for methods in doc["results"].values() for m, r in methods.items() if m.startswith("ddtree")}
        if trees:
            m, r = max(trees.items(), key=lambda kv: kv[1]["tok_s"])
            best.append(f"{dataset} {_label(m, r)} (τ {r['tau_macro']:.2f}, {r['speedup_vs_ar']:.2f}×)")
    lines += [
        "",
        f"  best DDTree      {'; '.join(best) or '—'} (by tokens/s)",
        f"  training data   {_data_line(d['prepare'])}",
        f"  training        {d['train']['steps']} steps ({d['train']['stopped']}){_chosen_step(d['train'])}",
        f"  drafter         {d['export']['dir']}  (serving layout: vLLM loads it as it is; check with serve-check)",
        *[f"  report          {w['report']} (+ PNG plots)" for w in d["eval"].values()],
        f"  time            {state.get('elapsed_minutes_last_run')} min (this run)",
        *[f"  note            {n}" for n in shortfall_notes(state)],
        "",
    ]
    return "\n".join(lines)


def _category_line(dataset: str, where: dict[str, Any]) -> str:
    """'  mtbench    chain τ by category: writing 1.21 · math 1.40 · …' for a dataset of several categories (the
    full per-category table is in its report), else ''."""
    doc = json.loads(Path(where["results"]).read_text())
    for methods in doc["results"].values():
        for method, r in methods.items():
            groups = r.get("by_category") or {}
            if len(groups) > 1:
                parts = [f"{g} {x['tau_micro']:.2f}" for g, x in groups.items() if x.get("tau_micro") is not None]
                return f"  {dataset:<10} {_label(method, r)} τ micro by category: {' · '.join(parts)}"
    return ""


def _label(method: str, r: dict[str, Any]) -> str:
    """'ddtree:auto(3)' for ddtree:auto (its chosen budget), else the method's name."""
    return f"{method}({r['budget']})" if "budget" in r else method


def _data_line(prep: dict[str, Any]) -> str:
    """'224 target-regenerated responses (35,150 supervised tokens) + 300 original ShareGPT replies (...)'."""
    line = f"{prep['conversations']} target-regenerated responses ({prep['supervised_tokens']:,} supervised tokens)"
    if prep.get("regen_route") == "llama-server":
        line = line.replace("responses", "responses (llama-server)", 1)
    if prep.get("original_conversations"):
        line += (
            f" + {prep['original_conversations']} original ShareGPT replies "
            f"({prep['original_supervised_tokens']:,}, target labels)"
        )
    return line


def _chosen_step(train: dict[str, Any]) -> str:
    """The screen's '; drafter of step N / the last step (best validation τ X)' when keep_best chose one, else ''."""
    if "best_step" not in train:
        return ""
    where = "the last step" if train["best_step"] == train["steps"] else f"step {train['best_step']}"
    return f"; drafter of {where} (best validation τ {train['best_val_tau']:.2f})"


__all__ = ["summary_screen"]
