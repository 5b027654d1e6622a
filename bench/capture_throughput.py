"""Capture throughput vs a plain target forward, side by side in one run (design §4: timings are ratios).

    .venv/bin/python bench/capture_throughput.py [--target default] [--n 8] [--length 512] [--dtype bf16]
        [--target-lse]   # + the target's log-sum-exp per position and its final layer (a DSpark capture)

Runs `dflashkit.features.capture.capture` (hooks + features + final-layer argmax + writing shards) over N synthetic
sequences, one sequence per shard, and from its `on_shard` callback times a plain `target.model(ids)` of the
sequence just captured: capture and baseline alternate sequence by sequence, so load from other processes on
a shared machine hits both alike. Prints a table, then one JSON line:
    {"capture_tok_s": …, "plain_forward_tok_s": …, "ratio": …, "ratio_median": …, "n_tokens": …}
(ratio = aggregate capture / plain throughput; ratio_median = median of the per-sequence ratios).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from dflashkit.data.samples import Sample
from dflashkit.drafter.defaults import default_drafter_config
from dflashkit.features.capture import CaptureSettings, capture
from dflashkit.features.captured import CapturedFeatures
from dflashkit.features.manifest import format_bytes
from dflashkit.target.model import Target


def synthetic_samples(n: int, length: int, vocab: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [
        Sample(
            id=f"bench-{i}",
            input_ids=torch.randint(3, vocab, (length,), generator=g),  # (T,)
            loss_mask=torch.ones(length, dtype=torch.bool),
        )
        for i in range(n)
    ]


@torch.no_grad()
def plain_forward_seconds(target: Target, samples: list[Sample]) -> float:
    t0 = time.perf_counter()
    for s in samples:
        target.model(s.input_ids[None].to(target.device))  # (1, T) → logits (1, T, V)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--target", default="default")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--target-lse", action="store_true", help="also store the target's log-sum-exp (DSpark's capture)")
    args = p.parse_args()

    target = Target.load(args.target)
    layer_ids = list(default_drafter_config(target).target_layer_ids)
    if args.target_lse and target.num_layers - 1 not in layer_ids:  # DSpark reads the final layer too
        layer_ids.append(target.num_layers - 1)
    samples = synthetic_samples(args.n, args.length, target.vocab_size)
    n_tokens = args.n * args.length
    plain_forward_seconds(target, samples[:1])  # warm-up (allocator, kernels)

    plain: list[float] = []  # per sequence: plain forward seconds
    marks: list[float] = []  # per sequence: clock when its shard was on disk, before its plain forward
    resumed: list[float] = []  # per sequence: clock after its plain forward (capture of the next one starts)

    def interleave(j: int, _manifest: object) -> None:
        marks.append(time.perf_counter())
        plain.append(plain_forward_seconds(target, [samples[j]]))
        resumed.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        m = capture(
            target,
            samples,
            tmp,
            progress=False,
            log=None,
            on_shard=interleave,
            settings=CaptureSettings(
                layer_ids=layer_ids,
                dtype=args.dtype,
                shard_max_tokens=args.length,
                store_target_lse=args.target_lse,
                precision="fp32",  # the plain forward's: this compares what capture adds around it
            ),
        )
        starts = [t0, *resumed[:-1]]
        per_capture = [end - start for start, end in zip(starts, marks, strict=True)]  # capture + write of one sequence
        t0 = time.perf_counter()
        ds = CapturedFeatures(tmp, expect_layer_ids=layer_ids)
        for i in range(len(ds)):
            ds[i]
        read_s = time.perf_counter() - t0
        size = m.bytes
    cap_s, plain_s = sum(per_capture), sum(plain)
    ratios = sorted(p / c for p, c in zip(plain, per_capture, strict=True))  # capture tok/s ÷ plain tok/s, per sequence
    ratio_median = statistics.median(ratios)

    capture_tok_s, plain_tok_s = n_tokens / cap_s, n_tokens / plain_s
    print(
        f"target {target.source} ({target.num_layers} layers, hidden {target.hidden_size}), layers {layer_ids}, "
        f"{args.n} × {args.length} tokens, storage {args.dtype}{' + target log-sum-exp' * args.target_lse}, "
        f"{format_bytes(size)} written"
    )
    print(f"{'path':<30}{'seconds':>10}{'tok/s':>10}")
    print(f"{'plain forward (target.model)':<30}{plain_s:>10.2f}{plain_tok_s:>10.0f}")
    print(f"{'capture (incl. shards)':<30}{cap_s:>10.2f}{capture_tok_s:>10.0f}")
    print(f"{'read back (CapturedFeatures)':<30}{read_s:>10.2f}{n_tokens / read_s:>10.0f}")
    print(f"per-sequence capture/plain throughput ratios: {', '.join(f'{r:.2f}' for r in ratios)}")
    print(
        json.dumps(
            {
                "capture_tok_s": round(capture_tok_s, 1),
                "plain_forward_tok_s": round(plain_tok_s, 1),
                "ratio": round(capture_tok_s / plain_tok_s, 3),
                "ratio_median": round(ratio_median, 3),
                "n_tokens": n_tokens,
            }
        )
    )


if __name__ == "__main__":
    main()
