"""Divergence triage: where a speculative output first departs from the greedy reference, and why.

    triage_divergence(target, prompt_ids, ar_tokens, spec_tokens)
    # → None when equal, else {"index", "ar_token", "spec_token", "margin", "top2", "threshold", "verdict"}

The target's logits are recomputed on the shared prefix; a top-2 margin below the threshold with both tokens in
the top 2 is a numerical **near_tie** (a floating-point coin flip between batch shapes), anything else a **bug**.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dflashkit.target.model import Target


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


def triage_divergence(
    target: Target,
    prompt_ids: Sequence[int],
    reference: Sequence[int],
    other: Sequence[int],
    *,
    threshold: float | None = None,
) -> dict[str, Any] | None:
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
    return {
        "index": i,
        "ar_token": ref_tok,
        "spec_token": oth_tok,
        "margin": margin,
        "top2": top2,
        "threshold": threshold,
        "verdict": "near_tie" if near else "bug",
    }


__all__ = ["default_triage_threshold", "first_divergence", "logit_margin", "triage_divergence"]
