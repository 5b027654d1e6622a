"""Whether a capture's target forwards run through compiled decoder layers (`--compile auto | on | off`), decided by
timing its own first batches on this machine (the rule: `cpu_products.compile_choice`).

    forwards = CaptureForwards.start(target, "fp32", "auto", tokens_left=1_200_000, log=print)
    out = forwards(ids, layer_ids=ids_of_layers, logits=True, feature_dtype=torch.bfloat16)  # as capture_forward

Each batch runs eagerly or inside `target.compiled_layers.compiled_layers` as the choice says; while the choice is
timed, each batch's seconds per 1,000 tokens feed the trial (batches vary in length, so rates are compared). `auto`
tries compiling only when the capture has enough tokens left to repay ten times the compile time it risks, and keeps
it only when faster beyond the noise; a stored trial for this target, precision and device decides at once by the
tokens left. `DFLASHKIT_CHOICES=capture_compile=on|off` replaces the measurement under `auto`, `=measure` runs the
trial whatever the capture's size; the choice is kept in `~/.cache/dflashkit/capture_compile/`, listed by
`dflashkit info`. A compiled forward that raises is run again eagerly and recorded unusable. Compiled layers compute
the same function as transformers' up to float rounding (the features and labels differ by rounding, as between two
BLAS paths).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from tqdm import tqdm

from dflashkit.cpu_products.compile_choice import CompileTrial, MeasuredCompile, device_name, target_key
from dflashkit.errors import DFlashError
from dflashkit.features.capture_precision import capture_forward
from dflashkit.target.compiled_layers import compiled_layers

if TYPE_CHECKING:
    from dflashkit.target.model import Target, TargetOutput

CAPTURE_COMPILE = MeasuredCompile("capture_compile", unit="per 1k tokens")


def compile_key(target: Target, precision: str) -> str:
    """What a compiled capture forward's speed depends on: the target's shape, the precision, the device."""
    return f"{target_key(target)}:{precision}:{device_name(target.device)}"


class CaptureForwards:
    """A capture's forwards (`capture_forward`), eager or through compiled layers, timed while the choice is open."""

    def __init__(self, target: Target, precision: str, tokens_left: int, log: Callable[[str], None]) -> None:
        self.target, self.precision, self.tokens_left, self.log = target, precision, tokens_left, log
        self.trial: CompileTrial

    @classmethod
    def start(
        cls,
        target: Target,
        precision: str,
        setting: str,
        *,
        tokens_left: int,
        log: Callable[[str], None],
        distributed: bool = False,
        write: bool = True,
    ) -> CaptureForwards:
        """The forwards of a capture with `tokens_left` tokens to compute, the compile choice under `setting`; the
        ranks of a distributed capture each time their own (no collective in a capture), one (`write`) stores."""
        forwards = cls(target, precision, tokens_left, log)
        key = compile_key(target, precision)
        forwards.trial = CAPTURE_COMPILE.start(
            key, setting, forwards.seconds_left, distributed=distributed, write=write
        )
        if forwards.trial.settled and setting == "auto":
            log(f"capture: torch.compile: {forwards.trial.message}")
        return forwards

    def seconds_left(self, rate: float) -> float:
        """The capture's work left at `rate` seconds per 1,000 tokens."""
        return self.tokens_left / 1000 * rate

    def __call__(
        self, ids: Tensor, *, layer_ids: Sequence[int], logits: bool, feature_dtype: torch.dtype | None
    ) -> TargetOutput:
        """One capture forward of ids (B, T), as the compile choice says (timed for it while it is open)."""
        self.tokens_left -= ids.numel()
        return self.trial.run_step(
            lambda compiled: self._forward(ids, layer_ids, logits, feature_dtype, compiled),
            work=lambda _out: ids.numel() / 1000,
            sync=lambda: _sync(self.target),
            say=self._say,
            keep=(DFlashError,),
        )

    def _say(self, message: str) -> None:
        with tqdm.external_write_mode():  # a line of its own, not into the progress bar
            self.log(f"capture: torch.compile: {message}")

    def _forward(
        self,
        ids: Tensor,
        layer_ids: Sequence[int],
        logits: bool,
        feature_dtype: torch.dtype | None,
        compiled: bool,
    ) -> TargetOutput:
        with compiled_layers(self.target) if compiled else nullcontext():
            return capture_forward(
                self.target, ids, self.precision, layer_ids=layer_ids, logits=logits, feature_dtype=feature_dtype
            )


def _sync(target: Target) -> None:
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)


__all__ = ["CAPTURE_COMPILE", "CaptureForwards", "compile_key"]
