"""Decoding speed of a DFlash drafter against HF `generate`, side by side in one run (design §4: timings are ratios).

    .venv/bin/python bench/speed.py                          # the drafter `dflashkit quickstart` exported
    .venv/bin/python bench/speed.py --drafter DIR --prompts 8 --dataset humaneval --budgets 4,8,16 --threads 2
    .venv/bin/python bench/speed.py --target tiny/ --drafter d/ --dataset prompts.jsonl   # pre-tokenised prompts
    .venv/bin/python bench/speed.py --drafter none --prompts 12 --repeats 2   # dflashkit AR vs HF generate only

On the same held-out prompts (default: MT-Bench turn 1), greedy, with the target's end-of-turn ids as stops:
  hf_ar             HF `model.generate` (greedy), the reference output and the speed baseline
  dflashkit_ar      `decode.generate(method="ar")`: block size 1 through the speculative loop
  hf_prompt_lookup  HF `generate(prompt_lookup_num_tokens=10)` (n-gram drafts from the prompt, no drafter)
  chain             DFlash chain verification
  ddtree:B          DDTree for every budget B of `--budgets` (the best, by tok/s, is reported as "ddtree"); `auto`
                    in `--budgets` adds the budget `ddtree:auto` chooses on this machine (on `--budget-prompts`)
Methods are interleaved per prompt (their order rotates from prompt to prompt) so that load from other processes
hits all of them alike; every method runs on the first prompt as a warm-up before anything is timed (on CPU
until the products of its widths are settled: dflashkit/evaluate/warm_up.py).

Per method: tokens, wall seconds (prefill included), tok/s, speedup vs HF AR, greedy equality of the output vs
HF AR's (fraction of prompts; a divergence is triaged near_tie / bug as in `evaluate`), and the paired ratio: the
method's tok/s over HF AR's on the same prompt in the same round, its median and quartiles over all rounds
(`--repeats R` runs the prompts R times) — a ratio whose quartiles straddle 1.0 is within this machine's noise.
`--drafter none` times HF AR, dflashkit AR and prompt lookup only (no drafter needed). For dflashkit methods
also τ (macro: mean of per-prompt τ) and, from `evaluate`'s own aggregation, the predicted speedup
τ_micro × t_AR_step / t_round (t_AR_step: dflashkit AR's stage time per token, t_round: the method's stage time
per round, prefill excluded) and efficiency = measured speedup vs dflashkit AR / predicted. Prints a table,
then ONE final JSON line (keys: tau_chain_macro, tau_ddtree_best, ddtree_best_budget, hf_ar_tok_s, chain_tok_s,
speedup_chain_vs_hf_ar, speedup_ddtree_vs_hf_ar, speedup_prompt_lookup_vs_hf_ar, efficiency (chain),
greedy_equal_fraction (chain vs HF AR), n_prompts, and more).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dflashkit.cpu_products import report as product_report
from dflashkit.cpu_products.machine import machine_line
from dflashkit.cpu_products.products import stock_products
from dflashkit.data.conversations import default_stop_token_ids
from dflashkit.decode.generate import DecodeSettings, generate
from dflashkit.drafter.checkpoint import load_drafter
from dflashkit.evaluate.aggregate import ar_stats, method_stats, run_record
from dflashkit.evaluate.budget_choice import choose_tree_budget
from dflashkit.evaluate.stats import Method, Prompt, load_prompts
from dflashkit.evaluate.triage import triage_divergence
from dflashkit.evaluate.warm_up import settle
from dflashkit.quickstart.run import QuickstartSettings
from dflashkit.target.devices import synchronize
from dflashkit.target.model import Target

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_ints

HF_AR, DK_AR, PLD = "hf_ar", "dflashkit_ar", "hf_prompt_lookup"
PROMPT_LOOKUP_TOKENS = 10


def default_drafter_dir() -> Path:
    return Path(QuickstartSettings().out) / "drafter"


# ---------------------------------------------------------------------------------------------- one run
@torch.no_grad()
def hf_generate(
    target: Target, ids: Sequence[int], max_new_tokens: int, stops: list[int], prompt_lookup: int | None = None
) -> tuple[list[int], float]:
    """HF greedy `generate` (optionally prompt-lookup decoding); returns (new tokens, wall seconds)."""
    from transformers import GenerationConfig

    x = torch.tensor([list(ids)], device=target.device)  # (1, T)
    # An explicit config, as in evaluate: with no stop ids HF must not fall back to the model's own eos.
    cfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=list(stops) or None,
        pad_token_id=stops[0] if stops else 0,
        prompt_lookup_num_tokens=prompt_lookup,
    )
    synchronize(target.device)
    t0 = time.perf_counter()
    with stock_products():  # HF as users run it: stock F.linear products (dflashkit.cpu_products.products)
        out = target.model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)  # (1, T + n)
    synchronize(target.device)
    return out[0, x.shape[1] :].tolist(), time.perf_counter() - t0


def dk_generate(
    target: Target,
    ids: Sequence[int],
    drafter: Any,
    method: Method,
    max_new_tokens: int,
    stops: list[int],
    tree_top_k: int | None,
) -> tuple[Any, float]:
    """dflashkit `generate` for one Method; returns (GenerationResult, wall seconds)."""
    synchronize(target.device)
    t0 = time.perf_counter()
    res = generate(
        target,
        list(ids),
        drafter=None if method.kind == "ar" else drafter,
        settings=DecodeSettings(
            method=method.kind,
            max_new_tokens=max_new_tokens,
            tree_budget=method.budget or 16,
            tree_top_k=tree_top_k,
            stop_token_ids=stops,
        ),
    )
    synchronize(target.device)
    return res, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- the bench
def run_bench(
    target: Target,
    drafter: Any,
    prompts: list[Prompt],
    *,
    max_new_tokens: int,
    budgets: list[int],
    tree_top_k: int | None = None,
    stops: list[int],
    warmup: bool = True,
    repeats: int = 1,
) -> dict[str, Any]:
    """Every method on every prompt (`repeats` times over), interleaved; returns per-method statistics (see the
    module docstring). Without a drafter only the three autoregressive methods run."""
    spec = [] if drafter is None else [Method("chain", "chain")] + [Method(f"ddtree:{b}", "tree", b) for b in budgets]
    dk = {m.name: m for m in [Method(DK_AR, "ar"), *spec]}
    names = [HF_AR, DK_AR, PLD] + [m.name for m in spec]

    def run(name: str, p: Prompt, n: int) -> tuple[list[int], float, Any]:
        if name in (HF_AR, PLD):
            tokens, wall = hf_generate(target, p.ids, n, stops, PROMPT_LOOKUP_TOKENS if name == PLD else None)
            return tokens, wall, None
        res, wall = dk_generate(target, p.ids, drafter, dk[name], n, stops, tree_top_k)
        return res.tokens, wall, res

    if warmup:  # first calls pay one-off allocation costs: keep them out of the timings
        for name in names:
            run(name, prompts[0], min(8, max_new_tokens))
        for name in names:  # on CPU: until the products of each method's widths are settled (HF baselines: stock)
            if name not in (HF_AR, PLD):
                settle(lambda n, name=name: run(name, prompts[0], n), max_new_tokens, target.device)
    raw: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    from tqdm import tqdm

    rounds = [p for _ in range(repeats) for p in prompts]
    for i, p in enumerate(tqdm(rounds, desc="prompts (all methods)", unit="prompt", file=sys.stderr)):
        order = names[i % len(names) :] + names[: i % len(names)]  # rotate: no method always runs first
        outs = {name: run(name, p, max_new_tokens) for name in order}
        ref = outs[HF_AR][0]
        for name in names:
            tokens, wall, res = outs[name]
            rec = run_record(res, wall) if res is not None else {"n_tokens": len(tokens), "wall_s": wall}
            rec["prompt_id"] = p.id
            rec["divergence"] = None if name == HF_AR else triage_divergence(target, p.ids, ref, tokens)
            rec["greedy_equal"] = rec["divergence"] is None
            raw[name].append(rec)

    hf_tokens = sum(r["n_tokens"] for r in raw[HF_AR])
    hf_wall = sum(r["wall_s"] for r in raw[HF_AR])
    hf_tok_s = hf_tokens / hf_wall if hf_wall > 0 else None

    def vs_hf(tok_s: float | None) -> float | None:
        return tok_s / hf_tok_s if tok_s and hf_tok_s else None

    def divergences(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [dict(r["divergence"], prompt_id=r["prompt_id"]) for r in records if r["divergence"]]

    def equal(records: list[dict[str, Any]]) -> float:
        return sum(r["greedy_equal"] for r in records) / len(records)

    stats: dict[str, dict[str, Any]] = {}
    for name in (HF_AR, PLD):
        tokens, wall = sum(r["n_tokens"] for r in raw[name]), sum(r["wall_s"] for r in raw[name])
        tok_s = tokens / wall if wall > 0 else None
        stats[name] = {
            "tokens": tokens,
            "wall_s": wall,
            "tok_s": tok_s,
            "speedup_vs_hf_ar": vs_hf(tok_s),
            "greedy_equal_fraction": equal(raw[name]),
            "divergences": divergences(raw[name]),
        }
    ar = ar_stats(raw[DK_AR], [])
    stats[DK_AR] = {
        "tokens": ar["tokens"],
        "wall_s": ar["wall_s"],
        "tok_s": ar["tok_s"],
        "speedup_vs_hf_ar": vs_hf(ar["tok_s"]),
        "t_step_s": ar["t_step_s"],
        "greedy_equal_fraction": equal(raw[DK_AR]),
        "divergences": divergences(raw[DK_AR]),
    }
    for m in spec:
        # greedy_equal here means "equal to HF AR"
        st = method_stats(raw[m.name], m, drafter.config.block_size, ar, greedy=True)
        stats[m.name] = {
            k: st[k]
            for k in (
                "tokens",
                "wall_s",
                "tok_s",
                "tau_macro",
                "tau_micro",
                "rounds",
                "round_s",
                "timings_per_round_s",
                "speedup_vs_ar",
                "predicted_speedup",
                "efficiency",
                "greedy_equal_fraction",
                "divergences",
            )
        }
        stats[m.name]["speedup_vs_hf_ar"] = vs_hf(st["tok_s"])
    for name in names:
        stats[name]["paired_vs_hf_ar"] = paired_ratios(raw[name], raw[HF_AR])
    return {name: stats[name] for name in names}


def paired_ratios(records: list[dict[str, Any]], hf_records: list[dict[str, Any]]) -> dict[str, Any]:
    """The method's tok/s over HF AR's on the same prompt of the same round (run next to each other), summarised
    over the rounds: a machine's drift between rounds cancels in each ratio, so the quartiles show how far a
    difference stands from the noise. `above_1`: fraction of rounds the method was the faster."""
    ratios = sorted(
        (r["n_tokens"] / r["wall_s"]) / (h["n_tokens"] / h["wall_s"])
        for r, h in zip(records, hf_records, strict=True)
        if r["wall_s"] > 0 and h["wall_s"] > 0 and h["n_tokens"] > 0
    )
    if not ratios:
        return {"n": 0, "median": None, "q1": None, "q3": None, "min": None, "max": None, "above_1": None}
    q1, med, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return {
        "n": len(ratios),
        "median": med,
        "q1": q1,
        "q3": q3,
        "min": ratios[0],
        "max": ratios[-1],
        "above_1": sum(x > 1.0 for x in ratios) / len(ratios),
    }


# ---------------------------------------------------------------------------------------------- output
def _fmt(x: Any, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def _paired(p: dict[str, Any] | None) -> str:
    if not p or not p["n"]:
        return "—"
    return f"{p['median']:.3f} [{p['q1']:.3f}, {p['q3']:.3f}] ({p['n']})"


def print_table(stats: dict[str, dict[str, Any]], file: Any = sys.stdout) -> None:
    head = (
        f"{'method':<18}{'tokens':>7}{'wall s':>9}{'tok/s':>8}{'τ macro':>9}{'× HF AR':>9}{'× dk AR':>9}"
        f"{'predicted':>10}{'effic.':>8}{'= HF AR':>9}  {'paired × HF AR: median [q1, q3] (n)'}"
    )
    print(head, file=file)
    print("-" * len(head), file=file)
    for name, s in stats.items():
        print(
            f"{name:<18}{s['tokens']:>7}{s['wall_s']:>9.2f}{_fmt(s['tok_s'], '.1f'):>8}"
            f"{_fmt(s.get('tau_macro')):>9}{_fmt(s['speedup_vs_hf_ar']):>9}{_fmt(s.get('speedup_vs_ar')):>9}"
            f"{_fmt(s.get('predicted_speedup')):>10}{_fmt(s.get('efficiency')):>8}"
            f"{_fmt(s['greedy_equal_fraction']):>9}  {_paired(s.get('paired_vs_hf_ar'))}",
            file=file,
        )
    for name, s in stats.items():
        for d in s["divergences"]:
            print(
                f"  {name} differs from {HF_AR} on prompt {d['prompt_id']!r} at token {d['index']}: "
                f"{d['verdict']} (top-2 margin {d['margin']:.2e})",
                file=file,
            )
    if stats[DK_AR]["greedy_equal_fraction"] < 1.0:
        print(
            f"  WARNING: HF generate and dflashkit AR disagree on "
            f"{1 - stats[DK_AR]['greedy_equal_fraction']:.0%} of prompts (see above)",
            file=file,
        )


def summary(stats: dict[str, dict[str, Any]], budgets: list[int], **context: Any) -> dict[str, Any]:
    ar_only = {
        "bench": "speed",
        **context,
        "hf_ar_tok_s": stats[HF_AR]["tok_s"],
        "dflashkit_ar_tok_s": stats[DK_AR]["tok_s"],
        "prompt_lookup_tok_s": stats[PLD]["tok_s"],
        "speedup_dflashkit_ar_vs_hf_ar": stats[DK_AR]["speedup_vs_hf_ar"],
        "speedup_prompt_lookup_vs_hf_ar": stats[PLD]["speedup_vs_hf_ar"],
        "paired_vs_hf_ar": {name: st["paired_vs_hf_ar"] for name, st in stats.items() if name != HF_AR},
        "hf_ar_equals_dflashkit_ar_fraction": stats[DK_AR]["greedy_equal_fraction"],
        "greedy_equal_fraction_prompt_lookup": stats[PLD]["greedy_equal_fraction"],
        "divergence_bugs": sum(d["verdict"] == "bug" for s in stats.values() for d in s["divergences"]),
    }
    if "chain" not in stats:  # no drafter: the autoregressive rows only
        return ar_only
    trees = {b: stats[f"ddtree:{b}"] for b in budgets}
    best = max(budgets, key=lambda b: trees[b]["tok_s"] or 0.0)
    chain, tree = stats["chain"], trees[best]
    speculative = {name: st for name, st in stats.items() if name == "chain" or name.startswith("ddtree:")}
    best_method = max(speculative, key=lambda n: speculative[n]["tok_s"] or 0.0)
    ar_step = stats[DK_AR]["t_step_s"]
    return {
        **ar_only,
        # one chain round (draft + verify + commit) in AR steps, measured in the same run: break-even needs τ above it
        "round_cost_vs_ar": chain["round_s"] / ar_step if chain.get("round_s") and ar_step else None,
        "best_method": best_method,
        "speedup_best_vs_hf_ar": speculative[best_method]["speedup_vs_hf_ar"],
        "tau_chain_macro": chain["tau_macro"],
        "tau_ddtree_best": tree["tau_macro"],
        "ddtree_best_budget": best,
        "chain_tok_s": chain["tok_s"],
        "ddtree_tok_s": tree["tok_s"],
        "speedup_chain_vs_hf_ar": chain["speedup_vs_hf_ar"],
        "speedup_ddtree_vs_hf_ar": tree["speedup_vs_hf_ar"],
        "speedup_chain_vs_dflashkit_ar": chain["speedup_vs_ar"],
        "predicted_speedup_chain": chain["predicted_speedup"],
        "efficiency": chain["efficiency"],
        "efficiency_ddtree_best": tree["efficiency"],
        "greedy_equal_fraction": chain["greedy_equal_fraction"],
        "greedy_equal_fraction_ddtree_best": tree["greedy_equal_fraction"],
        "ddtree": {
            str(b): {
                k: t[k]
                for k in (
                    "tok_s",
                    "tau_macro",
                    "speedup_vs_hf_ar",
                    "speedup_vs_ar",
                    "predicted_speedup",
                    "efficiency",
                    "greedy_equal_fraction",
                )
            }
            for b, t in trees.items()
        },
    }


# ---------------------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument(
        "--drafter",
        default=None,
        help=f"drafter directory (default: {default_drafter_dir()}); 'none' times the autoregressive methods only",
    )
    p.add_argument("--target", default="default", help="target model directory, .gguf, or 'default'")
    p.add_argument(
        "--dataset", default="mtbench", help="mtbench (turn 1) | humaneval | a chat JSONL | a JSONL of {id, prompt_ids}"
    )
    p.add_argument("--prompts", type=int, default=8, help="number of prompts")
    p.add_argument(
        "--repeats", type=int, default=1, help="rounds over the prompts (more rounds: tighter paired quartiles)"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--budgets",
        default="4,8,16",
        help="DDTree budgets (comma-separated; 'auto' adds the budget ddtree:auto chooses on this machine, "
        "evaluate/budget_choice.py); the best is reported",
    )
    p.add_argument("--budget-prompts", default="sharegpt-heldout", help="calibration prompts of 'auto' (the first two)")
    p.add_argument(
        "--tree-top-k", type=int, default=0, help="DDTree tokens per depth (0 = the budget, as the DDTree reference)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: leave as is)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)

    auto = "auto" in [b.strip().lower() for b in args.budgets.split(",")]
    fixed = ",".join(b for b in args.budgets.split(",") if b.strip().lower() != "auto")
    budgets = positive_ints(fixed, "--budgets", "4,8,16", unique_sorted=True) if fixed.strip() or not auto else []
    if args.prompts < 1 or args.max_new_tokens < 1 or args.repeats < 1:
        raise SystemExit("error: --prompts, --repeats and --max-new-tokens must be positive")
    no_drafter = args.drafter is not None and args.drafter.strip().lower() == "none"
    drafter_dir = Path(args.drafter) if args.drafter else default_drafter_dir()
    if not no_drafter and not (drafter_dir / "config.json").is_file():
        hint = (
            "run `dflashkit quickstart` first (it exports its drafter there) or pass --drafter DIR"
            if args.drafter is None
            else "pass a directory with config.json and model.safetensors"
        )
        raise SystemExit(f"error: no drafter at {drafter_dir}: {hint}")
    if args.threads:
        torch.set_num_threads(args.threads)

    target = Target.load(args.target, device=args.device)
    drafter = None if no_drafter else load_drafter(drafter_dir, device=args.device).eval()
    block_size = None if drafter is None else drafter.config.block_size
    prompts, skipped = load_prompts(target, args.dataset, limit=args.prompts, max_new_tokens=args.max_new_tokens)
    stops = sorted({int(t) for t in default_stop_token_ids(target)})
    choice = None
    if auto and drafter is not None:  # before anything is timed, as `dflashkit eval` does
        calibration, _ = load_prompts(target, args.budget_prompts, limit=2, max_new_tokens=args.max_new_tokens)
        choice = choose_tree_budget(
            target, drafter, calibration, max_new_tokens=args.max_new_tokens, stop_token_ids=stops, progress=True
        )
        print(f"ddtree:auto chose {choice.describe()}")
        budgets = sorted({*budgets, choice.budget})
    print(
        f"target {target.source}  drafter {'none' if no_drafter else drafter_dir} (block size {block_size})  "
        f"dataset {args.dataset}: {len(prompts)} prompts ({len(skipped)} skipped) × {args.repeats}  max_new_tokens "
        f"{args.max_new_tokens}  threads {torch.get_num_threads()}  stops {stops}"
    )
    stats = run_bench(
        target,
        drafter,
        prompts,
        max_new_tokens=args.max_new_tokens,
        budgets=budgets,
        tree_top_k=args.tree_top_k,
        stops=stops,
        repeats=args.repeats,
    )
    print_table(stats)
    chosen = {str(rows): c for rows, c in product_report.choices_by_rows().items()}
    print(f"machine: {machine_line()}")
    print(
        "products chosen per width (rows: shapes per path): "
        + "; ".join(f"{r}: " + ", ".join(f"{k} {v}" for k, v in c.items()) for r, c in chosen.items())
    )
    doc = summary(
        stats,
        budgets,
        target=str(target.source),
        drafter="none" if no_drafter else str(drafter_dir),
        dataset=str(args.dataset),
        n_prompts=len(prompts),
        repeats=args.repeats,
        max_new_tokens=args.max_new_tokens,
        block_size=block_size,
        threads=torch.get_num_threads(),
        machine=machine_line(),
        products_chosen=chosen,
        **({"ddtree_auto_budget": choice.budget, "ddtree_auto_choice": choice.as_dict()} if choice else {}),
    )
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    main()
