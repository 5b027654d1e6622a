"""Mask choice at equal training minutes: a learned mask embedding vs a never-used special-token row of SmolLM2.

    .venv/bin/python bench/mask_choice.py --run runs/quickstart --minutes 4 --seeds 0,1 --eval-prompts 6

Reuses a `dflashkit quickstart` run directory (its regenerated data, captured features and initial drafter with the
reduced draft vocabulary). The candidate row is checked first: it must be a special token that occurs nowhere in the
run's token data (SmolLM2: id 16 `<empty_output>`; bundled ShareGPT / MT-Bench / HumanEval text never produces it either
— docs/studies.md, "Mask choice"). Per seed, the two drafters start from the same weights (the learned variant also has
its mask vector), train with the quickstart's recipe for the same wall-clock budget, in alternating order, and are
evaluated by real chain decoding on held-out prompts (MT-Bench turn 1 + HumanEval, greedy, same prompts). Prints a table
(steps, validation loss / estimated τ, decoded macro τ per seed), then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from dflashkit.decode.generate import DecodeSettings


def _row_variant(init: Path, out: Path, mask_id: int) -> Path:
    from dflashkit.drafter.checkpoint import load_drafter, save_drafter
    from dflashkit.drafter.model import DFlashDrafter

    src = load_drafter(init)
    cfg = src.config.replace(
        learned_mask_embedding=False,
        mask_token_id=mask_id,
        extra={**src.config.extra, "mask_reason": f"never-used special token {mask_id}"},
    )
    d = DFlashDrafter(cfg)
    state = {k: v for k, v in src.state_dict().items() if k != "mask_embedding"}
    d.load_state_dict(state, strict=True)
    return save_drafter(d, out)


def _train(run: Path, init: Path, out: Path, minutes: float, seed: int, target: Any) -> dict[str, Any]:
    from dflashkit.train.config import TrainConfig
    from dflashkit.train.loop import train

    if out.exists():
        shutil.rmtree(out)
    cfg = TrainConfig.from_dict(
        {
            "features": str(run / "features"),
            "target": "default",
            "out": str(out),
            "drafter": {},
            "max_tokens": 1024,
            "max_anchors": 128,
            "lr": 1.5e-3,
            "schedule_minutes": max(0.1, minutes - 0.25),
            "warmup_ratio": 0.05,
            "time_budget_minutes": minutes,
            "save_every": 10_000,
            "val_samples": 8,
            "eval_every": 0,
            "seed": seed,
            "init_from": str(init),
            "progress": False,
        },
        source="mask_choice",
    )
    res = train(cfg, target=target)
    return {"steps": res.step, "final": str(res.final_dir), "val": res.val_metrics or {}}


def _tau(target: Any, drafter_dir: str, prompts: list[list[int]], n: int) -> float:
    from dflashkit.decode.generate import generate
    from dflashkit.drafter.checkpoint import load_drafter

    d = load_drafter(drafter_dir)
    taus = [
        generate(target, p, drafter=d, settings=DecodeSettings(method="chain", max_new_tokens=n)).tau for p in prompts
    ]
    return statistics.fmean(taus)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--run", default="runs/quickstart")
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--mask-id", type=int, default=16)
    ap.add_argument("--eval-prompts", type=int, default=6)
    ap.add_argument("--eval-tokens", type=int, default=64)
    ap.add_argument("--out", default=None, help="work directory (default RUN/mask_choice)")
    args = ap.parse_args(argv)

    from dflashkit.data.datasets import load_humaneval, load_mtbench
    from dflashkit.target.model import Target

    torch.set_num_threads(2)
    run = Path(args.run)
    work = Path(args.out or run / "mask_choice")
    work.mkdir(parents=True, exist_ok=True)
    target = Target.load("default")
    tok = target.tokenizer
    special = set(tok.added_tokens_decoder)
    if args.mask_id not in special:
        print(f"token {args.mask_id} is not a special token of the target", file=sys.stderr)
        return 2
    with open(run / "data" / "tokens.jsonl") as f:
        uses = sum(json.loads(line)["input_ids"].count(args.mask_id) for line in f)
    if uses:
        print(f"token {args.mask_id} occurs {uses} times in the run's data: not a never-used row", file=sys.stderr)
        return 2
    init = run / "init_drafter"
    variants = {"learned": init, "row": _row_variant(init, work / "init_row", args.mask_id)}
    half = max(1, args.eval_prompts // 2)
    convs = load_mtbench(turn=1, limit=half) + load_humaneval(limit=args.eval_prompts - half)
    prompts = [
        tok.apply_chat_template(c.messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
        for c in convs
    ]
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in variants}
    for i, seed in enumerate(int(s) for s in args.seeds.split(",")):
        order = list(variants) if i % 2 == 0 else list(variants)[::-1]
        for name in order:
            r = _train(run, variants[name], work / f"{name}-s{seed}", args.minutes, seed, target)
            with torch.no_grad():
                r["tau_decode"] = _tau(target, r["final"], prompts, args.eval_tokens)
            r["seed"] = seed
            results[name].append(r)
            print(
                f"  seed {seed} {name:8s} steps {r['steps']:4d}  val loss {r['val'].get('loss', float('nan')):.3f}"
                f"  val τ est {r['val'].get('tau', float('nan')):.3f}  decoded τ {r['tau_decode']:.3f}",
                flush=True,
            )
    print(f"\n{args.minutes} training minutes per drafter, {len(prompts)} held-out prompts × {args.eval_tokens} tokens")
    summary: dict[str, Any] = {
        "bench": "mask_choice",
        "minutes": args.minutes,
        "mask_id": args.mask_id,
        "mask_token": tok.convert_ids_to_tokens(args.mask_id),
        "n_prompts": len(prompts),
    }
    for name, rs in results.items():
        taus = [r["tau_decode"] for r in rs]
        summary[f"{name}/tau_decode"] = [round(t, 3) for t in taus]
        summary[f"{name}/tau_decode_mean"] = round(statistics.fmean(taus), 3)
        summary[f"{name}/steps"] = [r["steps"] for r in rs]
        summary[f"{name}/val_loss"] = [round(r["val"].get("loss", float("nan")), 4) for r in rs]
        print(f"{name:8s} decoded τ {statistics.fmean(taus):.3f} (per seed {taus}), steps {[r['steps'] for r in rs]}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
