"""Training throughput of the default drafter on the embedded SmolLM2-135M-Instruct target.

    .venv/bin/python bench/train_throughput.py                        # default geometries, 4 steps each
    .venv/bin/python bench/train_throughput.py --geometries 1024:64 --steps 6 --threads 2

Each geometry (max_tokens per row : max_anchors per document) runs the real `train()` loop for a few steps in
its own subprocess (so peak RSS is per geometry) on synthetic features — random (T, K·H) tensors of the right
shape, so no capture is needed — with token ids from the target's tokenizer on a fixed English text (random ids
when the tokenizer is missing). Reported: supervised block positions per second (slots k ≥ 1 with a label,
the unit the loss trains on), tokens per second, seconds per step (median of the steps after the first), and
peak resident memory (`resource.getrusage` max RSS). Prints a table, then ONE final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEXT = (
    "Speculative decoding lets a small drafter propose several tokens that the large target model then "
    "verifies in a single forward pass. A block diffusion drafter proposes a whole block at once, reading "
    "the target's hidden states as context, so the accepted length per verification step decides the "
    "speedup. Training uses random anchors inside the assistant responses, one block per anchor. "
)


def _one(args: argparse.Namespace) -> dict:
    import torch

    from dflashkit.data.samples import Sample
    from dflashkit.drafter.defaults import default_drafter_config
    from dflashkit.drafter.model import DFlashDrafter
    from dflashkit.target.model import Target
    from dflashkit.train.config import TrainConfig
    from dflashkit.train.loop import train
    from dflashkit.train.metrics import read_metrics

    if args.threads:
        torch.set_num_threads(args.threads)
    max_tokens, max_anchors = (int(x) for x in args.one.split(":"))
    target = Target.load("default")
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # target weights resident
    dcfg = default_drafter_config(target, block_size=args.block_size)
    width = dcfg.num_features * dcfg.hidden_size
    g = torch.Generator().manual_seed(0)
    if target.tokenizer is not None:
        base = torch.tensor(target.tokenizer(TEXT * 40)["input_ids"], dtype=torch.long)
    else:
        base = torch.randint(0, target.vocab_size, (4096,), generator=g)
    samples = []
    n_samples = max(2, (args.steps + 1) * max(1, max_tokens // args.seq_len))
    for i in range(n_samples):
        start = int(torch.randint(0, max(1, len(base) - args.seq_len), (1,), generator=g))
        ids = base[start : start + args.seq_len]
        mask = torch.ones(len(ids), dtype=torch.bool)
        mask[: len(ids) // 8] = False  # a short unsupervised "prompt"
        feats = torch.randn(len(ids), width, generator=g) * 2.0  # (T, K·H) synthetic features
        samples.append(Sample(f"b{i}", ids, mask, feats, None))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(
            out=tmp,
            drafter={"block_size": args.block_size},
            max_tokens=max_tokens,
            max_anchors=max_anchors,
            max_steps=args.steps,
            save_every=0,
            progress=False,
            tensorboard=False,
            warmup_ratio=0.0,
        )
        t0 = time.perf_counter()
        train(cfg, dataset=samples, target=target)
        wall = time.perf_counter() - t0
        recs = [r for r in read_metrics(Path(tmp) / "metrics.jsonl") if r["split"] == "train"]
    steady = recs[1:] or recs
    med = lambda key: statistics.median(r[key] for r in steady)  # noqa: E731
    return {
        "max_tokens": max_tokens,
        "max_anchors": max_anchors,
        "block_size": args.block_size,
        "steps": len(recs),
        "drafter_params": DFlashDrafter(dcfg).num_parameters(),
        "block_positions_per_s": med("block_positions_per_s"),
        "tokens_per_s": med("tokens_per_s"),
        "step_s": med("step_s"),
        "first_step_s": recs[0]["step_s"],
        "wall_s": wall,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_after_target_mib": rss_loaded,
        "threads": torch.get_num_threads(),
        "drafter_layers": dcfg.num_hidden_layers,
        "hidden": dcfg.hidden_size,
        "features": width,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--geometries", default="512:32,1024:64,1024:256", help="comma-separated max_tokens:max_anchors pairs"
    )
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512, help="tokens per synthetic sample")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(_one(args)))
        return
    results = []
    for geo in args.geometries.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--one",
            geo,
            "--steps",
            str(args.steps),
            "--seq-len",
            str(args.seq_len),
            "--block-size",
            str(args.block_size),
            "--threads",
            str(args.threads),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if proc.returncode != 0:
            print(f"{geo}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
            results.append({"geometry": geo, "error": proc.stderr.strip().splitlines()[-1:]})
            continue
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(
        f"{'max_tokens':>10} {'anchors':>7} {'block pos/s':>12} {'tokens/s':>9} {'s/step':>7} {'1st step s':>10} "
        f"{'peak RSS MiB':>12} {'(target)':>9}"
    )
    for r in results:
        if "error" in r:
            print(f"{r['geometry']:>18}  error: {r['error']}")
            continue
        print(
            f"{r['max_tokens']:>10} {r['max_anchors']:>7} {r['block_positions_per_s']:>12.0f} "
            f"{r['tokens_per_s']:>9.0f} {r['step_s']:>7.2f} {r['first_step_s']:>10.2f} {r['peak_rss_mib']:>12.0f} "
            f"{r['rss_after_target_mib']:>9.0f}"
        )
    ok = [r for r in results if "error" not in r]
    print(
        json.dumps(
            {
                "bench": "train_throughput",
                "target": "SmolLM2-135M-Instruct",
                "device": "cpu",
                "block_size": args.block_size,
                "steps": args.steps,
                "results": results,
                "best_block_positions_per_s": max((r["block_positions_per_s"] for r in ok), default=None),
            }
        )
    )


if __name__ == "__main__":
    main()
