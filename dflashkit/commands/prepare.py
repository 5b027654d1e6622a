"""`dflashkit prepare`: conversations → target-regenerated responses → token ids with a loss mask.

    dflashkit prepare --data sharegpt|PATH --out DIR [--limit N] [--max-new-tokens N] [--temperature T]
                      [--batch-size N] [--max-length N] [--no-regenerate] [--on-error stop|skip]
                      [--thinking on|off] [--target …]

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
from typing import Annotated, Any

from pydantic import Field

from dflashkit.cli import command, target_args
from dflashkit.validation import Expect, NonNegativeFloat, PositiveInt, Probability, Seed, flag

# a training sample needs a prompt token and a supervised one at least
MinLength = Annotated[int, Field(ge=2), Expect("an integer ≥ 2")]


def _args(p: argparse.ArgumentParser) -> None:
    target_args(p)
    p.add_argument("--data", required=True, help="sharegpt, sharegpt-heldout, mtbench, humaneval, or a JSONL file")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--limit", type=flag(PositiveInt), default=None, help="use only the first N conversations")
    p.add_argument("--max-new-tokens", type=flag(PositiveInt), default=256, help="response length cap for regeneration")
    p.add_argument("--temperature", type=flag(NonNegativeFloat), default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=flag(Probability), default=1.0)
    p.add_argument("--batch-size", type=flag(PositiveInt), default=8, help="prompts per generate call")
    p.add_argument("--max-length", type=flag(MinLength), default=3072, help="truncate training samples to N tokens")
    p.add_argument("--no-regenerate", action="store_true", help="train on the data's own assistant turns")
    p.add_argument("--on-error", choices=("stop", "skip"), default="stop", help="malformed JSONL lines")
    p.add_argument(
        "--thinking",
        choices=("on", "off"),
        default=None,
        help="chat template enable_thinking switch (Qwen3-style templates); default: the template's",
    )
    p.add_argument("--seed", type=flag(Seed), default=0, help="sampling seed (temperature > 0)")


@command("prepare", "regenerate responses with the target and tokenise them into training samples", _args)
def _prepare(args: argparse.Namespace) -> int:
    from dflashkit.data.conversations import write_tokens
    from dflashkit.data.datasets import HELDOUT_POLICY, load_dataset
    from dflashkit.data.regenerate import read_regenerated, regenerate
    from dflashkit.errors import ConfigError, DataError
    from dflashkit.io_utils import atomic_write_text
    from dflashkit.output_dir import one_writer, output_dir
    from dflashkit.target.model import Target

    out = output_dir(args.out, what="--out", create=False)
    conversations, problems = load_dataset(args.data, args.limit, on_error=args.on_error)
    target = Target.load(args.target, device=args.device, trust_remote_code=args.trust_remote_code)
    tok = target.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise DataError(f"target {target.source}: needs a tokenizer with a chat template")
    kwargs: dict[str, Any] = {}
    if args.thinking is not None:
        if not target.chat_template_info()["thinking_switch"]:
            raise ConfigError(
                f"--thinking {args.thinking}: the chat template of {target.source} has no enable_thinking switch; "
                f"expected no --thinking for this target"
            )
        kwargs["enable_thinking"] = args.thinking == "on"

    with one_writer(out, "dflashkit prepare"):
        skipped: dict[str, str] = {}
        regen_stats = None
        if args.no_regenerate:
            items = [(c.id, c.messages, None) for c in conversations]
        else:
            regen_path = out / "regenerated.jsonl"
            stats = regenerate(
                target,
                conversations,
                regen_path,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                batch_size=args.batch_size,
                chat_template_kwargs=kwargs,
                seed=args.seed,
                max_prompt_length=args.max_length,
            )
            regen_stats = stats.to_dict()
            skipped.update(stats.skipped)
            wanted = {c.id for c in conversations}
            items = [
                (r["id"], r["messages"], r.get("response_token_ids"))
                for r in read_regenerated(regen_path)
                if r["id"] in wanted
            ]

        tokens = write_tokens(
            tok, items, out / "tokens.jsonl", max_length=args.max_length, chat_template_kwargs=kwargs, progress=True
        )
        skipped.update(tokens.skipped)
        written, truncated = tokens.written, tokens.truncated
        total_tokens, supervised = tokens.total_tokens, tokens.supervised

        report = {
            "data": args.data,
            "conversations_read": len(conversations),
            "malformed": problems,
            "samples_written": written,
            "skipped": len(skipped),
            "skipped_reasons": skipped,
            "truncated": truncated,
            "total_tokens": total_tokens,
            "supervised_tokens": supervised,
            "max_length": args.max_length,
            "target": target.source,
            "chat_template_kwargs": kwargs,
            "regenerated": not args.no_regenerate,
            "regeneration": regen_stats,
            "heldout_policy": HELDOUT_POLICY if str(args.data).startswith("sharegpt") else None,
        }
        atomic_write_text(out / "prepare.json", json.dumps(report, indent=2) + "\n")
        if not written:
            raise DataError(f"no training samples written to {out / 'tokens.jsonl'} (see {out / 'prepare.json'})")
        print(
            f"prepared {written} samples from {len(conversations)} conversations ({len(problems)} malformed, "
            f"{len(skipped)} skipped, {truncated} truncated): {total_tokens:,} tokens, {supervised:,} supervised"
        )
        if regen_stats:
            print(
                f"regenerated {regen_stats['generated']} (+{regen_stats['already_done']} reused), "
                f"{regen_stats['new_tokens']:,} new tokens at {regen_stats['tokens_per_s']:.1f} tok/s"
            )
        print(f"wrote {out / 'tokens.jsonl'} and {out / 'prepare.json'}")
        return 0
