"""What this machine does per second, measured when the quickstart starts (about a minute) — the yardstick for its
choices and notes instead of constants from one CPU.

    rates = measure_rates(target, prompts, batches=(8, 16, 32), layer_ids=[1, 8, 14, 20, 27])
    # {"regen_tokens_per_s": {"8": 41.0, "16": 52.3, "32": 55.1}, "regen_batch": 16, "capture_tokens_per_s": 880, …}

- regeneration: decoding tokens per second of batched greedy generation at each candidate batch size — the time
  of CALIBRATION_TOKENS more new tokens, prefill excluded (two runs on the same short prompts, the difference);
  a prefill of many long prompts would otherwise be most of the timing (and the rate read a small fraction of what
  regeneration then runs at). The quickstart keeps its batch size unless another one is faster by more than
  `BATCH_GAIN` (batch size matters on some CPUs and not on others);
- capture: tokens per second of one target forward with feature capture, which sizes how much original text the
  quickstart adds (its capture must fit `ORIGINAL_CAPTURE_MINUTES`);
- the notes on the last screen compare what a stage got over its whole budget with its own start (regeneration's
  first chunk, training's first steps), so a machine that got busier during the run is named, whatever CPU it is.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

BATCH_GAIN = 0.10  # another regeneration batch size must be this much faster to replace the default
ORIGINAL_CAPTURE_MINUTES = 3.7  # the capture minutes the original-text data may cost (docs/studies.md, "Data levers")
SHORTFALL = 0.6  # a stage below this fraction of its measured rate gets a note
CALIBRATION_TOKENS = 8  # decoding steps timed per batch size (on top of 2 that carry the prefill)
CALIBRATION_PROMPT = 48  # tokens of each calibration prompt (its last ones): the prefill stays small


def _regen_rate(target: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """New tokens per second of one greedy `generate` over `prompts` (left-padded), exactly `new_tokens` each."""
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    pad = getattr(target.tokenizer, "pad_token_id", None) or 0
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # (B, T)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    cfg = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad, eos_token_id=None
    )
    t0 = time.perf_counter()
    with torch.no_grad():
        target.model.generate(
            input_ids=ids.to(target.device), attention_mask=mask.to(target.device), generation_config=cfg
        )
    return len(prompts) * new_tokens / (time.perf_counter() - t0)


def _decode_rate(target: Any, prompts: list[list[int]]) -> float:
    """Decoding tokens per second at batch len(prompts), prefill excluded: B·CALIBRATION_TOKENS over the extra time
    of 2 + CALIBRATION_TOKENS new tokens against 2 (the best of two each)."""
    n = len(prompts)
    base = min(n * 2 / _regen_rate(target, prompts, 2) for _ in range(2))  # seconds
    full = min(n * (2 + CALIBRATION_TOKENS) / _regen_rate(target, prompts, 2 + CALIBRATION_TOKENS) for _ in range(2))
    extra = full - base
    return n * CALIBRATION_TOKENS / extra if extra > 0 else n * (2 + CALIBRATION_TOKENS) / full


def _capture_rate(target: Any, layer_ids: list[int], tokens: int = 384, target_lse: bool = False) -> float:
    """Tokens per second of a target forward with feature capture (the best of two), in the precision a capture of
    samples of about `tokens` tokens takes on this machine (`features.capture_precision`, chosen for the median
    length rounded up: the quickstart's replies are of this order); with `target_lse` also the log-sum-exp pass
    capture makes for a DSpark drafter (`dflashkit.features.capture`: one more LM-head pass)."""
    from dflashkit.features.capture_precision import capture_forward, capture_precision
    from dflashkit.target.logsumexp import row_logsumexp

    precision, _ = capture_precision(target, [tokens])
    ids = torch.randint(10, target.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        out = capture_forward(target, ids, precision, layer_ids=layer_ids, logits=True)
        if target_lse:
            row_logsumexp(target, out.final_hidden[0].to(torch.bfloat16).float())
        best = min(best, time.perf_counter() - t0)
    return tokens / best


def measure_rates(
    target: Any,
    prompts: list[list[int]],
    *,
    batches: tuple[int, ...],
    default_batch: int,
    layer_ids: list[int],
    target_lse: bool = False,
) -> dict[str, Any]:
    """The start-of-run measurements (see the module docstring). `prompts` must hold ≥ max(batches) prompts;
    `target_lse`: the capture stores the target's log-sum-exp too (DSpark), so its rate includes that pass."""
    t0 = time.perf_counter()
    short = [list(p)[-CALIBRATION_PROMPT:] for p in prompts]
    for b in batches:  # warm-up: first calls at a batch size pay allocations and time its product choice
        _regen_rate(target, short[:b], 2)
    rates = {str(b): round(_decode_rate(target, short[:b]), 2) for b in batches}
    best = max(batches, key=lambda b: rates[str(b)])
    chosen = best if rates[str(best)] > (1 + BATCH_GAIN) * rates[str(default_batch)] else default_batch
    return {
        "regen_tokens_per_s": rates,
        "regen_batch": chosen,
        "capture_tokens_per_s": round(_capture_rate(target, layer_ids, target_lse=target_lse), 1),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def original_token_budget(rates: dict[str, Any]) -> int:
    """Tokens of original-text conversations whose capture fits ORIGINAL_CAPTURE_MINUTES on this machine."""
    return int(rates["capture_tokens_per_s"] * 60 * ORIGINAL_CAPTURE_MINUTES)


def first_steps_rate(step_times: list[float], skip: int = 5, window: int = 20) -> float | None:
    """Steps per minute over the first `window` training steps after `skip` warm-up steps (None: too few)."""
    head = step_times[skip : skip + window]
    return 60 / statistics.median(head) if len(head) >= 5 else None


def shortfall_notes(state: dict[str, Any]) -> list[str]:
    """Lines for the stages that got much less than this machine gave them when measured (it got busier)."""
    d = state["done"]
    notes = []
    prep = d.get("prepare", {})
    want, got = prep.get("regen_first_chunk_tokens_per_s"), prep.get("regen_tokens_per_s")
    if want and got is not None and got < SHORTFALL * want:
        notes.append(
            f"regeneration ran at {got:.0f} tok/s; its first batches ran at {want:.0f} tok/s (the machine got "
            f"busier: less data, lower τ)"
        )
    train = d.get("train", {})
    first, overall = train.get("first_steps_per_min"), train.get("steps_per_min")
    if first and overall is not None and overall < SHORTFALL * first:
        notes.append(
            f"training ran at {overall:.0f} steps/min; its first steps ran at {first:.0f} (the machine got busier: "
            f"fewer steps, lower τ; --train-minutes buys more)"
        )
    for dataset, where in d.get("eval", {}).items():
        if where.get("prompts", 0) < where.get("requested", 0):
            notes.append(
                f"evaluation of {dataset} finished {where['prompts']} of {where['requested']} prompts "
                f"within its time box (--eval-minutes; wider confidence intervals)"
            )
    return notes


def step_rates(metrics_file: Path) -> dict[str, float]:
    """Steps per minute over the whole training stage and over its first steps (the shortfall note compares them)."""
    from dflashkit.train.metrics import read_metrics

    times = [r["step_s"] for r in read_metrics(metrics_file) if r.get("split") == "train" and "step_s" in r]
    first = first_steps_rate(times)
    if not times or first is None:
        return {}
    return {"steps_per_min": round(60 * len(times) / sum(times), 1), "first_steps_per_min": round(first, 1)}


def step_seconds(metrics_file: Path) -> float:
    """Median seconds per optimizer step of a training run's metrics.jsonl (0.0 when none was logged)."""
    from dflashkit.train.metrics import read_metrics

    times = [r["step_s"] for r in read_metrics(metrics_file) if r.get("split") == "train" and "step_s" in r]
    return statistics.median(times) if times else 0.0


__all__ = [
    "first_steps_rate",
    "measure_rates",
    "original_token_budget",
    "shortfall_notes",
    "step_rates",
    "step_seconds",
]
