"""`dflashkit prepare`: conversations → target-regenerated responses → token ids with a loss mask.

    dflashkit prepare --data sharegpt|long-context-train|PATH --out DIR [--limit N] [--max-new-tokens N]
                      [--temperature T] [--batch-size N] [--max-length N] [--no-regenerate] [--on-error stop|skip]
                      [--turns first|all] [--thinking off|on|keep] [--target …]
                      [--server URL [--server URL …] [--concurrency N]] [--time-budget-minutes M]
                      [--compile auto|on|off]

--time-budget-minutes M: no batch or conversation starts after M minutes of regeneration; those under way finish
and are written, the rest are counted in prepare.json (`regeneration.not_started`), and tokens.jsonl holds what was
regenerated. The same command run again continues where it stopped (a resume), so a long regeneration can run in
runs of M minutes each.

--compile: whether in-process regeneration runs the target's decoder layers through torch.compile — auto (the
default: tried in a long regeneration's first batches, kept only when faster; `regenerate_compile=` in DFLASHKIT_CHOICES
overrides; dflashkit.data.regenerate_compile), on, off.

--server regenerates through OpenAI-compatible servers of the target (vLLM, SGLang, llama-server), requests spread
over them, `--concurrency` conversations in flight; the target's weights are not loaded here (only its tokenizer).

Writes into DIR:
    regenerated.jsonl  the target's responses (dflashkit.data.regenerate; resumable: a rerun continues it)
    tokens.jsonl       {"id", "input_ids", "loss_mask": [0|1, …]} per sample, rewritten atomically
    prepare.json       counts (read, skipped with reasons, truncated, tokens, supervised tokens), the target,
                       chat template kwargs, generation settings and the ShareGPT held-out policy
With --no-regenerate the conversations' own assistant turns are supervised (all of them, multi-turn).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Annotated, Any

from pydantic import Field

from dflashkit.cli import command, compile_arg, target_args
from dflashkit.data.long_context import TRAIN_NAME
from dflashkit.data.thinking import THINKING_MODES
from dflashkit.data.turns import TURN_MODES
from dflashkit.validation import (
    MAX_TOKENS,
    Expect,
    Minutes,
    PositiveInt,
    Probability,
    Seed,
    ServerUrl,
    Temperature,
    Text,
    TokenCount,
    flag,
)

# a training sample needs a prompt token and a supervised one at least
MinLength = Annotated[int, Field(ge=2, le=MAX_TOKENS), Expect("an integer from 2 to 2^24 (16,777,216 tokens)")]
Concurrency = Annotated[int, Field(ge=1, le=65536), Expect("an integer from 1 to 65536")]
DEFAULT_BATCH_SIZE, DEFAULT_CONCURRENCY = 8, 8


def _args(p: argparse.ArgumentParser) -> None:
    target_args(p)
    p.add_argument(
        "--data",
        type=flag(Text),
        required=True,
        help="sharegpt, sharegpt-heldout, mtbench, humaneval, long-context-train (long prompts: --limit per length, "
        "lengths up to --max-length − --max-new-tokens), or a JSONL file",
    )
    p.add_argument("--out", type=flag(Text), required=True, help="output directory")
    p.add_argument("--limit", type=flag(PositiveInt), default=None, help="use only the first N conversations")
    p.add_argument("--max-new-tokens", type=flag(TokenCount), default=256, help="response length cap for regeneration")
    p.add_argument("--temperature", type=flag(Temperature), default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=flag(Probability), default=None, help="with --temperature > 0 (default 1)")
    p.add_argument(
        "--batch-size",
        type=flag(PositiveInt),
        default=None,
        help=f"prompts per generate call in process (default {DEFAULT_BATCH_SIZE}; not with --server)",
    )
    compile_arg(p, "in process")
    p.add_argument("--max-length", type=flag(MinLength), default=3072, help="truncate training samples to N tokens")
    p.add_argument("--no-regenerate", action="store_true", help="train on the data's own assistant turns")
    p.add_argument("--on-error", choices=("stop", "skip"), default="stop", help="malformed JSONL lines")
    p.add_argument(
        "--thinking",
        choices=THINKING_MODES,
        default=None,
        help="reasoning models (enable_thinking templates): off; on (reasoning saved apart, not trained); keep "
        "(reasoning trained); default: the template's own default",
    )
    p.add_argument(
        "--turns",
        choices=TURN_MODES,
        default="first",
        help="regenerate the first assistant turn (default) or every one, the target's earlier replies as context",
    )
    p.add_argument(
        "--server",
        action="append",
        type=flag(ServerUrl),
        default=None,
        metavar="URL",
        help="an OpenAI-compatible server of the target (repeat for several); default: HF generate in process",
    )
    p.add_argument(
        "--concurrency",
        type=flag(Concurrency),
        default=None,
        help=f"conversations in flight over all --server URLs (default {DEFAULT_CONCURRENCY}; with --server)",
    )
    p.add_argument(
        "--server-timeouts",
        type=_timeouts,
        default=None,
        metavar="CONNECT,FIRST_BYTE,TOTAL",
        help="seconds a request to a --server may take to connect, to its first answer byte (the whole completion "
        "is generated first) and in all; past one it is retried on the next server (default: 10,3600,7200)",
    )
    p.add_argument("--seed", type=flag(Seed), default=0, help="sampling seed (temperature > 0)")
    p.add_argument(
        "--time-budget-minutes",
        type=flag(Minutes),
        default=None,
        help="start no regeneration after M minutes (the rest waits for the same command run again)",
    )


def _items(args: argparse.Namespace, records: list[dict[str, Any]], wanted: set[str]) -> list[tuple[str, Any, Any]]:
    """(id, messages, ids) per regenerated conversation, as `write_tokens` takes them: with --thinking on the
    answers go through the chat template (the reasoning is not trained), else the ids the target generated."""
    out = []
    for r in records:
        if r["id"] not in wanted:
            continue
        ids = None if args.thinking == "on" else r.get("turn_token_ids", r.get("response_token_ids"))
        out.append((r["id"], r["messages"], ids))
    return out


def _template_kwargs(args: argparse.Namespace, target: Any) -> dict[str, Any]:
    from dflashkit.data.thinking import template_kwargs
    from dflashkit.errors import DataError

    tok = target.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise DataError(f"target {target.source}: needs a tokenizer with a chat template")
    return template_kwargs(args.thinking, tok, target.source)


def _timeouts(text: str) -> Any:
    """argparse `type=` of --server-timeouts: three positive numbers of seconds."""
    import argparse

    from dflashkit.data.server_client import ServerTimeouts
    from dflashkit.validation import show

    parts = text.split(",")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != 3 or not all(0.001 <= v <= 1e6 for v in values):
        raise argparse.ArgumentTypeError(f"{show(text)}: expected {_timeouts.expect}")  # type: ignore[attr-defined]
    return ServerTimeouts(connect_s=values[0], first_byte_s=values[1], total_s=values[2])


_timeouts.expect = "three positive numbers of seconds (each 0.001 to 1e6), e.g. 10,3600,7200"  # type: ignore[attr-defined]


def _long_context(args: argparse.Namespace, target: Any, kwargs: dict[str, Any]) -> list[Any]:
    """The long-context training prompts: --limit per length, each leaving room for --max-new-tokens within
    --max-length and the target's context."""
    from dflashkit.data.long_context import LongContextSpec, long_context_conversations

    room, why = args.max_length, f"--max-length {args.max_length}"
    context = getattr(getattr(target, "text_config", None), "max_position_embeddings", None)  # --server: unknown
    if context is not None and int(context) < room:
        room, why = int(context), f"the target's {int(context)} positions"
    spec = LongContextSpec(
        per_length=args.limit or 6,
        max_tokens=room - args.max_new_tokens,
        split="train",
        max_tokens_why=f"{why} minus the {args.max_new_tokens} new tokens (--max-new-tokens)",
    )
    return long_context_conversations(target.tokenizer, spec, kwargs)


@command("prepare", "regenerate responses with the target and tokenise them into training samples", _args)
def _prepare(args: argparse.Namespace) -> int:
    from dflashkit.data.datasets import HELDOUT_POLICY, load_dataset
    from dflashkit.data.regenerate import RegenSettings, read_regenerated, regenerate
    from dflashkit.data.tokens_file import write_tokens
    from dflashkit.errors import ConfigError, DataError
    from dflashkit.io_utils import atomic_write_text
    from dflashkit.output_dir import one_writer, output_dir

    _check_pairs(args)
    out = output_dir(args.out, what="--out", create=False)
    if args.no_regenerate and (args.server or args.time_budget_minutes):
        flag_name = "--server" if args.server else "--time-budget-minutes"
        raise ConfigError(f"{flag_name} with --no-regenerate: nothing to regenerate; expected one of the two")
    long = args.data == TRAIN_NAME  # built for the target's tokenizer, once it is loaded
    conversations, problems = ([], []) if long else load_dataset(args.data, args.limit, on_error=args.on_error)
    target, servers = _target_and_servers(args)
    kwargs = _template_kwargs(args, target)
    if long:
        conversations = _long_context(args, target, kwargs)

    with one_writer(out, "dflashkit prepare"):
        skipped: dict[str, str] = {}
        regen_stats = None
        if args.no_regenerate:
            items = [(c.id, c.messages, None) for c in conversations]
        else:
            regen_path = out / "regenerated.jsonl"
            budget_s = 60 * args.time_budget_minutes if args.time_budget_minutes else None
            stats = regenerate(
                target,
                conversations,
                regen_path,
                servers=servers,
                stop_at=None if budget_s is None else time.monotonic() + budget_s,
                settings=RegenSettings(
                    max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature,
                    top_p=1.0 if args.top_p is None else args.top_p,
                    batch_size=args.batch_size or DEFAULT_BATCH_SIZE,
                    chat_template_kwargs=kwargs,
                    seed=args.seed,
                    max_prompt_length=args.max_length,
                    turns=args.turns,
                    thinking=args.thinking,
                    concurrency=args.concurrency or DEFAULT_CONCURRENCY,
                    compile=args.compile,
                ),
            )
            regen_stats = stats.to_dict()
            skipped.update(stats.skipped)
            items = _items(args, read_regenerated(regen_path), {c.id for c in conversations})

        tokens = write_tokens(
            target.tokenizer,
            items,
            out / "tokens.jsonl",
            max_length=args.max_length,
            chat_template_kwargs=kwargs,
            progress=True,
        )
        skipped.update(tokens.skipped)
        report = {
            "data": args.data,
            "conversations_read": len(conversations),
            "malformed": problems,
            "samples_written": tokens.written,
            "skipped": len(skipped),
            "skipped_reasons": skipped,
            "truncated": tokens.truncated,
            "total_tokens": tokens.total_tokens,
            "supervised_tokens": tokens.supervised,
            "max_length": args.max_length,
            "target": target.source,
            "chat_template_kwargs": kwargs,
            "thinking": args.thinking,
            "turns": "all" if args.no_regenerate else args.turns,
            "split_turns": tokens.split_turns,
            "regenerated": not args.no_regenerate,
            "regeneration": regen_stats,
            "complete": not (regen_stats and regen_stats["not_started"]),
            "heldout_policy": HELDOUT_POLICY if str(args.data).startswith("sharegpt") else None,
        }
        atomic_write_text(out / "prepare.json", json.dumps(report, indent=2) + "\n")
        if not tokens.written:
            raise DataError(f"no training samples written to {out / 'tokens.jsonl'} (see {out / 'prepare.json'})")
        print(
            f"prepared {tokens.written} samples from {len(conversations)} conversations ({len(problems)} malformed, "
            f"{len(skipped)} skipped, {tokens.truncated} truncated): {tokens.total_tokens:,} tokens, "
            f"{tokens.supervised:,} supervised"
        )
        if regen_stats:
            _print_regeneration(regen_stats)
        print(f"wrote {out / 'tokens.jsonl'} and {out / 'prepare.json'}")
        if regen_stats and regen_stats["not_started"]:
            print(
                f"time budget of {args.time_budget_minutes:g} min spent: {regen_stats['not_started']} conversations "
                "not regenerated yet; run the same command again to continue (what is written is kept)"
            )
        return 0


def _check_pairs(args: argparse.Namespace) -> None:
    """Refuse an option given without the one it applies with (it would be ignored without a word)."""
    from dflashkit.errors import ConfigError

    if not args.server:
        for name, value in (("--concurrency", args.concurrency), ("--server-timeouts", args.server_timeouts)):
            if value is not None:
                raise ConfigError(f"{name} applies to --server requests; no --server given")
    elif args.batch_size is not None:
        raise ConfigError(
            "--batch-size applies to generation in process; with --server the servers batch (set --concurrency)"
        )
    if args.top_p is not None and args.temperature == 0:
        raise ConfigError(f"--top-p {args.top_p:g} applies when sampling; expected --temperature > 0 with it")


def _target_and_servers(args: argparse.Namespace) -> tuple[Any, Any]:
    """(the target, the server pool or None): with --server only the target's tokenizer is loaded here."""
    from dflashkit.data.server_client import ServerPool, ServerTimeouts
    from dflashkit.target.model import Target, TargetText

    if not args.server:
        return Target.load(args.target, device=args.device, trust_remote_code=args.trust_remote_code), None
    servers = ServerPool(args.server, timeouts=args.server_timeouts or ServerTimeouts())
    return TargetText.load(args.target, trust_remote_code=args.trust_remote_code), servers


def _print_regeneration(r: dict[str, Any]) -> None:
    print(
        f"regenerated {r['generated']} conversations, {r['turns']} replies (+{r['already_done']} reused), "
        f"{r['new_tokens']:,} new tokens at {r['tokens_per_s']:.1f} tok/s"
    )
    for s in r["servers"]:
        print(
            f"  server {s['url']} ({s['protocol']}, {s['model'] or 'model unnamed'}; tokenizer: "
            f"{s['tokenizer_check']}): {s['requests']} requests"
            + (f"; last failure: {s['last_error']}" if s["last_error"] else "")
        )
    if r["retokenized"] or r["retokenize_differs"]:
        print(
            f"  {r['retokenized']} replies came as text only (re-tokenised); {r['retokenize_differs']} of the others "
            f"re-tokenise to other ids than the server generated (the server's ids were kept)"
        )
