"""What one verification pass costs, by the number of tokens verified (the cost model behind block size and budget).

    .venv/bin/python bench/verify_cost.py                              # embedded SmolLM2, context 256
    .venv/bin/python bench/verify_cost.py --tokens 1,2,3,5,9,17 --context 512 --repeats 20 --threads 2

A speculative round pays one target pass over n = 1 + drafts tokens on top of the cached context; plain decoding
pays n = 1 per token. For each n this prints the median seconds of (all interleaved, on the same cache, cropped
back after every pass):
  forward      the target's decoder layers + final norm + LM head over all n positions (what chain/DDTree verify do)
  body         the decoder layers only (no LM head)
  head         final norm + LM head over n rows (forward − body, measured directly)
and the ratio forward(n) / forward(1): a drafter pays off only if τ exceeds (draft + forward(n)) / forward(1).
`stock forward` is the same pass with every product through F.linear (`few_rows.stock_products()`), i.e. without
the weight-stationary products dflashkit uses for 2–16 rows on CPU — interleaved with the others.
The last line is JSON: {"context": C, "tokens": [...], "forward_s": [...], "body_s": [...], "head_s": [...],
"stock_forward_s": [...], "ratio": [...], "stock_ratio": [...]}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dflashkit.target.cache import crop
from dflashkit.target.model import Target
from dflashkit.target.products import stock_products

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_ints


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="default", help="model directory, .gguf, or 'default' (embedded SmolLM2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--context", type=int, default=256, help="cached context length before each pass")
    p.add_argument("--tokens", default="1,2,3,5,9,17", help="numbers of tokens verified in one pass")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = p.parse_args(argv)
    sizes = positive_ints(args.tokens, "--tokens", "1,5,9")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = Target.load(args.target, device=args.device)
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(10, target.vocab_size, (1, args.context), generator=g)
    cache = target.new_cache()
    target.forward(ctx, cache=cache, use_cache=True, logits=False)
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    def forward(n: int, logits: bool) -> float:
        ids = torch.randint(10, target.vocab_size, (1, n), generator=g)
        pos = torch.arange(args.context, args.context + n)[None]
        t = timed(lambda: target.forward(ids, cache=cache, use_cache=True, position_ids=pos, logits=logits))
        crop(cache, args.context)
        return t

    hidden = torch.randn(1, max(sizes), target.hidden_size, generator=g).to(target.device, target.dtype)
    kinds = ("forward", "body", "head", "stock_forward")
    times: dict[str, dict[int, list[float]]] = {k: {n: [] for n in sizes} for k in kinds}
    for n in sizes:  # warm-up
        forward(n, True)
    for _ in range(args.repeats):
        for n in sizes:  # interleaved, so slow phases of the machine hit every size alike
            times["forward"][n].append(forward(n, True))
            times["body"][n].append(forward(n, False))
            with stock_products():
                times["stock_forward"][n].append(forward(n, True))
            with torch.no_grad():
                times["head"][n].append(timed(lambda n=n: target.verifier_logits(hidden[:, :n])))
    med = {k: [statistics.median(v[n]) for n in sizes] for k, v in times.items()}
    ratio = [f / med["forward"][0] for f in med["forward"]] if sizes[0] == 1 else [None] * len(sizes)
    stock_ratio = [f / med["stock_forward"][0] for f in med["stock_forward"]] if sizes[0] == 1 else [None] * len(sizes)
    print(
        f"target {target.source} ({target.architecture}), context {args.context}, {torch.get_num_threads()} "
        f"threads, median of {args.repeats}"
    )
    print(
        f"{'tokens':>6} {'forward ms':>11} {'body ms':>8} {'head ms':>8} {'× forward(1)':>13} "
        f"{'stock ms':>9} {'stock ×(1)':>11}"
    )
    for i, n in enumerate(sizes):
        r = f"{ratio[i]:.2f}" if ratio[i] is not None else "—"
        sr = f"{stock_ratio[i]:.2f}" if stock_ratio[i] is not None else "—"
        print(
            f"{n:>6} {1e3 * med['forward'][i]:>11.1f} {1e3 * med['body'][i]:>8.1f} {1e3 * med['head'][i]:>8.1f} "
            f"{r:>13} {1e3 * med['stock_forward'][i]:>9.1f} {sr:>11}"
        )
    print(
        json.dumps(
            {
                "context": args.context,
                "tokens": sizes,
                "threads": torch.get_num_threads(),
                **{f"{k}_s": [round(x, 5) for x in v] for k, v in med.items()},
                "ratio": [None if x is None else round(x, 3) for x in ratio],
                "stock_ratio": [None if x is None else round(x, 3) for x in stock_ratio],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
