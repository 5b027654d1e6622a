"""`dflashkit plan`: a recipe and a budget for your target and hardware, before a run.

    dflashkit plan --target /models/Qwen3-8B --gpus 8xH100 [--samples N] [--seq-len L] [--kind dflash]
                   [--from-drafter BASE] [--gpu-mem GiB] [--calibrate] [--out DIR] [--json]

Writes DIR/plan.json, DIR/plan.md and DIR/train.yaml and prints the plan's summary and its commands.
"""

from __future__ import annotations

import argparse

from dflashkit.cli import command
from dflashkit.validation import PositiveFloat, PositiveInt, flag


def _plan_args(p: argparse.ArgumentParser) -> None:
    from dflashkit.drafter.heads import HEADS
    from dflashkit.train.step_cost import GPUS

    p.add_argument(
        "--target", default="default", help="model directory or config.json (only the config is read), or 'default'"
    )
    p.add_argument("--gpus", default=None, help=f"N×NAME, e.g. 8xH100 ({', '.join(GPUS)}); default: this CPU")
    p.add_argument("--gpu-mem", type=flag(PositiveFloat), default=None, help="GiB per GPU (another GPU's memory)")
    p.add_argument(
        "--samples", type=flag(PositiveInt), default=None, help="regenerated conversations (default by size)"
    )
    p.add_argument(
        "--seq-len", type=flag(PositiveInt), default=None, help="tokens per packed training row (3072 GPU, 1024 CPU)"
    )
    p.add_argument("--kind", default="dflash", choices=sorted(HEADS), help="drafter kind")
    p.add_argument("--from-drafter", default=None, help="a base model's drafter to warm-start from (fine-tunes)")
    p.add_argument(
        "--avg-tokens", type=flag(PositiveInt), default=None, help="tokens per conversation (assumed 1000; CPU 400)"
    )
    p.add_argument(
        "--max-new-tokens", type=flag(PositiveInt), default=None, help="reply cap for regeneration (2048 GPU, 192 CPU)"
    )
    p.add_argument("--data", default=None, help="prepare's --data (default: sharegpt when it holds enough)")
    p.add_argument("--gen-tokens-per-s", type=flag(PositiveFloat), default=None, help="regeneration rate per GPU")
    p.add_argument("--max-anchors", type=flag(PositiveInt), default=None, help="blocks per document (default 512)")
    p.add_argument("--epochs", type=flag(PositiveInt), default=None)
    p.add_argument("--calibrate", action="store_true", help="measure this CPU's rate with real training steps")
    p.add_argument("--name", default=None, help="the run's name in data/, features/, runs/ paths")
    p.add_argument("--out", default="plan", help="directory for plan.json, plan.md, train.yaml")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--json", action="store_true", help="print plan.json instead of the summary")


@command("plan", "a recipe and a budget for a target and hardware, before a run (nothing loaded)", _plan_args)
def _plan(args: argparse.Namespace) -> int:
    import json

    from dflashkit.diagnose.plan import Hardware, PlanRequest, make_plan
    from dflashkit.diagnose.plan_files import plan_json, summary, write_plan

    request = PlanRequest(
        target=args.target,
        hardware=Hardware.parse(args.gpus, args.gpu_mem),
        samples=args.samples,
        seq_len=args.seq_len,
        kind=args.kind,
        from_drafter=args.from_drafter,
        avg_tokens=args.avg_tokens,
        gen_tokens_per_s=args.gen_tokens_per_s,
        max_new_tokens=args.max_new_tokens,
        data=args.data,
        max_anchors=args.max_anchors,
        epochs=args.epochs,
        calibrate=args.calibrate,
        trust_remote_code=args.trust_remote_code,
        name=args.name,
        out=args.out,
    )
    plan = make_plan(request)
    paths = write_plan(plan, args.out)
    print(json.dumps(plan_json(plan), indent=2, default=str) if args.json else summary(plan, paths))
    return 0
