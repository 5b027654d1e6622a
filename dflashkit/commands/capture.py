"""`dflashkit capture`: run the target over tokens.jsonl and store its layer features in sharded files.

    dflashkit capture --tokens data/tokens.jsonl --out data/features [--layer-ids 1,8,14,20,27 |
        --drafter-config CKPT_OR_CONFIG_JSON] [--dtype bf16|fp16|fp32] [--shard-tokens N] [--limit N] [--topk K]
        [--target-lse auto|on|off] [--precision auto|fp32|bf16] [--compile auto|on|off]

--topk K also stores the target's top-K log-probs per position (K·6 bytes per token) for `loss: topk`.
--target-lse stores the log-sum-exp of the target's logits per position (4 bytes per token; one more LM-head pass):
a DSpark drafter with a reduced draft vocabulary then trains without a full-vocabulary product (auto: on for such
a --drafter-config).
--precision: what the target computes in — fp32 (a float32 target as loaded, the reference), bf16 (autocast), or
auto (the default: both timed on this machine at the samples' length, bf16 only when clearly faster; kept in the user
cache, `capture_precision=` in DFLASHKIT_CHOICES overrides; dflashkit.features.capture_precision). A rerun keeps
its capture's.
--compile: whether the target's decoder layers run through torch.compile — auto (the default: tried in a large
capture's first batches, kept only when faster; `capture_compile=` in DFLASHKIT_CHOICES overrides; dflashkit.features.
capture_compile), on, off.

Rerunning the same command after a kill resumes: finished shards that still match manifest.json (size,
sha256) are kept, the rest (and any damaged one) are captured.

On many GPUs: `torchrun --nproc_per_node N -m dflashkit capture …` (same flags) splits the shards over the ranks, each
on its own device (cuda:LOCAL_RANK), one manifest for all (dflashkit.features.rank_shards); the files are the same as
a one-process capture's, and a killed run resumes with any number of ranks.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from pathlib import Path

from dflashkit.cli import command, compile_arg, target_args
from dflashkit.output_dir import output_dir
from dflashkit.validation import NonNegativeInt, NonNegativeTokenCount, PositiveInt, Text, flag, int_list


def _args(p: argparse.ArgumentParser) -> None:
    target_args(p)
    p.add_argument("--tokens", type=flag(Text), required=True, help="tokens.jsonl written by `dflashkit prepare`")
    p.add_argument(
        "--out", type=flag(Text), required=True, help="output directory (manifest.json + shard-*.safetensors)"
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--layer-ids",
        type=int_list(what="comma-separated 0-based layer ids"),
        default=None,
        help="comma-separated 0-based target layer ids, e.g. 1,8,14",
    )
    which.add_argument(
        "--drafter-config",
        type=flag(Text),
        default=None,
        help="drafter checkpoint directory or config.json whose target_layer_ids to capture",
    )
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="storage dtype (default bf16)")
    p.add_argument(
        "--shard-tokens", type=flag(PositiveInt), default=None, help="tokens per shard (default ≈ 1 GiB of features)"
    )
    p.add_argument(
        "--batch-tokens",
        type=flag(NonNegativeTokenCount),
        default=0,
        help="let equal-length samples share a forward of up to N tokens (0 = one per forward)",
    )
    p.add_argument("--limit", type=flag(PositiveInt), default=None, help="capture only the first N samples")
    p.add_argument("--no-target-tokens", action="store_true", help="do not store the target's argmax tokens")
    p.add_argument(
        "--topk",
        type=flag(NonNegativeInt),
        default=0,
        metavar="K",
        help="also store the target's top-K log-probs per position (int32 id + float16 log-prob, "
        "6·K bytes per token) for `loss: topk` training (default 0: off)",
    )
    p.add_argument(
        "--target-lse",
        choices=("auto", "on", "off"),
        default="auto",
        help="also store the log-sum-exp of the target's logits per position (4 B per token) for DSpark training "
        "with a draft vocabulary (auto: on when --drafter-config is such a drafter)",
    )
    p.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help="what the target computes in: fp32, bf16 autocast, or auto (timed on this machine; default)",
    )
    compile_arg(p, "for its forwards")
    p.add_argument(
        "--verify",
        choices=("full", "size"),
        default="full",
        help="how a rerun checks finished shards against manifest.json before keeping them: full "
        "(size + sha256, the default) or size (skips reading a very large capture); damaged "
        "shards are captured again",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _layer_ids(args: argparse.Namespace, target: object, data: dict) -> tuple[list[int], bool]:
    """The layers to capture and whether to store the target's log-sum-exp (`--target-lse`)."""
    lse = args.target_lse == "on"
    if args.layer_ids:
        return list(args.layer_ids), lse
    if args.drafter_config:
        from dflashkit.data.thinking import check_same_thinking
        from dflashkit.drafter.capture_needs import capture_layer_ids, capture_target_lse
        from dflashkit.drafter.config import DrafterConfig
        from dflashkit.target.model import check_drafter_fits

        path = Path(args.drafter_config)
        cfg = DrafterConfig.load(path / "config.json" if path.is_dir() else path)
        check_drafter_fits(cfg, target, source=str(path))
        trained = cfg.extra.get("data") or {}
        if "thinking" in trained or "thinking" in data:  # a drafter of one thinking mode, tokens of another
            check_same_thinking(
                trained.get("thinking"), data.get("thinking"), where=f"capture of {args.tokens} for {path}",
                flag="prepare --thinking",
            )  # fmt: skip
        return capture_layer_ids(cfg), lse or (args.target_lse == "auto" and capture_target_lse(cfg, target))
    from dflashkit.drafter.defaults import default_drafter_config

    return list(default_drafter_config(target).target_layer_ids), lse


@command("capture", "capture the target's hidden-state features of tokens.jsonl into sharded files (resumable)", _args)
def _capture(args: argparse.Namespace) -> int:
    from dflashkit.data.samples import read_tokens
    from dflashkit.data.thinking import data_info
    from dflashkit.features.capture import CaptureSettings, capture
    from dflashkit.features.manifest import format_bytes
    from dflashkit.target.distributed import DistContext
    from dflashkit.target.model import Target

    output_dir(args.out, what="--out", create=False)
    samples, _ = read_tokens(args.tokens)
    if args.limit is not None:
        samples = samples[: args.limit]
    device = str(args.device)
    dist = DistContext.from_env(use_cuda=device.startswith("cuda"), timeout=timedelta(hours=24))
    if dist.distributed and device.startswith("cuda"):
        device = f"cuda:{dist.local_rank}"  # one GPU per rank
    target = Target.load(args.target, device=device, trust_remote_code=args.trust_remote_code)
    data = data_info(args.tokens)
    layer_ids, store_lse = _layer_ids(args, target, data)
    m = capture(
        target,
        samples,
        args.out,
        tokens_file=args.tokens,
        progress=not args.quiet,
        data=data,
        dist=dist,
        settings=CaptureSettings(
            layer_ids=layer_ids,
            dtype=args.dtype,
            store_target_tokens=not args.no_target_tokens,
            store_topk=args.topk,
            store_target_lse=store_lse,
            shard_max_tokens=args.shard_tokens,
            batch_tokens=args.batch_tokens,
            verify=args.verify,
            precision=args.precision,
            compile=args.compile,
        ),
    )
    dist.close()
    if not dist.is_main:
        return 0
    run = m.run_stats
    rate = f"{run['tokens'] / run['seconds']:,.0f} tok/s" if run.get("seconds") else "nothing to do"
    topk = f", top-{m.store_topk} log-probs" if m.store_topk else ""
    topk += ", target log-sum-exp" if m.store_target_lse else ""
    print(
        f"captured {m.num_samples} samples, {m.total_tokens:,} tokens ({m.total_supervised:,} supervised), "
        f"layers {m.layer_ids}{topk}, computed in {m.precision}, {format_bytes(m.bytes)} in {len(m.shards)} shard(s) "
        f"→ {args.out} ({rate})"
    )
    return 0
