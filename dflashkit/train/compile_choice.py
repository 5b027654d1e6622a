"""Whether a training run's step runs through `torch.compile` (`compile: auto | on | off`), decided by timing it in
the run's own first steps on this machine (the rule: `cpu_products.compile_choice`).

    key = compile_key(drafter_cfg, shape, precision="bf16", device=device, wrap="plain")
    trial = start_trial(cfg.compile, key, remaining_s=f)
    trial.current       # "eager" | "compiled": what the next step's forward runs (Run.step_module)
    trial.finished(s)   # after each step (seconds agreed over ranks)

`auto` compiles only where the measurement says it pays: a stored trial for this geometry whose compiled step was
faster and whose compile time this run's remaining work repays, or — none stored — a trial inside the first steps
when the run is long enough to risk it (ten times the compile time recorded on this machine, five minutes assumed
where none is). `DFLASHKIT_CHOICES=train_compile=on|off` replaces the measurement under `auto`, `=measure` runs the
trial whatever the run's length; `compile: on | off` in the config always wins. The entries live in
`~/.cache/dflashkit/train_compile/<machine>.json` (the choices' age limit); `dflashkit info` lists them. A
validation pass (no gradient) always runs eager: compiling its inference graph would cost a second compile for a
pass of seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflashkit.cpu_products.compile_choice import CompileTrial, MeasuredCompile, device_name
from dflashkit.drafter.config import DrafterConfig
from dflashkit.train.memory import StepShape
from dflashkit.train.precision_choice import geometry_key

TRAIN_COMPILE = MeasuredCompile("train_compile")


def setting(value: Any) -> str:
    """The config's `compile` as auto | on | off (true / false, which YAML also reads `on` / `off` as, are on / off)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def compile_key(cfg: DrafterConfig, shape: StepShape, *, precision: str, device: torch.device, wrap: str) -> str:
    """The step's geometry (as the precision choice keys it), its precision, device and `wrap` (plain, ddp×N or
    fsdp×N, then the micro-batches a step and what else it computes: `ga2:online:kl`): what a compiled step's speed
    depends on."""
    return f"{geometry_key(cfg, shape)}:{precision}:{device_name(device)}:{wrap}"


def start_trial(
    value: Any,
    key: str,
    remaining_s: Callable[[float], float],
    *,
    distributed: bool = False,
    write: bool = True,
    path: Path | None = None,
) -> CompileTrial:
    """The compile choice of a run whose config says `value` (auto | on | off | true | false) for the step `key`
    (`compile_key`)."""
    return TRAIN_COMPILE.start(key, setting(value), remaining_s, distributed=distributed, write=write, path=path)


__all__ = ["TRAIN_COMPILE", "compile_key", "setting", "start_trial"]
