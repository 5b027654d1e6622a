"""Learning-rate schedules: linear warmup then cosine decay, by optimizer step or by fraction of training time.

LambdaLR(optimizer, cosine_with_warmup(total_steps=1000, warmup_steps=40))   # step-based
group["lr"] = base_lr * cosine_at(elapsed / schedule_s, warmup=0.04)         # time-based (schedule_minutes)
"""

from __future__ import annotations

import math
from collections.abc import Callable


def cosine_at(progress: float, warmup: float, min_ratio: float = 0.0) -> float:
    """LR multiplier at `progress` ∈ [0, 1] of a run: linear warmup over the first `warmup` fraction (from 1 % of
    the peak), then cosine down to `min_ratio` at progress 1. For time-based schedules (`schedule_minutes`)."""
    if progress < warmup:
        return max(progress, 0.01 * warmup) / warmup
    return _cosine_decay((progress - warmup) / max(1e-9, 1 - warmup), min_ratio)


def _cosine_decay(progress: float, min_ratio: float) -> float:
    """1 at progress 0 down to `min_ratio` at progress ≥ 1, along half a cosine."""
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def cosine_with_warmup(total_steps: int, warmup_steps: int, min_ratio: float = 0.0) -> Callable[[int], float]:
    """LR multiplier for LambdaLR: linear warmup to 1 over `warmup_steps`, then cosine down to `min_ratio`."""

    def fn(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        return _cosine_decay((s - warmup_steps) / max(1, total_steps - warmup_steps), min_ratio)

    return fn


__all__ = ["cosine_at", "cosine_with_warmup"]
