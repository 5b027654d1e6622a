"""Whether in-process regeneration's `generate` batches run the target's decoder layers through `torch.compile`
(`prepare --compile auto | on | off`), decided by timing its own first batches on this machine (the rule:
`cpu_products.compile_choice`; the layers: `target.compiled_layers`).

    trial = start_trial(target, "auto", batch_size=16, seconds_left=lambda rate: …)   # rate: s per 1k new tokens
    replies = trial.run_step(lambda compiled: generate_in(target, compiled), work=new_tokens_in_thousands)

A batch's work is the tokens it generated (batches differ in length, so rates per 1,000 new tokens are compared).
`auto` tries compiling only when the regeneration has enough work left to repay ten times the compile time it risks,
and keeps it only when faster beyond the noise; a stored trial for this target, batch size and device decides at
once by the work left. Decoding steps grow the cache a token at a time, and the cache and the measured products
break a compiled layer's graph, so on the CPUs measured it is slower (docs/studies.md); the trial finds out where it
is not. `DFLASHKIT_CHOICES=regenerate_compile=on|off` replaces the measurement under `auto`, `=measure` runs the
trial whatever the size; kept in `~/.cache/dflashkit/regenerate_compile/`, listed by `dflashkit info`. Greedy
replies are the target's either way up to float rounding (a near-tie of two logits may resolve differently).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from dflashkit.cpu_products.compile_choice import CompileTrial, MeasuredCompile, device_name, target_key

if TYPE_CHECKING:
    from dflashkit.target.model import Target

REGENERATE_COMPILE = MeasuredCompile("regenerate_compile", unit="per 1k new tokens")


def compile_key(target: Target, batch_size: int) -> str:
    """What a compiled regeneration batch's speed depends on: the target's shape, the batch size, the device."""
    return f"{target_key(target)}:b{batch_size}:{device_name(target.device)}"


def start_trial(
    target: Target, setting: str, *, batch_size: int, seconds_left: Callable[[float], float]
) -> CompileTrial:
    """The compile choice of one in-process regeneration (`seconds_left(rate)`: its work left at `rate` seconds per
    1,000 new tokens)."""
    return REGENERATE_COMPILE.start(compile_key(target, batch_size), setting, seconds_left)


__all__ = ["REGENERATE_COMPILE", "compile_key", "start_trial"]
