"""`dflashkit plan`: a recipe and a budget for your target and hardware, before a run.

    dflashkit plan --target /models/Qwen3-8B --gpus 8xH100 [--samples N] [--seq-len L] [--kind dflash]
                   [--from-drafter BASE] [--gpu-mem GiB] [--calibrate] [--out DIR] [--json]

Writes DIR/plan.json, DIR/plan.md and DIR/train.yaml and prints the plan's summary and its commands.
"""

from __future__ import annotations

import argparse
from typing import Annotated

from pydantic import Field

from dflashkit.cli import command
from dflashkit.validation import Expect, Text, TokenCount, flag

# What a plan's numbers may be: each with a floor that means something and a ceiling its arithmetic holds.
GiB = Annotated[float, Field(ge=1, le=1e5, allow_inf_nan=False), Expect("a number of GiB from 1 to 100000")]
TokensPerSecond = Annotated[
    float, Field(ge=0.01, le=1e9, allow_inf_nan=False), Expect("a number of tokens/s from 0.01 to 1e9")
]
Samples = Annotated[int, Field(ge=1, le=10**9), Expect("an integer from 1 to 10^9")]
Epochs = Annotated[int, Field(ge=1, le=1000), Expect("an integer from 1 to 1000")]
MAX_GPUS = 65536


def _gpus(text: str) -> str:
    """argparse `type=` of --gpus: N×NAME with NAME a GPU the plan knows and N from 1 to MAX_GPUS; empty is refused
    (an unset shell variable would otherwise plan for this CPU without a word)."""
    from dflashkit.diagnose.plan import Hardware
    from dflashkit.errors import ConfigError
    from dflashkit.validation import show

    try:
        hardware = Hardware.parse(text) if text.strip() else None
    except ConfigError:
        hardware = None
    if hardware is None or hardware.count > MAX_GPUS:
        expect = _gpus.expect  # type: ignore[attr-defined]
        raise argparse.ArgumentTypeError(f"{show(text)}: expected {expect}; NAME one of {_gpu_names()}")
    return text


def _gpu_names() -> str:
    from dflashkit.train.step_cost import GPUS

    return ", ".join(GPUS)


_gpus.expect = (  # type: ignore[attr-defined]
    f"N×NAME with N from 1 to {MAX_GPUS}, e.g. 8xH100 (leave --gpus out to plan for this CPU)"
)


def _plan_args(p: argparse.ArgumentParser) -> None:
    from dflashkit.drafter.heads import HEADS

    p.add_argument(
        "--target",
        type=flag(Text),
        default="default",
        help="model directory or config.json (only the config is read), or 'default'",
    )
    p.add_argument("--gpus", type=_gpus, default=None, help=f"NAME one of {_gpu_names()}; default: this CPU")
    p.add_argument("--gpu-mem", type=flag(GiB), default=None, help="GiB per GPU (another GPU's memory)")
    p.add_argument("--samples", type=flag(Samples), default=None, help="regenerated conversations (default by size)")
    p.add_argument(
        "--seq-len", type=flag(TokenCount), default=None, help="tokens per packed training row (3072 GPU, 1024 CPU)"
    )
    p.add_argument("--kind", default="dflash", choices=sorted(HEADS), help="drafter kind")
    p.add_argument(
        "--from-drafter", type=flag(Text), default=None, help="a base model's drafter to warm-start from (fine-tunes)"
    )
    p.add_argument(
        "--avg-tokens", type=flag(TokenCount), default=None, help="tokens per conversation (assumed 1000; CPU 400)"
    )
    p.add_argument(
        "--max-new-tokens", type=flag(TokenCount), default=None, help="reply cap for regeneration (2048 GPU, 192 CPU)"
    )
    p.add_argument(
        "--data", type=flag(Text), default=None, help="prepare's --data (default: sharegpt when it holds enough)"
    )
    p.add_argument("--gen-tokens-per-s", type=flag(TokensPerSecond), default=None, help="regeneration rate per GPU")
    p.add_argument("--max-anchors", type=flag(TokenCount), default=None, help="blocks per document (default 512)")
    p.add_argument("--epochs", type=flag(Epochs), default=None, help="passes over the data (default 6; 2 warm-started)")
    p.add_argument(
        "--calibrate", action="store_true", help="measure this CPU's rate with real training steps (no --gpus)"
    )
    p.add_argument("--name", type=flag(Text), default=None, help="the run's name in data/, features/, runs/ paths")
    p.add_argument("--out", type=flag(Text), default="plan", help="directory for plan.json, plan.md, train.yaml")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--json", action="store_true", help="print plan.json instead of the summary")


@command("plan", "a recipe and a budget for a target and hardware, before a run (nothing loaded)", _plan_args)
def _plan(args: argparse.Namespace) -> int:
    import json

    from dflashkit.diagnose.plan import Hardware, PlanRequest, make_plan
    from dflashkit.diagnose.plan_files import plan_json, summary, write_plan
    from dflashkit.errors import ConfigError

    if args.calibrate and args.gpus:
        raise ConfigError(f"--calibrate measures this CPU; with --gpus {args.gpus} the plan uses the GPU's rate")
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
