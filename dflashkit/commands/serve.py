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
from typing import Annotated

from pydantic import Field

from dflashkit.cli import command, target_args
from dflashkit.commands.evaluate import thinking_arg, thinking_kwargs
from dflashkit.validation import Expect, PositiveInt, ServerUrl, Text, TokenCount, flag, int_list

Clients = Annotated[int, Field(ge=1, le=1024), Expect("an integer from 1 to 1024 (requests in flight)")]


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
    p.add_argument(
        "--concurrency",
        type=int_list(Clients, what="comma-separated numbers of requests in flight, e.g. 1,4,16"),
        default=None,
        help="measure throughput, latency and acceptance at each number of concurrent requests instead (with --server "
        "URL, or --engine llamacpp: servers with and without the drafter started here)",
    )
    p.add_argument(
        "--baseline-server",
        type=flag(ServerUrl),
        default=None,
        help="--server --concurrency: the same target served without the drafter, for the with / without ratio",
    )
    thinking_arg(p)
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
    if args.baseline_server is not None and not (args.server and args.concurrency):
        raise ConfigError("--baseline-server applies to --server with --concurrency")
    records = read_prompts(args.dataset, limit=args.prompts)  # a malformed file is named before the target loads
    if args.concurrency is not None:
        return _load_curve(args, records)
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
    kwargs = thinking_kwargs(args, target, {args.drafter: drafter})
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


def _load_curve(args: argparse.Namespace, records: object) -> int:
    """serve-check --concurrency: throughput, latency and acceptance per level (export/concurrency.py), against
    --server (and --baseline-server), or llama-server started here with and without the drafter."""
    import contextlib
    import tempfile
    from pathlib import Path

    from dflashkit.errors import ConfigError
    from dflashkit.evaluate.stats import prompts_for
    from dflashkit.export.concurrency import LoadSettings, load_curve
    from dflashkit.target.model import Target

    engines = args.engine or []
    if args.server is None and engines != ["llamacpp"]:
        raise ConfigError("--concurrency needs --server URL, or --engine llamacpp to start llama-server here")
    if args.server is not None and engines:
        raise ConfigError("--server checks a running server; --engine starts one: give one of them")
    target = Target.load(args.target, device=args.device, trust_remote_code=args.trust_remote_code)
    prompts, _ = prompts_for(target, records, max_new_tokens=args.max_new_tokens)
    ids = [list(p.ids) for p in prompts]
    settings = LoadSettings(levels=tuple(args.concurrency), max_new_tokens=args.max_new_tokens)
    with contextlib.ExitStack() as stack:
        url, baseline = args.server, args.baseline_server
        if url is None:  # llama-server here: the target with and without the drafter, as many slots as the top level
            from dflashkit.export import llamacpp
            from dflashkit.export.convert import load_any_drafter
            from dflashkit.export.gguf_export import export_gguf
            from dflashkit.export.llama_server import LlamaServer

            target_gguf = Path(args.target_gguf) if args.target_gguf else llamacpp.f32_target_gguf()
            drafter = load_any_drafter(args.drafter, target=target)
            gguf = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dflashkit-load-"))) / "drafter.gguf"
            export_gguf(args.drafter, gguf, target=target_gguf, outtype="f32")
            slots = max(args.concurrency)
            n_max = drafter.config.block_size - drafter.first_draft_slot()
            spec = ["-md", str(gguf), "--spec-type", drafter.head.format.llamacpp_spec_type or "draft-dflash"]
            spec += ["--spec-draft-n-max", str(n_max), "--metrics"]
            url = stack.enter_context(LlamaServer(target_gguf, slots=slots, extra_args=spec)).url
            baseline = stack.enter_context(LlamaServer(target_gguf, slots=slots, extra_args=["--metrics"])).url
        curve = load_curve(url, ids, settings, baseline=baseline)
    print(json.dumps(curve.as_dict(), indent=2) if args.json else curve.render())
    return 0
