"""Per-run records → the statistics of results.json (`dflashkit.eval/1`).

    rec = run_record(generation_result, wall_s)          # one prompt × method, as progress.jsonl keeps it
    ar = ar_stats(ar_records, hf_records)                # the AR baseline: tok/s, seconds per step
    st = method_stats(records, method, block_size, ar, greedy=True)   # τ, histogram, speedup, equality, …

Timing conventions (design §4: ratios measured side by side in one run):
- `tok_s` = generated tokens / wall time of `generate` (prefill included); `decode_tok_s` excludes the prefill.
- `speedup_vs_ar` = tok_s / AR tok_s on the same prompts in the same run (`decode_speedup_vs_ar` likewise).
- `predicted_speedup` = τ_micro × t_AR_step / t_round, from stage costs: t_AR_step = AR stage time per token
  (prefill excluded), t_round = the method's stage time per round (draft + tree_build + verify + commit).
  `efficiency` = speedup_vs_ar / predicted_speedup: what survives of the ideal (loop overhead, prefill).
"""

from __future__ import annotations

from typing import Any

from dflashkit.evaluate.stats import Method, acceptance_stats

STAGES = ("prefill", "draft", "tree_build", "verify", "commit")


def run_record(res: Any, wall: float) -> dict[str, Any]:
    """What progress.jsonl keeps of one `generate` call (a GenerationResult) and its wall time."""
    return {
        "n_tokens": len(res.tokens),
        "acceptance_lengths": list(res.acceptance_lengths),
        "drafted": sum(res.drafted),
        "wall_s": wall,
        "timings": {k: float(res.timings.get(k, 0.0)) for k in STAGES},
        "stop_reason": res.stop_reason,
    }


def drafted_totals(records: list[dict[str, Any]]) -> list[int] | None:
    """The draft tokens verified per run record, or None when a record (kept from an older run) lacks them."""
    counts = [r.get("drafted") for r in records]
    return None if any(c is None for c in counts) else [int(c) for c in counts]


def timing_stats(records: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    totals = {k: sum(r["timings"].get(k, 0.0) for r in records) for k in STAGES}
    return {"timings_s": totals, "timings_per_round_s": {k: v / rounds if rounds else None for k, v in totals.items()}}


def _rate(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def ar_stats(records: list[dict[str, Any]], hf: list[dict[str, Any]]) -> dict[str, Any]:
    """The AR baseline over its run records (and HF `generate`'s, when timed): tokens/s and the cost of a step."""
    tokens = sum(r["n_tokens"] for r in records)
    rounds = sum(len(r["acceptance_lengths"]) for r in records)
    wall = sum(r["wall_s"] for r in records)
    t = timing_stats(records, rounds)
    prefill = t["timings_s"]["prefill"]
    stage = sum(v for k, v in t["timings_s"].items() if k != "prefill")
    out = {
        "n_prompts": len(records),
        "tokens": tokens,
        "rounds": rounds,
        "wall_s": wall,
        "tok_s": _rate(tokens, wall),
        "decode_tok_s": _rate(tokens - len(records), wall - prefill),
        "t_step_s": _rate(stage, rounds),
        **t,
    }
    if hf:
        hf_tokens, hf_wall = sum(h["n_tokens"] for h in hf), sum(h["wall_s"] for h in hf)
        out["hf_generate"] = {
            "tok_s": _rate(hf_tokens, hf_wall),
            "tokens": hf_tokens,
            "wall_s": hf_wall,
            "equal_to_ar_fraction": sum(h["equal_to_ar"] for h in hf) / len(hf),
        }
    return out


def method_stats(
    records: list[dict[str, Any]], method: Method, block_size: int, ar: dict[str, Any], greedy: bool
) -> dict[str, Any]:
    """One (drafter, method) over its run records: acceptance statistics, tokens/s, measured and predicted
    speedup against `ar` (from `ar_stats`), greedy equality and divergence verdicts."""
    lengths = [r["acceptance_lengths"] for r in records]
    acc = acceptance_stats(lengths, method.max_length(block_size), drafted_totals(records))
    tokens = sum(r["n_tokens"] for r in records)
    wall = sum(r["wall_s"] for r in records)
    t = timing_stats(records, acc["rounds"])
    prefill = t["timings_s"]["prefill"]
    t_round = _rate(sum(v for k, v in t["timings_s"].items() if k != "prefill"), acc["rounds"])
    tok_s, decode_tok_s = _rate(tokens, wall), _rate(tokens - len(records), wall - prefill)
    speedup = tok_s / ar["tok_s"] if tok_s and ar.get("tok_s") else None
    predicted = (
        acc["tau_micro"] * ar["t_step_s"] / t_round if acc["tau_micro"] and ar.get("t_step_s") and t_round else None
    )
    divergences = [dict(r["divergence"], prompt_id=r["prompt_id"]) for r in records if r.get("divergence")]
    return {
        **acc,
        "n_prompts": len(records),
        "block_size": block_size,
        "tokens": tokens,
        "tokens_per_round": _rate(tokens, acc["rounds"]),
        "wall_s": wall,
        "tok_s": tok_s,
        "decode_tok_s": decode_tok_s,
        "speedup_vs_ar": speedup,
        "decode_speedup_vs_ar": decode_tok_s / ar["decode_tok_s"] if decode_tok_s and ar.get("decode_tok_s") else None,
        "round_s": t_round,
        "predicted_speedup": predicted,
        "efficiency": speedup / predicted if speedup and predicted else None,
        **t,
        "greedy_equal_fraction": (
            sum(bool(r["greedy_equal"]) for r in records) / len(records) if greedy and records else None
        ),
        "divergences": divergences,
        "divergence_verdicts": {v: sum(d["verdict"] == v for d in divergences) for v in ("near_tie", "bug")},
    }


__all__ = ["STAGES", "ar_stats", "drafted_totals", "method_stats", "run_record", "timing_stats"]
