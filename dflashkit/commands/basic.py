"""`dflashkit info` and `dflashkit init-drafter`."""

from __future__ import annotations

import argparse

from dflashkit.cli import command, target_args
from dflashkit.validation import NonNegativeInt, Seed, Text, flag, int_list


def _info_args(p: argparse.ArgumentParser) -> None:
    target_args(p)
    p.add_argument(
        "--drafter",
        type=flag(Text),
        default=None,
        help="drafter checkpoint directory to describe instead of the default",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


@command("info", "describe the target, its default drafter, parameter counts and cache locations", _info_args)
def _info(args: argparse.Namespace) -> int:
    import json

    from dflashkit.diagnose.info import gather_info, render_info

    info = gather_info(args.target, drafter=args.drafter, device=args.device, trust_remote_code=args.trust_remote_code)
    print(json.dumps(info, indent=2) if args.json else render_info(info))
    return 0


def _init_args(p: argparse.ArgumentParser) -> None:
    target_args(p)
    p.add_argument("out", type=flag(Text), help="output checkpoint directory")
    p.add_argument("overrides", nargs="*", help="drafter config overrides, key=value (e.g. num_hidden_layers=3)")
    p.add_argument("--seed", type=flag(Seed), default=0)
    p.add_argument(
        "--draft-vocab-from",
        type=flag(Text),
        metavar="TOKENS",
        default=None,
        help="with draft_vocab_size=N: the N most frequent supervised tokens of this tokens.jsonl (from prepare) "
        "form the drafter's draft vocabulary",
    )
    p.add_argument(
        "--warm-start",
        action="store_true",
        help="copy the target's top decoder layers into the drafter (it takes their geometry)",
    )
    p.add_argument(
        "--warm-start-layers",
        type=int_list(NonNegativeInt, what="comma-separated target layer indices"),
        default=None,
        metavar="I,J,…",
        help="target layers to copy, one per drafter layer (default: those after the deepest captured one)",
    )
    p.add_argument(
        "--warm-start-fc",
        default="last",
        choices=("last", "mean", "random"),
        help="fc init with --warm-start: pass the deepest captured layer through, average all, or random",
    )


@command("init-drafter", "write a freshly initialised drafter checkpoint for a target", _init_args)
def _init_drafter(args: argparse.Namespace) -> int:
    import torch

    from dflashkit.drafter.checkpoint import save_drafter
    from dflashkit.drafter.defaults import default_drafter_config, parse_overrides
    from dflashkit.drafter.model import DFlashDrafter
    from dflashkit.drafter.warm_start import describe, warm_start, warm_start_overrides
    from dflashkit.errors import ConfigError
    from dflashkit.target.model import Target

    if not args.warm_start and (args.warm_start_layers or args.warm_start_fc != "last"):
        raise ConfigError("--warm-start-layers / --warm-start-fc only apply with --warm-start")
    overrides = parse_overrides(args.overrides)  # checked before the target is loaded
    if (overrides.get("draft_vocab_size") is None) != (args.draft_vocab_from is None):
        raise ConfigError(
            "a draft vocabulary is built from data: give draft_vocab_size=N together with --draft-vocab-from "
            "TOKENS (a tokens.jsonl from `dflashkit prepare`)"
            if args.draft_vocab_from is None
            else "--draft-vocab-from needs draft_vocab_size=N (how many of the most frequent tokens to keep)"
        )
    target = Target.load(args.target, device=args.device, trust_remote_code=args.trust_remote_code)
    layers = args.warm_start_layers
    if args.warm_start:
        overrides = warm_start_overrides(target, overrides, source_layers=layers)
    cfg = default_drafter_config(target, **overrides)
    torch.manual_seed(args.seed)
    drafter = DFlashDrafter(cfg)
    if cfg.draft_vocab_size is not None:
        from dflashkit.data.draft_vocab import frequent_tokens
        from dflashkit.data.samples import read_tokens

        samples, _ = read_tokens(args.draft_vocab_from)
        ids, coverage = frequent_tokens(samples, vocab_size=target.vocab_size, size=cfg.draft_vocab_size)
        drafter.draft_to_target.copy_(ids)
        print(
            f"draft vocabulary: the {cfg.draft_vocab_size:,} most frequent supervised tokens of "
            f"{args.draft_vocab_from} ({coverage:.1%} of them)"
        )
    if args.warm_start:
        report = warm_start(drafter, target, source_layers=layers, fc=args.warm_start_fc)
        print(f"warm start {describe(report)}")
    out = save_drafter(drafter, args.out)
    print(f"wrote {out} ({drafter.num_parameters():,} parameters)")
    return 0
