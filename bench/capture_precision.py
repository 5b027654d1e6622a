"""Capture throughput in fp32 and under bf16 autocast, side by side in one run (design §4: timings are ratios).

    .venv/bin/python bench/capture_precision.py [--tokens runs/quickstart/data/tokens.jsonl] [--limit 120]
        [--rounds 2] [--target default]

Runs the real `dflashkit.features.capture.capture` (the quickstart's settings: the default drafter's layers, bf16
storage, target tokens) over the same samples once per precision and round, alternating fp32, bf16, fp32, bf16, …
so that load from other processes on a shared machine hits both alike; each run writes a fresh directory. Without
--tokens it captures synthetic sequences (`--n` × `--length`). Prints a table, the feature difference of the two
captures (relative norm per layer, the labels' agreement), then one JSON line:
    {"fp32_tok_s": [...], "bf16_tok_s": [...], "ratio": median bf16 ÷ fp32 over rounds, "n_tokens": …}
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dflashkit.data.samples import Sample, read_tokens
from dflashkit.drafter.defaults import default_drafter_config
from dflashkit.features.capture import CaptureSettings, capture
from dflashkit.features.captured import CapturedFeatures
from dflashkit.target.model import Target

PRECISIONS = ("fp32", "bf16")


def synthetic_samples(n: int, length: int, vocab: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [
        Sample(f"bench-{i}", torch.randint(3, vocab, (length,), generator=g), torch.ones(length, dtype=torch.bool))
        for i in range(n)
    ]


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--target", default="default")
    p.add_argument("--tokens", default=None, help="tokens.jsonl to capture (default: synthetic sequences)")
    p.add_argument("--limit", type=int, default=120, help="samples of --tokens")
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    target = Target.load(args.target)
    layer_ids = list(default_drafter_config(target).target_layer_ids)
    if args.tokens:
        samples = read_tokens(args.tokens)[0][: args.limit]
    else:
        samples = synthetic_samples(args.n, args.length, target.vocab_size)
    n_tokens = sum(len(s) for s in samples)
    capture(target, samples[:2], tempfile.mkdtemp(), progress=False, log=None,
            settings=CaptureSettings(layer_ids=layer_ids, precision="fp32"))  # fmt: skip  # warm-up
    rates: dict[str, list[float]] = {x: [] for x in PRECISIONS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for precision in PRECISIONS:
                out = Path(tmp) / f"{precision}-{r}"
                t0 = time.perf_counter()
                capture(target, samples, out, progress=False, log=None,
                        settings=CaptureSettings(layer_ids=layer_ids, dtype="bf16", precision=precision))  # fmt: skip
                rates[precision].append(n_tokens / (time.perf_counter() - t0))
                print(f"round {r} {precision}: {rates[precision][-1]:,.0f} tok/s", flush=True)
        ref, got = (CapturedFeatures(Path(tmp) / f"{x}-0", expect_layer_ids=layer_ids) for x in PRECISIONS)
        h, rel, agree = target.hidden_size, {i: [] for i in layer_ids}, []
        for a, b in zip(ref, got, strict=True):
            for k, layer in enumerate(layer_ids):
                x, y = a.features[:, k * h : (k + 1) * h], b.features[:, k * h : (k + 1) * h]  # (T, H)
                rel[layer].append(((y - x).norm() / x.norm()).item())
            agree.append((a.target_tokens == b.target_tokens).float().mean().item())
    ratios = [b / a for a, b in zip(rates["fp32"], rates["bf16"], strict=True)]
    print(f"target {target.source}, layers {layer_ids}, {len(samples)} samples, {n_tokens:,} tokens, bf16 storage")
    print(f"{'precision':<12}" + "".join(f"{'round ' + str(r):>12}" for r in range(args.rounds)))
    for precision in PRECISIONS:
        print(f"{precision:<12}" + "".join(f"{x:>12,.0f}" for x in rates[precision]))
    print(f"bf16 ÷ fp32 per round: {', '.join(f'{x:.2f}' for x in ratios)}")
    print("features, bf16 against fp32 (relative norm, mean over samples): " + ", ".join(
        f"layer {i} {statistics.mean(v):.4f}" for i, v in rel.items()))  # fmt: skip
    print(f"labels equal: {statistics.mean(agree):.4f} of positions")
    print(json.dumps({
        "fp32_tok_s": [round(x, 1) for x in rates["fp32"]], "bf16_tok_s": [round(x, 1) for x in rates["bf16"]],
        "ratio": round(statistics.median(ratios), 3), "n_tokens": n_tokens,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
