"""dflashkit drafters inside llama.cpp: plain decoding vs DFlash vs llama.cpp's own n-gram speculation, Q4_1 and F32
targets, plus the same drafter in dflashkit's PyTorch loop — side by side in one run (design §4).

    scripts/build_llamacpp.sh                                   # once (a long build: docs/export.md)
    .venv/bin/python bench/llamacpp.py                          # the drafter `dflashkit quickstart` exported
    .venv/bin/python bench/llamacpp.py --drafter DIR --prompts 4 --n-predict 96 --n-max 3,7,15 --repeats 2

Target: the embedded SmolLM2-135M-Instruct, as the Q4_1 GGUF it ships in and as an F32 GGUF (llama-quantize).
The drafter is exported once per target (`convert --to gguf --target <that GGUF>`; --outtype f32 for the F32
target, f16 for Q4_1). Greedy, `--ignore-eos`, the same held-out prompts (MT-Bench turn 1, chat template).
Configurations, interleaved per prompt (their order rotates from prompt to prompt):
  plain          llama-speculative-simple with speculation that never fires (ngram-simple over 64-token n-grams:
                 0 drafts, checked) — plain decoding through the same loop, the baseline of every speedup
  completion     llama-completion (plain decoding in llama.cpp's own CLI loop; reference only)
  dflash:N       llama-speculative-simple --spec-type draft-dflash --spec-draft-n-max N (llama.cpp clamps N to
                 block_size − 1: larger N are listed as clamped and not run)
  ngram:N        --spec-type ngram-simple, lookup 3 tokens, drafts of up to N
  torch_ar / torch_chain   dflashkit's PyTorch loop (fp32 HF target) with the same drafter
Also llama-bench's cost of a batch of 4 / 8 / 16 tokens in single-token steps (what a verification costs).
Per configuration: tok/s (decode only, prompt excluded), speedup vs plain on the same target, τ (committed tokens
per verification), per-round draft ms and verify ms (decode time − draft time, per round). The header and the JSON
name the machine and the llama.cpp CPU backend variant that ran (the portable build loads one per x86 level).
Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dflashkit.cpu_products.machine import machine_line
from dflashkit.decode.generate import DecodeSettings
from dflashkit.export import llamacpp


def _prompts(tokenizer: Any, n: int) -> list[str]:
    from dflashkit.data.datasets import load_mtbench

    return [
        tokenizer.apply_chat_template(c.messages, tokenize=False, add_generation_prompt=True)
        for c in load_mtbench(turn=1, limit=n)
    ]


def _llamacpp_row(run: llamacpp.SpecRun) -> dict[str, float]:
    rounds = max(run.n_rounds, 1)
    row = {"tok_s": run.tokens_per_s, "tokens": run.decoded_tokens, "seconds": run.decode_s}
    if run.counts:
        row.update(
            tau=run.tau,
            rounds=run.n_rounds,
            draft_ms_per_round=run.draft_ms / rounds,
            verify_ms_per_round=(run.decode_s * 1e3 - run.draft_ms) / rounds,
        )
    return row


def _torch_row(target: Any, drafter: Any, prompt: str, method: str, n_predict: int) -> dict[str, float]:
    from dflashkit.decode.generate import generate

    ids = target.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    t0 = time.perf_counter()
    res = generate(
        target,
        ids,
        drafter=drafter if method == "chain" else None,
        settings=DecodeSettings(method=method, max_new_tokens=n_predict),
    )
    wall = time.perf_counter() - t0
    pre = res.timings.get("prefill", 0.0)
    row = {"tok_s": len(res.tokens) / max(wall - pre, 1e-9), "tokens": len(res.tokens), "seconds": wall - pre}
    if method == "chain":
        rounds = max(res.rounds, 1)
        row.update(
            tau=res.tau,
            rounds=res.rounds,
            draft_ms_per_round=1e3 * res.timings.get("draft", 0.0) / rounds,
            verify_ms_per_round=1e3 * (wall - pre - res.timings.get("draft", 0.0)) / rounds,
        )
    return row


def _batch_cost(target_gguf: Path, threads: int) -> dict[Any, float]:
    """llama-bench: ms of a 1-token pass and the cost of 4 / 8 / 16-token batches in single-token passes."""
    proc = subprocess.run(
        [
            str(llamacpp.tool("llama-bench")),
            "-m",
            str(target_gguf),
            "-p",
            "1,4,8,16",
            "-n",
            "0",
            "-t",
            str(threads),
            "-r",
            "5",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    ms = {int(r["n_prompt"]): r["avg_ns"] / 1e6 for r in json.loads(proc.stdout)}
    return {"step_ms": ms[1], **{n: ms[n] / ms[1] for n in (4, 8, 16)}}


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for r in rows for k in r})
    return {k: statistics.fmean(r[k] for r in rows if k in r) for k in keys}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--drafter", default="runs/quickstart/drafter", help="dflashkit drafter checkpoint directory")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n-predict", type=int, default=96)
    p.add_argument("--n-max", default="3,7,15")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--targets", default="q4_1,f32")
    p.add_argument("--no-torch", action="store_true", help="skip dflashkit's PyTorch loop")
    p.add_argument("--out-dir", default=None, help="where the drafter GGUFs go (default: next to the drafter)")
    args = p.parse_args(argv)
    if not llamacpp.built():
        print("llama.cpp is not built: run scripts/build_llamacpp.sh", file=sys.stderr)
        return 2

    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.export.gguf_export import export_gguf
    from dflashkit.target.default import gguf_path
    from dflashkit.target.model import Target

    torch.set_num_threads(args.threads)
    target = Target.load("default")
    drafter = load_drafter(args.drafter)
    bs = drafter.config.block_size
    prompts = _prompts(target.tokenizer, args.prompts)
    n_maxes = [int(x) for x in args.n_max.split(",")]
    run_nmax = [n for n in n_maxes if n <= bs - 1]
    clamped = [n for n in n_maxes if n > bs - 1]
    ggufs = {"q4_1": gguf_path(), "f32": llamacpp.f32_target_gguf()}
    targets = [t for t in args.targets.split(",") if t in ggufs]
    out_dir = Path(args.out_dir or args.drafter)
    drafter_gguf = {}
    for t in targets:
        drafter_gguf[t] = out_dir / f"drafter.{t}-target.gguf"
        export_gguf(args.drafter, drafter_gguf[t], target=ggufs[t], outtype="f32" if t == "f32" else "f16")

    configs = [(t, "plain", None) for t in targets] + [(t, "completion", None) for t in targets]
    configs += [(t, f"dflash:{n}", n) for t in targets for n in run_nmax]
    configs += [(t, f"ngram:{n}", n) for t in targets for n in n_maxes]
    if not args.no_torch:
        configs += [("torch_fp32", "torch_ar", None), ("torch_fp32", "torch_chain", None)]
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    # warm-up (page cache, first-load costs): one short run of each llama.cpp configuration kind
    variants: dict[str, str | None] = {}  # the CPU backend (x86 level) each target's runs loaded
    for t in targets:
        variants[t] = llamacpp.run_plain(ggufs[t], prompts[0], n_predict=8, threads=args.threads).cpu_variant
        llamacpp.run_speculative(
            ggufs[t],
            prompts[0],
            drafter=drafter_gguf[t],
            n_max=min(3, bs - 1),
            n_predict=8,
            threads=args.threads,
            verbose=False,
        )
    for rep in range(args.repeats):
        for i, prompt in enumerate(prompts):
            k = (i + rep) % len(configs)
            for tgt, name, n in configs[k:] + configs[:k]:
                if name == "plain":
                    run = llamacpp.run_speculative(
                        ggufs[tgt],
                        prompt,
                        spec_type="ngram-simple",
                        n_max=3,
                        n_predict=args.n_predict,
                        threads=args.threads,
                        verbose=False,
                        extra=["--spec-ngram-simple-size-n", "64"],
                    )
                    if run.counts.get("n_drafted"):
                        raise SystemExit(f"the 'plain' baseline drafted {run.counts['n_drafted']} tokens")
                    row = _llamacpp_row(run)
                    row.pop("tau", None)
                elif name == "completion":
                    row = _llamacpp_row(
                        llamacpp.run_plain(ggufs[tgt], prompt, n_predict=args.n_predict, threads=args.threads)
                    )
                elif name.startswith("dflash"):
                    row = _llamacpp_row(
                        llamacpp.run_speculative(
                            ggufs[tgt],
                            prompt,
                            drafter=drafter_gguf[tgt],
                            n_max=n,
                            n_predict=args.n_predict,
                            threads=args.threads,
                            verbose=False,
                        )
                    )
                elif name.startswith("ngram"):
                    row = _llamacpp_row(
                        llamacpp.run_speculative(
                            ggufs[tgt],
                            prompt,
                            spec_type="ngram-simple",
                            n_max=n,
                            n_predict=args.n_predict,
                            threads=args.threads,
                            verbose=False,
                            extra=["--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", str(n)],
                        )
                    )
                else:
                    with torch.no_grad():
                        row = _torch_row(target, drafter, prompt, name.split("_")[1], args.n_predict)
                rows.setdefault((tgt, name), []).append(row)
                print(
                    f"  [{rep}:{i}] {tgt:10s} {name:12s} {row['tok_s']:7.1f} tok/s"
                    + (f"  τ {row['tau']:.2f}" if "tau" in row else ""),
                    flush=True,
                )

    summary = {f"{t}/{n}": _mean(r) for (t, n), r in rows.items()}
    batch_cost = {t: _batch_cost(ggufs[t], args.threads) for t in targets}
    base = {"torch_fp32": summary.get("torch_fp32/torch_ar", {}).get("tok_s")}
    base.update({t: summary[f"{t}/plain"]["tok_s"] for t in targets})
    print(
        f"\nDrafter {args.drafter} (block {bs}, {drafter.config.num_hidden_layers} layers, "
        f"{'learned mask' if drafter.config.learned_mask_embedding else 'mask row'}"
        f"{', draft vocab ' + str(drafter.config.draft_vocab_size) if drafter.config.draft_vocab_size else ''}); "
        f"{len(prompts)} prompts × {args.repeats}, {args.n_predict} tokens, {args.threads} threads"
    )
    if clamped:
        print(f"dflash n_max {clamped}: llama.cpp clamps to block_size − 1 = {bs - 1}; not run")
    print(f"machine: {machine_line()}; llama.cpp CPU variant: {variants}")
    print(f"{'config':28s} {'tok/s':>7s} {'speedup':>8s} {'τ':>5s} {'draft ms/rd':>12s} {'verify ms/rd':>13s}")
    for key, s in summary.items():
        t = key.split("/")[0]
        sp = s["tok_s"] / base[t] if base.get(t) else float("nan")
        tau = f"{s['tau']:5.2f}" if "tau" in s else "    -"
        dr = f"{s['draft_ms_per_round']:12.1f}" if "draft_ms_per_round" in s else f"{'-':>12s}"
        vr = f"{s['verify_ms_per_round']:13.1f}" if "verify_ms_per_round" in s else f"{'-':>13s}"
        print(f"{key:28s} {s['tok_s']:7.1f} {sp:7.2f}× {tau} {dr} {vr}")
    for t, c in batch_cost.items():
        print(
            f"{t}: a batch of 4 / 8 / 16 tokens costs "
            + " / ".join(f"{c[n]:.2f}" for n in (4, 8, 16))
            + f" single-token steps (llama-bench, one step {c['step_ms']:.1f} ms)"
        )
    result: dict[str, Any] = {
        "bench": "llamacpp",
        "drafter": args.drafter,
        "block_size": bs,
        "n_prompts": len(prompts),
        "repeats": args.repeats,
        "n_predict": args.n_predict,
        "threads": args.threads,
        "dflash_n_max_clamped": clamped,
        "machine": machine_line(),
        "llamacpp_cpu_variant": variants,
    }
    for key, s in summary.items():
        t = key.split("/")[0]
        result[f"{key}/tok_s"] = round(s["tok_s"], 2)
        if base.get(t):
            result[f"{key}/speedup"] = round(s["tok_s"] / base[t], 3)
        for k in ("tau", "draft_ms_per_round", "verify_ms_per_round"):
            if k in s:
                result[f"{key}/{k}"] = round(s[k], 3)
    for t, c in batch_cost.items():
        result.update({f"{t}/batch_cost_steps/{n}": round(c[n], 3) for n in (4, 8, 16)})
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
