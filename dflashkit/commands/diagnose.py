"""`dflashkit inspect | diff | doctor | logs`: diagnostics of drafters, targets and training runs.

    dflashkit inspect CKPT [--json]
    dflashkit diff A B [--target T] [--json]
    dflashkit doctor --target T --drafter D [--prompts N] [--max-new-tokens N] [--features DIR]
                     [--train-config YAML] [--json]
    dflashkit logs RUN [RUN …] [--acc 0.5] [--acc-slot K] [--out DIR] [--json]

`doctor` exits 1 when a check FAILs; `inspect` exits 1 when the checkpoint has a FAIL finding.
"""

from __future__ import annotations

import argparse
import json

from dflashkit.cli import command, device_flag, target_args
from dflashkit.validation import PositiveInt, Text, TokenCount, UnitInterval, flag

TARGET_DTYPES = ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")


def _dump(obj: object) -> str:
    return json.dumps(obj, indent=2, default=str)


def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint", type=flag(Text), help="drafter checkpoint directory (dflashkit, z-lab or speculators format)"
    )
    p.add_argument("--no-values", action="store_true", help="skip the NaN/inf scan of every tensor")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


@command(
    "inspect",
    "what a drafter checkpoint is (read from its tensors) and where it disagrees with its config",
    _inspect_args,
)
def _inspect(args: argparse.Namespace) -> int:
    from dflashkit.diagnose.inspect_checkpoint import inspect_checkpoint, render_report

    report = inspect_checkpoint(args.checkpoint, check_values=not args.no_values)
    print(_dump(report.to_json()) if args.json else render_report(report))
    return 0 if report.ok else 1


def _diff_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", type=flag(Text), help="checkpoint A")
    p.add_argument("b", type=flag(Text), help="checkpoint B")
    p.add_argument(
        "--target",
        type=flag(Text),
        default=None,
        help="the drafters' target (model dir, .gguf or 'default'): lets diff "
        "say whether a drafter copied the target's attention geometry",
    )
    p.add_argument("--device", type=device_flag, default="cpu")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--no-weights", action="store_true", help="architecture only, no weight statistics")
    p.add_argument("--json", action="store_true")


@command("diff", "every architectural difference between two drafters, plus weight statistics", _diff_args)
def _diff(args: argparse.Namespace) -> int:
    from dflashkit.diagnose.diff import diff_checkpoints, render_diff

    target = None
    if args.target:
        from dflashkit.target.model import Target

        target = Target.load(args.target, device=args.device, trust_remote_code=args.trust_remote_code)
    report = diff_checkpoints(args.a, args.b, target=target, weights=not args.no_weights)
    print(_dump(report.to_json()) if args.json else render_diff(report))
    return 0 if report.compared else 1  # 1: a side that is not a drafter (as `inspect` on it)


def _doctor_args(p: argparse.ArgumentParser) -> None:
    target_args(p)
    p.add_argument("--drafter", type=flag(Text), required=True, help="drafter checkpoint directory")
    p.add_argument("--prompts", type=flag(PositiveInt), default=3, help="prompts for the draft-and-verify run")
    p.add_argument("--max-new-tokens", type=flag(TokenCount), default=32)
    p.add_argument(
        "--features", type=flag(Text), default=None, help="a `dflashkit capture` directory the drafter was trained on"
    )
    p.add_argument(
        "--context",
        type=flag(TokenCount),
        default=None,
        metavar="TOKENS",
        help="the context length you will evaluate or serve at, at most the target's positions "
        "(max_position_embeddings): warn when the drafter's sliding window or longest training context is shorter",
    )
    p.add_argument(
        "--dtype", default=None, choices=TARGET_DTYPES, help="target dtype (default: fp32 on CPU, bf16 on CUDA)"
    )
    p.add_argument(
        "--train-config",
        type=flag(Text),
        default=None,
        metavar="YAML",
        help="a training config: will one step fit its device (the estimate train checks before it starts)",
    )
    p.add_argument("--json", action="store_true")


@command(
    "doctor",
    "checks before spending GPU hours: fit, layers, mask, geometry, capture, lossless decoding, label shift",
    _doctor_args,
)
def _doctor(args: argparse.Namespace) -> int:
    from dflashkit.diagnose.doctor import run_doctor
    from dflashkit.target.model import Target

    target = Target.load(args.target, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    _check_context(args.context, target)
    report = run_doctor(
        target,
        args.drafter,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        features=args.features,
        context=args.context,
        train_config=args.train_config,
    )
    if args.json:
        print(
            _dump(
                {
                    "findings": [f.__dict__ for f in report.findings],
                    "tau": report.tau,
                    "offset_accuracy": report.offsets,
                    "exit_code": report.exit_code,
                }
            )
        )
    else:
        print(report.render())
    return report.exit_code


def _check_context(context: int | None, target: object) -> None:
    """--context against the target's positions: a context the target cannot hold is no context to check for."""
    from dflashkit.errors import ConfigError

    positions = getattr(getattr(target, "text_config", None), "max_position_embeddings", None)
    if context is not None and isinstance(positions, int) and context > positions:
        raise ConfigError(
            f"--context {context}: expected at most the target's {positions} positions (its max_position_embeddings)"
        )


def _logs_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "runs", nargs="+", type=flag(Text), help="training run directories (holding metrics.jsonl) or metrics files"
    )
    p.add_argument(
        "--acc", type=flag(UnitInterval), default=0.5, help="accuracy threshold for 'steps to reach' (default 0.5)"
    )
    p.add_argument(
        "--acc-slot",
        type=flag(PositiveInt),
        default=None,
        help="use this block slot's accuracy (e.g. 1) instead of the mean over slots 1…bs−1",
    )
    p.add_argument("--out", type=flag(Text), default=None, help="write PNG plots into this directory")
    p.add_argument("--json", action="store_true")


@command(
    "logs", "training health from metrics.jsonl: grad-norm collapse, bimodal loss, accuracy, τ, schedules", _logs_args
)
def _logs(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dflashkit.diagnose.logs import analyze, compare, plot, read_run, render

    short = [Path(r).name if Path(r).is_dir() else Path(r).parent.name for r in args.runs]
    logs = [
        read_run(r, name=s if short.count(s) == 1 else r.rstrip("/")) for r, s in zip(args.runs, short, strict=True)
    ]
    analyses = [analyze(lg) for lg in logs]
    comparison = compare(logs, acc=args.acc, slot=args.acc_slot)
    written = plot(logs, args.out) if args.out else []
    if args.json:
        for a in analyses:
            a["findings"] = [f.__dict__ for f in a["findings"]]
        print(_dump({"runs": analyses, "comparison": comparison, "plots": [str(p) for p in written]}))
    else:
        print(render(analyses, comparison))
        if written:
            print(f"plots: {', '.join(str(p) for p in written)}")
    return 0
