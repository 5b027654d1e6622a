"""`dflashkit info` and `dflashkit init-drafter`."""

from __future__ import annotations

import argparse

from dflashkit.cli import command, target_args


def _info_args(p: argparse.ArgumentParser) -> None:
    target_args(p)
    p.add_argument("--drafter", default=None, help="drafter checkpoint directory to describe instead of the default")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


@command("info", "describe the target, its default drafter, parameter counts and cache locations", _info_args)
def _info(args: argparse.Namespace) -> int:
    from dflashkit.info import gather_info, render_info
    import json

    info = gather_info(args.target, drafter=args.drafter, device=args.device, trust_remote_code=args.trust_remote_code)
    print(json.dumps(info, indent=2) if args.json else render_info(info))
    return 0


def _init_args(p: argparse.ArgumentParser) -> None:
    target_args(p)
    p.add_argument("out", help="output checkpoint directory")
    p.add_argument("overrides", nargs="*", help="drafter config overrides, key=value (e.g. num_hidden_layers=3)")
    p.add_argument("--seed", type=int, default=0)


@command("init-drafter", "write a freshly initialised drafter checkpoint for a target", _init_args)
def _init_drafter(args: argparse.Namespace) -> int:
    import torch

    from dflashkit.checkpoint import save_drafter
    from dflashkit.info import default_drafter_config, parse_overrides
    from dflashkit.model import DFlashDrafter
    from dflashkit.target import Target

    target = Target.load(args.target, device=args.device, trust_remote_code=args.trust_remote_code)
    cfg = default_drafter_config(target, **parse_overrides(args.overrides))
    torch.manual_seed(args.seed)
    out = save_drafter(DFlashDrafter(cfg), args.out)
    print(f"wrote {out} ({DFlashDrafter(cfg).num_parameters():,} parameters)")
    return 0
