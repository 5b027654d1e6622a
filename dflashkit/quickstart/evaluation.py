"""The quickstart's evaluation: the DDTree budget chosen once by measurement (`ddtree:auto`), then MT-Bench and
HumanEval prompts never used in training, each within its share of the evaluation's minutes.

The budget is calibrated on held-out ShareGPT prompts (`sharegpt-heldout`, never trained on and not evaluated), so
the evaluated prompts play no part in choosing it; the same choice serves both datasets and a resumed run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

CALIBRATION_DATASET = "sharegpt-heldout"
DATASETS = ("mtbench", "humaneval")


def stage_budget(target: Any, drafter_dir: Path, s: Any) -> dict[str, Any]:
    """The ddtree:auto choice for the quickstart's drafter (BudgetChoice.as_dict()), {} when no method needs it."""
    from dflashkit.data.conversations import default_stop_token_ids
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.evaluate.budget_choice import CALIBRATION_PROMPTS, choose_tree_budget
    from dflashkit.evaluate.stats import load_prompts, parse_methods

    if not any(m.is_auto for m in parse_methods(s.methods)):
        return {}
    prompts, _ = load_prompts(
        target, CALIBRATION_DATASET, limit=CALIBRATION_PROMPTS, max_new_tokens=s.eval_max_new_tokens
    )
    choice = choose_tree_budget(
        target,
        load_drafter(drafter_dir).eval(),
        prompts,
        max_new_tokens=s.eval_max_new_tokens,
        stop_token_ids=default_stop_token_ids(target),
        progress=True,
    )
    return choice.as_dict()


def stage_eval(
    target: Any, drafter_dir: Path, s: Any, out: Path, end: float, budget: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Evaluate on both held-out datasets until `end` (monotonic time): each dataset gets an equal share of what
    is left when it starts, and at least one prompt. `budget`: the ddtree:auto choice (stage_budget)."""
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.evaluate.budget_choice import BudgetChoice
    from dflashkit.evaluate.evaluate import EvalSettings, evaluate
    from dflashkit.evaluate.report import render
    from dflashkit.evaluate.stats import load_prompts

    drafter = load_drafter(drafter_dir).eval()
    choices = {"quickstart": BudgetChoice.from_dict(budget)} if budget else None
    summary = {}
    for i, dataset in enumerate(DATASETS):
        now = time.monotonic()
        deadline = now + max(0.0, end - now) / (len(DATASETS) - i)
        prompts, skipped = load_prompts(target, dataset, limit=s.eval_prompts, max_new_tokens=s.eval_max_new_tokens)
        ev_dir = out / "eval" / dataset
        results = evaluate(
            target,
            {"quickstart": drafter},
            prompts,
            out_dir=ev_dir,
            dataset=dataset,
            skipped=skipped,
            drafter_sources={"quickstart": str(drafter_dir)},
            budget_choices=choices,
            settings=EvalSettings(methods=s.methods, max_new_tokens=s.eval_max_new_tokens, deadline=deadline),
        )
        render(results, ev_dir)
        summary[dataset] = {
            "results": str(ev_dir / "results.json"),
            "report": str(ev_dir / "report.md"),
            "prompts": results["dataset"]["n_prompts"],
            "requested": len(prompts),
        }
    return summary


__all__ = ["CALIBRATION_DATASET", "stage_budget", "stage_eval"]
