"""The README's Python example and the rest of the public surface, as a type checker reads them (scripts/test.sh runs
mypy over this file and dflashkit/__init__.py; nothing here runs)."""

from __future__ import annotations

from pathlib import Path

from dflashkit import (
    DecodeSettings,
    EvalSettings,
    PlanRequest,
    SamplingParams,
    Target,
    TrainConfig,
    convert,
    encode_prompt,
    evaluate_drafters,
    generate,
    load_drafter,
    load_prompts,
    make_plan,
    train_drafter,
)


def readme_example() -> float:
    target, drafter = Target.load("default"), load_drafter("runs/quickstart/drafter")
    prompt_ids = encode_prompt(target.tokenizer, [{"role": "user", "content": "Explain speculative decoding."}])
    res = generate(target, prompt_ids, drafter=drafter, settings=DecodeSettings(method="chain", max_new_tokens=256))
    tree = generate(target, prompt_ids, drafter=drafter, settings=DecodeSettings(method="tree", tree_budget=8))
    sampled = generate(target, prompt_ids, drafter=drafter, settings=DecodeSettings(sampling=SamplingParams(0.7)))
    tokens: list[int] = list(res.tokens)
    return res.tau + tree.tau + sampled.tau + len(tokens)


def train_evaluate_convert(out: Path) -> None:
    train_drafter(TrainConfig(out=str(out / "run"), tokens="data/tokens.jsonl", online=True, max_steps=10))
    target = Target.load("default")
    drafter = load_drafter(out / "run" / "final")
    prompts, _ = load_prompts(target, "mtbench", limit=4)
    evaluate_drafters(target, {"dflash": drafter}, prompts, out_dir=out / "eval", settings=EvalSettings())
    convert(out / "run" / "final", out / "speculators", to="speculators")


def plan_a_run() -> str:
    return make_plan(PlanRequest(target="default")).name
