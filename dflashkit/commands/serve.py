"""`dflashkit serve-check`: does a serving engine run the drafter dflashkit measured? (export/serve_check.py)

    dflashkit serve-check runs/quickstart/drafter [--target default] [--engine vllm --engine llamacpp]
                          [--dataset mtbench] [--prompts 8] [--max-new-tokens 64] [--json]

Exit 0 when every engine agrees with dflashkit exactly (tokens, drafts, accepted per position), 1 on a mismatch,
2 when an engine's environment is missing (`bash scripts/setup_vllm.sh`, `bash scripts/build_llamacpp.sh`).
"""

from __future__ import annotations

import argparse
import json

from dflashkit.cli import command, target_args
from dflashkit.validation import PositiveInt, Text, TokenCount, flag


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "drafter",
        type=flag(Text),
        help="drafter directory (the serving layout: `dflashkit convert … --to vllm`; or the speculators layout)",
    )
    target_args(p)
    p.add_argument(
        "--engine",
        action="append",
        choices=("vllm", "llamacpp"),
        default=None,
        help="engine to run, repeatable (default: vllm)",
    )
    p.add_argument(
        "--target-gguf",
        type=flag(Text),
        default=None,
        help="--engine llamacpp: the target as an F32 GGUF (default: the embedded SmolLM2's, made from the shipped "
        "file)",
    )
    p.add_argument(
        "--dataset", type=flag(Text), default="mtbench", help="prompts: a dataset name or JSONL file (default mtbench)"
    )
    p.add_argument("--prompts", type=flag(PositiveInt), default=8, help="number of prompts (default 8)")
    p.add_argument("--max-new-tokens", type=flag(TokenCount), default=64, help="tokens per prompt (default 64)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


@command("serve-check", "run a drafter in vLLM / llama.cpp: does it accept exactly what dflashkit measures?", _args)
def _serve_check(args: argparse.Namespace) -> int:
    from dflashkit.errors import ConfigError
    from dflashkit.evaluate.stats import prompts_for, read_prompts
    from dflashkit.export.serve_check import serve_check
    from dflashkit.target.model import Target

    if args.target_gguf is not None and "llamacpp" not in (args.engine or []):
        raise ConfigError("--target-gguf applies to --engine llamacpp, which is not among the engines to run")
    records = read_prompts(args.dataset, limit=args.prompts)  # a malformed file is named before the target loads
    target = Target.load(args.target, device=args.device, trust_remote_code=args.trust_remote_code)
    prompts, _ = prompts_for(target, records, max_new_tokens=args.max_new_tokens)
    report = serve_check(
        target,
        args.drafter,
        prompts=[list(p.ids) for p in prompts],
        max_new_tokens=args.max_new_tokens,
        engines=args.engine or ["vllm"],
        target_gguf=args.target_gguf,
        progress=not args.quiet,
    )
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.render())
    return 0 if report.agrees else 1
