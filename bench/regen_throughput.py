"""Regeneration throughput by batch size: how many target-written training tokens a minute of `prepare` buys.

    .venv/bin/python bench/regen_throughput.py                                # SmolLM2, ShareGPT prompts
    .venv/bin/python bench/regen_throughput.py --batch-sizes 8,16,32 --prompts 64 --max-new-tokens 192 --repeats 2
    .venv/bin/python bench/regen_throughput.py --batch-sizes 8,16 --server-slots 1,4,8 --server-gguf f32,q4_1

Regeneration (the target answering the training prompts, `dflashkit.data.regenerate`) is the most expensive data stage
on a CPU: the quickstart spends 6 of its minutes there. This runs the same prompts (the first N ShareGPT train
prompts of at most `--max-prompt-tokens` tokens, as the quickstart picks them; or a pre-tokenised JSONL file)
through `regenerate.generate_longest_first` at each batch size (longest first into batches, as `regenerate` does).
Batch sizes alternate within every repeat (order reversed on odd repeats), so machine drift hits all alike.
With `--kv-caches growing,dynamic` each in-process run also runs with transformers' DynamicCache (run label
`PRODUCTS+dynamic-kv`): dflashkit's decoding cache writes each step's K/V in place (target/kv_buffer.py), the
DynamicCache copies the whole batch's cache every step.
With `--products auto,stock,few_rows,onednn` each batch size also runs with each way of computing the products: `auto`
(dflashkit's choice per shape, measured on this machine: cpu_products/products.py), `stock` (F.linear, as plain HF
runs), `few_rows` (weight-stationary everywhere: one fixed rule for every CPU) and `onednn` (oneDNN's inner product
everywhere, where torch has it). The header names the machine (CPU, BLAS, threads).
With `--server-slots 1,4,8` the same prompts also go through llama.cpp's `llama-server` (scripts/build_llamacpp.sh)
with that many parallel slots and as many requests in flight — what `dflashkit prepare --server URL --concurrency N`
does — on the same number of threads, serving `--server-gguf` (f32: the target's F32 conversion, the exact weights
of the fp32 target; f16, bf16, q8_0: conversions that round them; q4_1: the shipped file); "same" then says how
often the server's greedy responses equal the fp32 HF target's (the first run, when it is an in-process one).
Server start-up is not timed. `--server-chunk N` also times each server run sent in chunks of N prompts, each chunk
waiting for its slowest reply before the next starts (against one long stream cut at a deadline, as the quickstart
sends it; run label `server-GGUF:cN`). `--engine-ceiling` adds llama.cpp's own batched decoding of the same
GGUFs at the same slot counts (`llama-batched-bench`: the mean prompt length, `--max-new-tokens` each, no server, no
HTTP, no early stop) — the most a llama-server can give on this machine — and each server run as a fraction of it.
Reported per run (products @ batch size): generated tokens per second (every response token up to and including
the stop token or the cap — what becomes supervised data), responses per minute, and the fraction of responses
identical to those of the first run (left padding or another product order must not change greedy output beyond
float ties). Prints a table, then ONE final JSON line: {"runs": ["auto@8", ...], "batch_sizes": [...],
"products": [...], "tok_s": [...], "responses_per_min": [...], "same_as_first": [...], "best_batch_size": B,
"best_products": P, "machine": "...", "n_prompts": N, "max_new_tokens": M}; the lists run over `runs`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import DynamicCache

from dflashkit.cpu_products import products
from dflashkit.cpu_products.choice import ENV, with_override
from dflashkit.cpu_products.machine import machine_line
from dflashkit.data.conversations import default_stop_token_ids
from dflashkit.data.regenerate import generate_longest_first
from dflashkit.evaluate.stats import load_prompts
from dflashkit.target.model import Target

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_ints

KV_CACHES = ("growing", "dynamic")


def run_batches(
    target: Target, prompts: list[list[int]], batch_size: int, max_new_tokens: int
) -> tuple[float, list[list[int]]]:
    """Seconds to regenerate all `prompts` at `batch_size` (longest first) and the responses, in input order."""
    t0 = time.perf_counter()
    responses = generate_longest_first(target, prompts, batch_size=batch_size, max_new_tokens=max_new_tokens)
    return time.perf_counter() - t0, responses


def run_server(
    gguf: Path,
    slots: int,
    prompts: list[list[int]],
    max_new_tokens: int,
    threads: int,
    stop_ids: list[int],
    tokenizer: object,
    extra_args: list[str] | None = None,
    chunk: int = 0,
) -> tuple[float, list[list[int]]]:
    """Seconds for a llama-server with `slots` parallel slots to answer all `prompts` (`slots` requests in flight,
    as `prepare --server URL --concurrency slots` sends them; server start not timed) and the responses. With
    `chunk`, the prompts go in chunks of that many, each chunk waiting for its slowest reply."""
    from concurrent.futures import ThreadPoolExecutor

    from dflashkit.data.server_client import ServerPool
    from dflashkit.export.llama_server import LlamaServer

    ctx = max(map(len, prompts)) + max_new_tokens + 16
    with LlamaServer(gguf, slots=slots, threads=threads, ctx_per_slot=ctx, extra_args=extra_args) as srv:
        pool = ServerPool([srv.url])
        pool.connect(tokenizer)  # the same model, checked

        def one(p: list[int]) -> list[int]:
            c = pool.complete(p, max_tokens=max_new_tokens, temperature=0.0, top_p=1.0, seed=0, stop_ids=stop_ids)
            return list(c.token_ids or [])

        t0 = time.perf_counter()
        step, responses = chunk or len(prompts), []
        with ThreadPoolExecutor(max_workers=slots) as ex:
            for i in range(0, len(prompts), step):
                responses += list(ex.map(one, prompts[i : i + step]))
        return time.perf_counter() - t0, responses


def _server_gguf(spec: str) -> Path:
    from dflashkit.export.llamacpp import TARGET_GGUF_TYPES, built, target_gguf
    from dflashkit.target.default import gguf_path

    if not built():
        raise SystemExit("error: --server-slots needs llama.cpp: run scripts/build_llamacpp.sh first")
    if spec.upper() in TARGET_GGUF_TYPES:
        return target_gguf(spec)
    if spec == "q4_1":
        return gguf_path()
    return Path(spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default="default", help="model directory, .gguf, or 'default' (embedded SmolLM2)")
    p.add_argument("--dataset", default="sharegpt", help="dataset name or pre-tokenised prompts JSONL")
    p.add_argument("--prompts", type=int, default=32, help="number of prompts (each batch size answers all)")
    p.add_argument("--max-prompt-tokens", type=int, default=384, help="longer prompts are skipped (as quickstart)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--batch-sizes", default="8,16,32", help="comma-separated; the first is the reference output")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--products", default="auto", help="comma-separated: auto, stock, few_rows, onednn, onednn_fused (side by side)"
    )
    p.add_argument(
        "--kv-caches",
        default="growing",
        help="comma-separated: growing (dflashkit's, appends in place), dynamic (transformers' DynamicCache, as HF"
        " generate): each in-process run with each (side by side)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: leave as is)")
    p.add_argument(
        "--server-slots",
        default="",
        help="also regenerate through llama-server with each of these parallel-slot counts, e.g. 1,4,8 "
        "(needs scripts/build_llamacpp.sh); its threads = torch's",
    )
    p.add_argument(
        "--server-gguf",
        default="f32",
        help="the GGUF llama-server runs: f32 (the target's F32 conversion: its exact weights; default), f16, bf16, "
        "q8_0 (conversions that round them), q4_1 (the shipped file), or a path; comma-separated to compare several",
    )
    p.add_argument("--server-args", default="", help="more llama-server arguments, e.g. '-fa on'")
    p.add_argument(
        "--server-chunk", type=int, default=0, help="also time each server run sent in chunks of this many prompts"
    )
    p.add_argument(
        "--engine-ceiling",
        action="store_true",
        help="also time llama-batched-bench on each --server-gguf at each --server-slots (the engine's own ceiling)",
    )
    args = p.parse_args(argv)
    sizes = positive_ints(args.batch_sizes, "--batch-sizes", "8,16,32")
    ways = [w.strip() for w in args.products.split(",") if w.strip()]
    if not ways or any(w not in products.MODES for w in ways):
        raise SystemExit(
            f"error: --products {args.products!r}: expected a comma-separated subset of {','.join(products.MODES)}"
        )
    if args.prompts < 1 or args.repeats < 1 or args.max_new_tokens < 1:
        raise SystemExit("error: --prompts, --repeats and --max-new-tokens must be positive integers")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = Target.load(args.target)
    loaded, _ = load_prompts(target, args.dataset, limit=8 * args.prompts, max_new_tokens=args.max_new_tokens)
    prompts = [q.ids for q in loaded if len(q.ids) <= args.max_prompt_tokens][: args.prompts]
    if not prompts:
        raise SystemExit(f"error: --dataset {args.dataset}: no prompt of ≤ {args.max_prompt_tokens} tokens")
    print(
        f"target {target.source}  {len(prompts)} prompts (mean {statistics.fmean(map(len, prompts)):.0f} "
        f"tokens)  max_new_tokens {args.max_new_tokens}\nmachine: {machine_line()}",
        flush=True,
    )
    kv_caches = [k.strip() for k in args.kv_caches.split(",") if k.strip()]
    if not kv_caches or any(k not in KV_CACHES for k in kv_caches):
        raise SystemExit(
            f"error: --kv-caches {args.kv_caches!r}: expected a comma-separated subset of {','.join(KV_CACHES)}"
        )
    ways = [w if k == "growing" else f"{w}+{k}-kv" for w in ways for k in kv_caches]
    runs = [(w, b) for w in ways for b in sizes]  # (products[+dynamic-kv], batch size)
    slots = positive_ints(args.server_slots, "--server-slots", "1,4,8") if args.server_slots else []
    ggufs = {g.strip(): _server_gguf(g.strip()) for g in args.server_gguf.split(",") if g.strip()} if slots else {}
    runs += [(f"server-{g}", n) for g in ggufs for n in slots]  # (llama-server GGUF, parallel slots)
    if args.server_chunk:
        runs += [(f"server-{g}:c{args.server_chunk}", n) for g in ggufs for n in slots]
    seconds = dict.fromkeys(runs, 0.0)
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    stop_ids = default_stop_token_ids(target)  # the config's eos for a target without tokenizer files
    for r in range(args.repeats):
        for run in runs if r % 2 == 0 else runs[::-1]:
            if run[0].startswith("server-"):
                threads = torch.get_num_threads()
                name, _, chunk = run[0].removeprefix("server-").partition(":c")
                s, outputs[run] = run_server(
                    ggufs[name],
                    run[1],
                    prompts,
                    args.max_new_tokens,
                    threads,
                    stop_ids,
                    target.tokenizer,
                    args.server_args.split(),
                    int(chunk or 0),
                )
            else:
                way, _, kv = run[0].partition("+")
                with _products(way), _kv_cache(target, kv.removesuffix("-kv") or "growing"):
                    s, outputs[run] = run_batches(target, prompts, run[1], args.max_new_tokens)
            seconds[run] += s
    tokens = {run: sum(map(len, outputs[run])) * args.repeats for run in runs}
    ref = outputs[runs[0]]
    doc = {
        "machine": machine_line(),
        "batch_sizes": sizes,
        "products": ways,
        "tok_s": [round(tokens[run] / seconds[run], 2) for run in runs],
        "responses_per_min": [round(60 * len(prompts) * args.repeats / seconds[run], 2) for run in runs],
        "same_as_first": [
            round(sum(a == c for a, c in zip(outputs[run], ref, strict=True)) / len(ref), 4) for run in runs
        ],
        "runs": [f"{w}@{b}" for w, b in runs],
        "n_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
    }
    best = max(range(len(runs)), key=lambda i: doc["tok_s"][i])
    doc["best_batch_size"], doc["best_products"] = runs[best][1], runs[best][0]
    print(f"{'products':>12} {'batch':>6} {'seconds':>8} {'tokens':>7} {'tok/s':>7} {'resp/min':>8} {'same':>5}")
    for i, (w, b) in enumerate(runs):
        print(
            f"{w:>12} {b:>6} {seconds[(w, b)]:>8.1f} {tokens[(w, b)]:>7} {doc['tok_s'][i]:>7.1f} "
            f"{doc['responses_per_min'][i]:>8.1f} {doc['same_as_first'][i]:>5.2f}"
        )
    if args.engine_ceiling and slots:
        doc["engine_ceiling_tok_s"] = _engine_ceiling(ggufs, slots, prompts, args.max_new_tokens, doc)
    print(json.dumps(doc))
    return 0


def _engine_ceiling(
    ggufs: dict[str, Path], slots: list[int], prompts: list[list[int]], max_new_tokens: int, doc: dict
) -> dict[str, dict[str, float]]:
    """llama-batched-bench on each GGUF at each slot count (printed next to the server runs); {gguf: {slots: tok/s}}."""
    from dflashkit.export.llamacpp import run_batched_bench

    mean_prompt = round(statistics.fmean(map(len, prompts)))
    print(f"llama.cpp's own batched decoding (llama-batched-bench: {mean_prompt}-token prompts, {max_new_tokens} new")
    print("tokens each, no server, no early stop; prefill included) against the server runs above:")
    print(f"{'gguf':>12} {'slots':>6} {'ceiling':>8} {'server':>7} {'share':>6}")
    ceiling: dict[str, dict[str, float]] = {}
    for name, gguf in ggufs.items():
        rates = run_batched_bench(gguf, slots, mean_prompt, max_new_tokens, torch.get_num_threads())
        ceiling[name] = {str(n): round(r, 2) for n, r in rates.items()}
        for n in slots:
            served = doc["tok_s"][doc["runs"].index(f"server-{name}@{n}")]
            print(f"{name:>12} {n:>6} {rates[n]:>8.1f} {served:>7.1f} {served / rates[n]:>6.2f}")
    return ceiling


@contextlib.contextmanager
def _kv_cache(target: Target, kind: str) -> Iterator[None]:
    """Decoding caches of the block: dflashkit's growing one (target/kv_buffer.py), or transformers' DynamicCache
    (`dynamic`: what plain HF `generate` uses, each step copying the whole cache)."""
    if kind == "growing":
        yield
        return
    target.new_cache = lambda: DynamicCache(config=target.model.config)  # shadows the method on this instance
    try:
        yield
    finally:
        del target.new_cache


@contextlib.contextmanager
def _products(way: str) -> Iterator[None]:
    """Every product of the block computed `way` (products=way in DFLASHKIT_CHOICES for the process, restored after)."""
    old = os.environ.get(ENV)
    os.environ[ENV] = with_override("products", way)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


if __name__ == "__main__":
    sys.exit(main())
