"""`dflashkit serve-check`: does a serving engine run the drafter dflashkit measured? (export/serve_check.py)

    dflashkit serve-check runs/quickstart/drafter [--target default] [--engine vllm --engine llamacpp]
                          [--dataset mtbench] [--prompts 8] [--max-new-tokens 64] [--json]
    dflashkit serve-check runs/quickstart/drafter --server http://HOST:PORT [--served-drafter PATH] [--thinking …]

Engines dflashkit starts (--engine, export/serve_check.py) or a running server it did not start (--server,
export/served.py: its speculative counters against dflashkit's, and the diagnosis of a gap).
Exit 0 when every engine agrees with dflashkit exactly (tokens, drafts, accepted per position), 1 on a mismatch
(--server: a cause found), 2 when an engine's environment is missing (`bash scripts/setup_vllm.sh`, `bash
scripts/build_llamacpp.sh`) or the server cannot be checked.
"""

from __future__ import annotations

import argparse
import json

from dflashkit.cli import command, target_args
from dflashkit.commands.evaluate import _thinking, _thinking_arg
from dflashkit.validation import PositiveInt, ServerUrl, Text, TokenCount, flag


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
    p.add_argument(
        "--server",
        type=flag(ServerUrl),
        default=None,
        help="check a running OpenAI-compatible server instead (vLLM, SGLang, llama-server), e.g. http://HOST:8000",
    )
    p.add_argument(
        "--served-drafter",
        type=flag(Text),
        default=None,
        help="--server: the drafter files the server loads (a directory or a .gguf), compared with the trained config",
    )
    p.add_argument(
        "--metrics-path",
        type=flag(Text),
        default="/metrics",
        help="--server: its Prometheus endpoint (default /metrics)",
    )
    _thinking_arg(p)
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
    if args.server is not None:
        return _check_server(args, records)
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


def _check_server(args: argparse.Namespace, records: object) -> int:
    """serve-check --server: a running deployment (export/served.py)."""
    import sys
    from types import SimpleNamespace

    from dflashkit.data.conversations import prompt_messages
    from dflashkit.evaluate.stats import prompts_for
    from dflashkit.export.convert import load_any_drafter
    from dflashkit.export.served import ServedSettings, check_server, served_config
    from dflashkit.target.model import Target

    if args.engine:
        from dflashkit.errors import ConfigError

        raise ConfigError("--server checks a running server; --engine starts one: give one of them")
    served = served_config(args.served_drafter) if args.served_drafter else None
    target = Target.load(args.target, device=args.device, trust_remote_code=args.trust_remote_code)
    drafter = load_any_drafter(args.drafter, target=target, device=target.device).eval()
    kwargs = _thinking(args, target, {args.drafter: drafter})
    prompts, _ = prompts_for(target, records, max_new_tokens=args.max_new_tokens, chat_template_kwargs=kwargs)
    chats = {c.id: prompt_messages(c) for c in (getattr(records, "conversations", None) or [])}
    items = [SimpleNamespace(id=p.id, ids=list(p.ids), messages=chats.get(p.id)) for p in prompts]
    say = None if args.quiet else (lambda m: print(f"[serve-check] {m}", file=sys.stderr, flush=True))
    settings = ServedSettings(
        max_new_tokens=args.max_new_tokens,
        metrics_path=args.metrics_path,
        served_config=served,
        template_kwargs=kwargs or None,
    )
    report = check_server(
        target, drafter, args.server, items, settings=settings, drafter_name=args.drafter, progress=say
    )
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.render())
    return 0 if report.agrees else 1
