"""Evaluation: real speculative decoding of many drafters × methods against the AR baseline, on the same prompts.

    prompts, skipped = load_prompts(target, "mtbench", limit=20, max_new_tokens=256)
    results = evaluate(target, {"ours": drafter}, prompts, methods=["ar", "chain", "ddtree:8"],
                       max_new_tokens=256, out_dir="runs/eval")

Per prompt: the AR baseline runs once (drafter-independent) through the same `decode.generate(method="ar")`, then
every (drafter, method). At temperature 0 each output must equal the AR output; on a divergence the first
differing index is triaged: the target's logits are recomputed on the shared prefix, and a top-2 margin below
`triage_threshold` with both tokens in the top 2 is a numerical **near_tie**, anything else a **bug**. Each
finished prompt is appended to `out_dir/progress.jsonl` (one JSON line) and skipped when the run is resumed with
the same settings; `out_dir/results.json` (the source of truth for reports) is rewritten at the end.

Timing conventions (design §4: ratios measured side by side in one run):
- `tok_s` = generated tokens / wall time of `generate` (prefill included); `decode_tok_s` excludes the prefill.
- `speedup_vs_ar` = tok_s / AR tok_s on the same prompts in the same run (`decode_speedup_vs_ar` likewise).
- `predicted_speedup` = τ_micro × t_AR_step / t_round, from stage costs: t_AR_step = AR stage time per token
  (prefill excluded), t_round = the method's stage time per round (draft + tree_build + verify + commit).
  `efficiency` = speedup_vs_ar / predicted_speedup: what survives of the ideal (loop overhead, prefill).
A resumed run aggregates timings measured in different sessions; rerun with resume=False for clean timings.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from dflashkit.data.conversations import default_stop_token_ids
from dflashkit.decode.generate import generate
from dflashkit.errors import ConfigError, DataError
from dflashkit.target.products import stock_products
from dflashkit.evaluate.stats import (Method, Prompt, acceptance_stats, drafter_fingerprint, drafter_info, parse_methods,
                                  prompt_sha, target_info)
from dflashkit.decode.hybrid_tree import resolve_mode
from dflashkit.io_utils import atomic_write_text
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.decode.sampling import SamplingParams
from dflashkit.target.model import Target, check_drafter_fits

STAGES = ("prefill", "draft", "tree_build", "verify", "commit")
PROGRESS, RESULTS = "progress.jsonl", "results.json"
AR_METHOD = Method("ar", "ar")   # the baseline every prompt runs first


# ---------------------------------------------------------------------------------------------- triage
def default_triage_threshold(dtype: torch.dtype) -> float:
    """Largest top-2 logit margin still called a numerical near-tie: batch-shape noise grows with low precision."""
    return 1e-3 if dtype in (torch.float32, torch.float64) else 0.25


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where the two token lists differ (a length difference counts), or None when equal."""
    n = min(len(a), len(b))
    i = next((k for k in range(n) if a[k] != b[k]), n)
    return None if i == n and len(a) == len(b) else i


@torch.no_grad()
def logit_margin(target: Target, prefix_ids: Sequence[int]) -> tuple[float, list[int]]:
    """Top-1 minus top-2 verifier logit after `prefix_ids`, and the two top tokens."""
    out = target.forward(torch.tensor([list(prefix_ids)], dtype=torch.long), logits_to_keep=1)
    top = out.logits[0, -1].float().topk(2)
    return float(top.values[0] - top.values[1]), top.indices.tolist()


def triage_divergence(target: Target, prompt_ids: Sequence[int], reference: Sequence[int], other: Sequence[int], *,
                      threshold: float | None = None) -> dict[str, Any] | None:
    """Where `other` first departs from the greedy `reference` (both after `prompt_ids`), and why.

    verdict "near_tie": the target's top-2 margin on the shared prefix is below `threshold` and both tokens are
    the top 2 (a floating-point coin flip between batch shapes); "bug": anything else. None when equal.
    """
    i = first_divergence(reference, other)
    if i is None:
        return None
    threshold = default_triage_threshold(target.dtype) if threshold is None else float(threshold)
    margin, top2 = logit_margin(target, list(prompt_ids) + list(reference[:i]))
    ref_tok = int(reference[i]) if i < len(reference) else None
    oth_tok = int(other[i]) if i < len(other) else None
    near = margin < threshold and ref_tok in top2 and oth_tok in top2
    return {"index": i, "ar_token": ref_tok, "spec_token": oth_tok, "margin": margin, "top2": top2,
            "threshold": threshold, "verdict": "near_tie" if near else "bug"}


# ---------------------------------------------------------------------------------------------- runs
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run(target: Target, prompt: Prompt, *, drafter: DFlashDrafter | None, method: Method, max_new_tokens: int,
         sampling: SamplingParams, block_size: int | None, tree_top_k: int | None, stops: list[int],
         seed: int | None) -> tuple[Any, float]:
    _sync(target.device)
    t0 = time.perf_counter()
    try:
        res = generate(target, prompt.ids, drafter=drafter, method=method.kind, max_new_tokens=max_new_tokens,
                       block_size=block_size, tree_budget=method.budget or 16, tree_top_k=tree_top_k,
                       sampling=sampling, stop_token_ids=stops, seed=seed)
    except ValueError as e:  # e.g. a prompt too long for the context window (load_prompts skips those)
        raise DataError(f"prompt {prompt.id!r}: {e}") from None
    _sync(target.device)
    return res, time.perf_counter() - t0


def _record(res: Any, wall: float) -> dict[str, Any]:
    return {"n_tokens": len(res.tokens), "acceptance_lengths": list(res.acceptance_lengths), "wall_s": wall,
            "timings": {k: float(res.timings.get(k, 0.0)) for k in STAGES}, "stop_reason": res.stop_reason}


@torch.no_grad()
def _hf_generate(target: Target, prompt: Prompt, max_new_tokens: int, stops: list[int]) -> tuple[list[int], float]:
    from transformers import GenerationConfig

    ids = torch.tensor([prompt.ids], device=target.device)
    _sync(target.device)
    t0 = time.perf_counter()
    # An explicit config: with no stop ids HF must not fall back to the model's own eos (the AR loop does not stop).
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(stops) or None,
                           pad_token_id=stops[0] if stops else 0)
    with stock_products():   # HF as users run it: stock F.linear products (dflashkit.target.products)
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    _sync(target.device)
    return out[0, ids.shape[1]:].tolist(), time.perf_counter() - t0


def read_progress(path: Path, *, repair: bool = False) -> list[dict[str, Any]]:
    """Records of progress.jsonl. A last line without its newline (a kill mid-write) is ignored, and cut from the
    file when `repair` (so that appends start on a fresh line); a damaged complete line raises DataError."""
    if not path.exists():
        return []
    data = path.read_bytes()
    complete, sep, tail = data.rpartition(b"\n")
    out = []
    for lineno, line in enumerate(complete.split(b"\n") if sep else [], start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not {"key", "id", "prompt_sha", "ar", "runs"} <= set(rec):
                raise ValueError("expected an object with key, id, prompt_sha, ar and runs")
        except ValueError as e:
            raise DataError(f"{path}:{lineno}: damaged progress record ({e}); delete the file to start over") from None
        out.append(rec)
    if repair and tail:
        with open(path, "r+b") as f:
            f.truncate(len(data) - len(tail))
    return out


# ---------------------------------------------------------------------------------------------- aggregation
def _timing_stats(records: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    totals = {k: sum(r["timings"].get(k, 0.0) for r in records) for k in STAGES}
    return {"timings_s": totals, "timings_per_round_s": {k: v / rounds if rounds else None for k, v in totals.items()}}


def _rate(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _ar_stats(records: list[dict[str, Any]], hf: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(r["n_tokens"] for r in records)
    rounds = sum(len(r["acceptance_lengths"]) for r in records)
    wall = sum(r["wall_s"] for r in records)
    t = _timing_stats(records, rounds)
    prefill = t["timings_s"]["prefill"]
    stage = sum(v for k, v in t["timings_s"].items() if k != "prefill")
    out = {"n_prompts": len(records), "tokens": tokens, "rounds": rounds, "wall_s": wall, "tok_s": _rate(tokens, wall),
           "decode_tok_s": _rate(tokens - len(records), wall - prefill), "t_step_s": _rate(stage, rounds), **t}
    if hf:
        hf_tokens, hf_wall = sum(h["n_tokens"] for h in hf), sum(h["wall_s"] for h in hf)
        out["hf_generate"] = {"tok_s": _rate(hf_tokens, hf_wall), "tokens": hf_tokens, "wall_s": hf_wall,
                              "equal_to_ar_fraction": sum(h["equal_to_ar"] for h in hf) / len(hf)}
    return out


def _method_stats(records: list[dict[str, Any]], method: Method, block_size: int, ar: dict[str, Any],
                  greedy: bool) -> dict[str, Any]:
    lengths = [r["acceptance_lengths"] for r in records]
    acc = acceptance_stats(lengths, method.max_length(block_size))
    tokens = sum(r["n_tokens"] for r in records)
    wall = sum(r["wall_s"] for r in records)
    t = _timing_stats(records, acc["rounds"])
    prefill = t["timings_s"]["prefill"]
    t_round = _rate(sum(v for k, v in t["timings_s"].items() if k != "prefill"), acc["rounds"])
    tok_s, decode_tok_s = _rate(tokens, wall), _rate(tokens - len(records), wall - prefill)
    speedup = tok_s / ar["tok_s"] if tok_s and ar.get("tok_s") else None
    predicted = (acc["tau_micro"] * ar["t_step_s"] / t_round
                 if acc["tau_micro"] and ar.get("t_step_s") and t_round else None)
    divergences = [dict(r["divergence"], prompt_id=r["prompt_id"]) for r in records if r.get("divergence")]
    return {**acc, "n_prompts": len(records), "block_size": block_size, "tokens": tokens,
            "tokens_per_round": _rate(tokens, acc["rounds"]), "wall_s": wall, "tok_s": tok_s,
            "decode_tok_s": decode_tok_s, "speedup_vs_ar": speedup,
            "decode_speedup_vs_ar": decode_tok_s / ar["decode_tok_s"] if decode_tok_s and ar.get("decode_tok_s") else None,
            "round_s": t_round, "predicted_speedup": predicted,
            "efficiency": speedup / predicted if speedup and predicted else None, **t,
            "greedy_equal_fraction": (sum(bool(r["greedy_equal"]) for r in records) / len(records)
                                      if greedy and records else None),
            "divergences": divergences,
            "divergence_verdicts": {v: sum(d["verdict"] == v for d in divergences) for v in ("near_tie", "bug")}}


# ---------------------------------------------------------------------------------------------- evaluate
def evaluate(target: Target, drafters: dict[str, DFlashDrafter], prompts: Sequence[Prompt], *,
             methods: str | Sequence[str] = ("ar", "chain", "ddtree:8"), max_new_tokens: int = 128,
             sampling: SamplingParams = SamplingParams(), out_dir: str | Path, resume: bool = True,
             block_size: int | None = None, tree_top_k: int | None = None,
             stop_token_ids: Sequence[int] | None = None,
             dataset: str = "", skipped: dict[str, str] | None = None, triage_threshold: float | None = None,
             seed: int = 0, warmup: bool = True, hf_baseline: bool = False,
             drafter_sources: dict[str, str] | None = None, progress: bool = True,
             deadline: float | None = None) -> dict[str, Any]:
    """Run AR + every (drafter, method) on `prompts`; write progress.jsonl and results.json; return results.

    deadline: a `time.monotonic()` value; once it has passed, no further prompt is started (at least one is always
    evaluated) and the results cover the prompts done, in order — `dataset.time_boxed` then says how many of how
    many. A resumed run continues with the rest.
    """
    from tqdm import tqdm

    todo_methods = parse_methods(methods)
    spec = [m for m in todo_methods if m.kind != "ar"]
    prompts = list(prompts)
    _check_arguments(target, drafters, prompts, spec, sampling, max_new_tokens)
    stops = sorted({int(t) for t in (default_stop_token_ids(target) if stop_token_ids is None else stop_token_ids)})
    threshold = default_triage_threshold(target.dtype) if triage_threshold is None else float(triage_threshold)
    t_info = target_info(target)
    settings = {"methods": [m.name for m in todo_methods], "max_new_tokens": int(max_new_tokens),
                "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k},
                "block_size": block_size, "tree_top_k": int(tree_top_k) if tree_top_k else None,
                "stop_token_ids": stops,
                "seed": int(seed), "triage_threshold": threshold, "hf_baseline": bool(hf_baseline)}
    key = hashlib.sha256(json.dumps({"settings": settings, "target": t_info["fingerprint"],
                                     "drafters": {n: drafter_fingerprint(d) for n, d in sorted(drafters.items())}},
                                    sort_keys=True).encode()).hexdigest()[:16]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ppath = out / PROGRESS
    records = _resumed_records(ppath, key, prompts, resume)
    todo = [p for p in prompts if p.id not in records]
    for d in drafters.values():
        d.eval()

    def run(p: Prompt, drafter: DFlashDrafter | None, m: Method, n: int, s: int | None) -> tuple[Any, float]:
        return _run(target, p, drafter=drafter, method=m, max_new_tokens=n, sampling=sampling, block_size=block_size,
                    tree_top_k=tree_top_k, stops=stops, seed=s)

    if warmup and todo:  # first calls pay one-off allocation costs: keep them out of the timings
        run(todo[0], None, AR_METHOD, min(4, max_new_tokens), seed)
        for d in drafters.values():
            for m in spec:
                run(todo[0], d, m, min(4, max_new_tokens), seed)
    index = {p.id: i for i, p in enumerate(prompts)}
    bar = tqdm(todo, desc="evaluate", unit="prompt", disable=not progress or not todo)
    with open(ppath, "a", encoding="utf-8") as f:
        for p in bar:
            s = None if sampling.greedy else seed + index[p.id]
            rec = {"key": key, "id": p.id, "prompt_sha": prompt_sha(p.ids), "prompt_len": len(p.ids),
                   **_evaluate_prompt(target, p, drafters, spec, run, max_new_tokens, s, sampling.greedy, threshold,
                                      stops if hf_baseline else None)}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
            records[p.id] = rec
            if deadline is not None and time.monotonic() > deadline:
                break
    bar.close()
    doc = _results_doc(target, t_info, drafters, prompts, records, spec, settings, sampling, block_size, dataset,
                       skipped, drafter_sources)
    atomic_write_text(out / RESULTS, json.dumps(doc, indent=1) + "\n")
    return doc



def _check_arguments(target: Target, drafters: dict[str, DFlashDrafter], prompts: list[Prompt], spec: list[Method],
                     sampling: SamplingParams, max_new_tokens: int) -> None:
    if spec and not drafters:
        raise ConfigError(f"methods {[m.name for m in spec]} need at least one drafter")
    for name, d in drafters.items():
        check_drafter_fits(d.config, target, source=f"drafter {name!r}")
    if not sampling.greedy and any(m.kind == "tree" for m in spec):
        raise ConfigError("ddtree methods support greedy decoding only (temperature 0)")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens}: expected a positive integer")
    if not prompts:
        raise DataError("no prompts to evaluate")
    if len({p.id for p in prompts}) != len(prompts):
        raise DataError("prompt ids must be unique")


def _resumed_records(ppath: Path, key: str, prompts: list[Prompt], resume: bool) -> dict[str, dict[str, Any]]:
    """Prompt id → record of progress.jsonl from an earlier run with the same settings (`key`); refuses a file
    written with other settings or other prompt token ids. Without `resume` the file is removed first."""
    if not resume and ppath.exists():
        ppath.unlink()
    records = {}
    for k, rec in enumerate(read_progress(ppath, repair=True), start=1):
        if rec.get("key") != key:
            raise DataError(f"{ppath}:{k}: written by a run with other settings, target or drafters; use another "
                            f"output directory, delete the file, or disable resume")
        records[rec["id"]] = rec
    for p in prompts:
        done = records.get(p.id)
        if done is not None and done["prompt_sha"] != prompt_sha(p.ids):
            raise DataError(f"{ppath}: prompt {p.id!r} was evaluated with different token ids; use another output "
                            f"directory or disable resume")
    return records


def _evaluate_prompt(target: Target, p: Prompt, drafters: dict[str, DFlashDrafter], spec: list[Method], run: Any,
                     max_new_tokens: int, seed: int | None, greedy: bool, threshold: float,
                     hf_stops: list[int] | None) -> dict[str, Any]:
    """One prompt: AR once, HF generate when `hf_stops` is given, then every (drafter, method), each triaged
    against AR at temperature 0."""
    ar_res, ar_wall = run(p, None, AR_METHOD, max_new_tokens, seed)
    rec: dict[str, Any] = {"ar": _record(ar_res, ar_wall), "runs": {}}
    if hf_stops is not None:
        hf_tokens, hf_wall = _hf_generate(target, p, max_new_tokens, hf_stops)
        rec["hf"] = {"n_tokens": len(hf_tokens), "wall_s": hf_wall, "equal_to_ar": hf_tokens == ar_res.tokens}
    for name, d in drafters.items():
        rec["runs"][name] = {}
        for m in spec:
            res, wall = run(p, d, m, max_new_tokens, seed)
            r = _record(res, wall)
            if greedy:
                r["divergence"] = triage_divergence(target, p.ids, ar_res.tokens, res.tokens, threshold=threshold)
                r["greedy_equal"] = r["divergence"] is None
            rec["runs"][name][m.name] = r
    return rec


def _results_doc(target: Target, t_info: dict[str, Any], drafters: dict[str, DFlashDrafter], prompts: list[Prompt],
                 records: dict[str, dict[str, Any]], spec: list[Method], settings: dict[str, Any],
                 sampling: SamplingParams, block_size: int | None, dataset: str, skipped: dict[str, str] | None,
                 drafter_sources: dict[str, str] | None) -> dict[str, Any]:
    """results.json: AR and per-(drafter, method) statistics over the prompts done (all, unless time-boxed)."""
    requested = len(prompts)
    prompts = [p for p in prompts if p.id in records]      # all of them unless the deadline cut the run short
    chosen = [records[p.id] for p in prompts]
    ar_stats = _ar_stats([r["ar"] for r in chosen], [r["hf"] for r in chosen if "hf" in r])
    results: dict[str, dict[str, Any]] = {}
    for name, d in drafters.items():
        bs = block_size or d.config.block_size
        results[name] = {m.name: _method_stats([dict(r["runs"][name][m.name], prompt_id=r["id"]) for r in chosen],
                                               m, bs, ar_stats, sampling.greedy) for m in spec}
    notes = []
    if target.is_hybrid and any(m.kind == "tree" for m in spec):
        notes.append(f"hybrid target: DDTree verifies the whole tree exactly (Gated DeltaNet states followed per "
                     f"node, '{resolve_mode(target, 'auto')}' mode)")
    return {"schema": "dflashkit.eval/1", "kind": "evaluate", "target": t_info,
            "dataset": {"name": str(dataset), "n_prompts": len(prompts), "prompt_ids": [p.id for p in prompts],
                        "skipped": dict(skipped or {}),
                        **({"time_boxed": {"requested": requested, "evaluated": len(prompts)}}
                           if len(prompts) < requested else {})},
            "settings": settings,
            "drafters": {n: drafter_info(d, source=(drafter_sources or {}).get(n), block_size=block_size)
                         for n, d in drafters.items()},
            "ar": ar_stats, "results": results, "notes": notes}
