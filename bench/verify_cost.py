"""What one verification pass costs, by the number of tokens verified (the cost model behind block size and budget).

    .venv/bin/python bench/verify_cost.py                              # embedded SmolLM2, context 256
    .venv/bin/python bench/verify_cost.py --tokens 1,2,4,5,9,17 --context 512 --repeats 20 --threads 2

A speculative round pays one target pass over n = 1 + drafts tokens on top of the cached context; plain decoding
pays n = 1 per token. For each n this times (all interleaved, on the same cache, cropped back after every pass):
  forward        the target's decoder layers + final norm + LM head over n positions, with the products dflashkit
                 uses: each shape the way this machine does it fastest (measured at first use: cpu_products/products.py)
  stock          the same pass with every product through F.linear (how plain PyTorch / HF run it)
  few_rows       the same pass with every product weight-stationary (products=few_rows)
  onednn         the same pass with every product through oneDNN (products=onednn; where torch has it)
  onednn_fused   the same, a layer's products of one input (q/k/v, gate/up) as one (products=onednn_fused)
  mkl_packed     the same pass with every product through MKL's packed GEMM (products=mkl_packed; where
                 torch has MKL)
  native_rows    the same pass with every product through the few-row kernel compiled for this CPU
                 (products=native_rows; where a C++ compiler is)
  native_layers  the same pass with every decoder layer one compiled call (products=native_layers;
                 a Llama-family target, where a C++ compiler is: target/native_layers.py)
  body / head    the decoder layers alone / final norm + LM head over n rows (dflashkit's products)
and forward(n) / forward(1): a drafter pays off only if τ exceeds (draft + forward(n)) / forward(1). It also prints
the product chosen per width (how many of the pass's weight shapes took each path) and the physical floor: the
target's weight bytes over this machine's read bandwidth — a pass must read every weight once, so a memory-bound
pass over n tokens costs at least that, whatever n; `× floor` says how close each path gets.
The header names the CPU, its BLAS and threads. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from dflashkit.cpu_products import products
from dflashkit.cpu_products import report as product_report
from dflashkit.cpu_products.choice import ENV, with_override
from dflashkit.cpu_products.machine import machine_line, read_bandwidth
from dflashkit.target.cache import crop
from dflashkit.target.devices import synchronize
from dflashkit.target.model import Target

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_ints

FUSED = (products.FUSED,) if "onednn" in products.CANDIDATES else ()
LAYERS = (products.LAYERS,) if products.NATIVE in products.CANDIDATES else ()
PATHS = ("forward", *products.CANDIDATES, *FUSED, *LAYERS)  # forward (the measured choice), stock, few_rows, …


def _mode(path: str):
    """A context in which every product takes `path` (forward: dflashkit's measured choice)."""
    if path == "stock":
        return products.stock_products()

    class _Env:
        def __enter__(self):
            self.old = os.environ.get(ENV)
            os.environ[ENV] = with_override("products", "auto" if path == "forward" else path)

        def __exit__(self, *exc):
            if self.old is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = self.old

    return _Env()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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

    def timed(fn) -> float:
        synchronize(target.device)
        t0 = time.perf_counter()
        fn()
        synchronize(target.device)
        return time.perf_counter() - t0

    def forward(n: int, logits: bool) -> float:
        ids = torch.randint(10, target.vocab_size, (1, n), generator=g)
        pos = torch.arange(args.context, args.context + n)[None]
        t = timed(lambda: target.forward(ids, cache=cache, use_cache=True, position_ids=pos, logits=logits))
        crop(cache, args.context)
        return t

    hidden = torch.randn(1, max(sizes), target.hidden_size, generator=g).to(target.device, target.dtype)
    kinds = (*PATHS, "body", "head")
    times: dict[str, dict[int, list[float]]] = {k: {n: [] for n in sizes} for k in kinds}
    settle = 3 + products.chooser().repeats * (len(PATHS) - 1)  # a width's trial: that many steps in a row
    for n in sizes:  # warm-up: also makes dflashkit's choices (the layers' timed in consecutive steps, then kept)
        for path in PATHS:
            with _mode(path):
                for _ in range(settle if path == "forward" else 1):
                    forward(n, True)
        with _mode("forward"):  # a trial that was unclear runs more rounds (twice at most): until it has decided
            for _ in range(2 * settle):
                if not products.chooser().trial_running():
                    break
                forward(n, True)
    for _ in range(args.repeats):
        for n in sizes:  # interleaved, so slow phases of the machine hit every size and path alike
            for path in PATHS:
                with _mode(path):
                    times[path][n].append(forward(n, True))
            times["body"][n].append(forward(n, False))
            with torch.no_grad():
                times["head"][n].append(timed(lambda n=n: target.verifier_logits(hidden[:, :n])))
    med = {k: [statistics.median(v[n]) for n in sizes] for k, v in times.items()}
    weight_bytes = sum(t.numel() * t.element_size() for t in target.model.parameters())
    floor = weight_bytes / read_bandwidth() if target.device.type == "cpu" else None
    chosen = _chosen_per_width(sizes, target)
    _print_table(args, target, sizes, med, floor, weight_bytes, chosen)
    base = {k: med[k][0] for k in PATHS} if sizes[0] == 1 else None
    print(
        json.dumps(
            {
                "machine": machine_line(),
                "context": args.context,
                "tokens": sizes,
                "threads": torch.get_num_threads(),
                **{f"{k}_s": [round(x, 5) for x in v] for k, v in med.items()},
                "ratio": [round(f / base["forward"], 3) for f in med["forward"]] if base else None,
                "stock_ratio": [round(f / base["stock"], 3) for f in med["stock"]] if base else None,
                "floor_s": round(floor, 5) if floor else None,
                "weight_bytes": weight_bytes,
                "chosen": chosen,
            }
        )
    )
    return 0


def _chosen_per_width(sizes: list[int], target: Target) -> dict[str, str]:
    """Per verified width n: the choice for the decoder layers (one pass group) and for the LM head."""
    choices = product_report.choices_report()["choices"]
    group = next((m._pass_group for m in target.layers.modules() if hasattr(m, "_pass_group")), None)
    head = target.lm_head.weight
    out = {}
    for n in sizes:
        layers = choices.get(group.key(n, head.dtype), {}).get("choice", "—") if group else "—"
        lm = choices.get(products.shape_key(n, head, None), {}).get("choice", "—")
        out[str(n)] = f"layers {layers}, head {lm}"
    return out


def _print_table(args, target, sizes, med, floor, weight_bytes, chosen) -> None:
    print(f"target {target.source} ({target.architecture}), context {args.context}, median of {args.repeats}")
    print(f"machine: {machine_line()}")
    if floor:
        print(
            f"floor: {weight_bytes / 1e6:.0f} MB of weights at {weight_bytes / floor / 1e9:.1f} GB/s read = "
            f"{1e3 * floor:.1f} ms per pass"
        )
    others = PATHS[1:]  # stock, few_rows, onednn, onednn_fused
    print(
        f"{'tokens':>6} {'forward ms':>11} {'× fwd(1)':>9} {'× floor':>8} "
        + "".join(f"{name + ' ms':>{max(12, len(name) + 4)}}" for name in others)
        + f" {'body ms':>8} {'head ms':>8}  chosen"
    )
    for i, n in enumerate(sizes):
        r = f"{med['forward'][i] / med['forward'][0]:.2f}" if sizes[0] == 1 else "—"
        fl = f"{med['forward'][i] / floor:.2f}" if floor else "—"
        print(
            f"{n:>6} {1e3 * med['forward'][i]:>11.1f} {r:>9} {fl:>8} "
            + "".join(f"{1e3 * med[name][i]:>{max(12, len(name) + 4)}.1f}" for name in others)
            + f" {1e3 * med['body'][i]:>8.1f} {1e3 * med['head'][i]:>8.1f}  {chosen[str(n)]}"
        )


if __name__ == "__main__":
    sys.exit(main())
