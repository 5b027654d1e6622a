"""The precision the target computes captured features in: its own (fp32 on a CPU, the reference) or bf16 autocast,
chosen by timing both at the capture's sample length on this machine.

    precision, timings = capture_precision(target, [len(s) for s in samples])   # "fp32" | "bf16", {precision: ms}
    out = capture_forward(target, ids, precision, layer_ids=ids_of_layers, logits=True)  # (B, T, K·H), (B, T, V)

`auto` on a float32 CPU target times a forward of each (`time_target_forward`: a warm-up, then the best of two) at
the samples' median length rounded up to a power of two, and takes bf16 autocast only when `BF16_GATE` faster
(`cpu_products.choice`: kept per machine and key in `<cache>/capture_precision/`, timed again after the choices'
age limit, `DFLASHKIT_CHOICES=capture_precision=fp32|bf16` replaces the measurement, `dflashkit info` lists the
stored choices); on a GPU `auto` is bf16 autocast, untimed, as training's. A target loaded in bf16 or fp16 computes
in its own dtype, recorded as "bf16-weights" / "fp16-weights" (not autocast: its residual stream is half too); asking
it for fp32 is a ConfigError. Under bf16 autocast the target's products run in bf16 and its residual stream stays
fp32; the verifier logits, hence the labels, are formed afterwards in fp32 from it. On SmolLM2 and the quickstart's
samples the captured layers then differ from the fp32 target's by 0.2–0.6 % (relative norm; the bf16 storage itself
rounds by 0.04–0.2 %) and the labels agree on 98.8 % of positions (docs/results.md, "Xeon capture precision", has τ
of drafters trained on either). The manifest records the precision, and a resumed capture keeps it, so one capture
never mixes two.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dflashkit.cpu_products import mode as products_mode
from dflashkit.cpu_products import stock_products
from dflashkit.cpu_products.choice import BF16_GATE, PRECISIONS, Choice
from dflashkit.errors import ConfigError

if TYPE_CHECKING:
    from dflashkit.target.model import Target, TargetOutput

CAPTURE = Choice("capture_precision", PRECISIONS, default="fp32", gate=BF16_GATE)
CHOICES = ("auto", *PRECISIONS)
# a target loaded in a half type computes in it: recorded apart from bf16 autocast (whose residual stream and labels
# stay fp32), so a capture begun one way is never resumed the other
WEIGHTS = {torch.bfloat16: "bf16-weights", torch.float16: "fp16-weights"}
MIN_TOKENS, MAX_TOKENS = 64, 2048  # the timed length's range: short enough to time in seconds


def timed_length(lengths: Sequence[int]) -> int:
    """The sequence length the choice is timed at: the median sample length rounded up to a power of two, kept
    within [MIN_TOKENS, MAX_TOKENS] (a longer capture is timed at MAX_TOKENS: bf16's lead grows with length)."""
    if not lengths:
        return MIN_TOKENS
    median = sorted(lengths)[len(lengths) // 2]
    n = 1 << max(0, int(median) - 1).bit_length()
    return max(MIN_TOKENS, min(MAX_TOKENS, n))


def choice_key(target: Target, tokens: int) -> str:
    """What a capture forward's speed depends on: the target's shape and the sequence length (on this CPU)."""
    return f"{target.architecture}:l{target.num_layers}:h{target.hidden_size}:v{target.vocab_size}:t{tokens}"


def as_loaded(target: Target) -> str:
    """The precision of a forward of the target as it is loaded, with no autocast (what every capture did before the
    manifest recorded it)."""
    return WEIGHTS.get(target.dtype, "fp32")


def _bf16_body(target: Target, precision: str) -> bool:
    """Whether a capture forward runs the target's layers under bf16 autocast: a float32 target asked for bf16."""
    return precision == "bf16" and target.dtype == torch.float32


def capture_forward(
    target: Target,
    ids: Tensor,
    precision: str,
    *,
    layer_ids: Sequence[int],
    logits: bool,
    feature_dtype: torch.dtype | None = None,
) -> TargetOutput:
    """One capture forward of ids (B, T) in `precision`. Under bf16 autocast only the decoder layers run in bf16: the
    verifier logits (B, T, V) are formed afterwards in float32 from the fp32 residual stream, so the labels' argmax
    and the top-k log-probs do not round at bf16, where close logits would tie."""
    if not _bf16_body(target, precision):
        return target.forward(ids, layer_ids=list(layer_ids), logits=logits, feature_dtype=feature_dtype)
    with torch.autocast(device_type=target.device.type, dtype=torch.bfloat16):
        out = target.forward(ids, layer_ids=list(layer_ids), logits=False, feature_dtype=feature_dtype)
    if logits:  # a one-off pass over whole sequences: the products Target.forward takes for one (stock, unless forced)
        with torch.no_grad(), stock_products() if products_mode() == "auto" else nullcontext():
            out = replace(out, logits=target.verifier_logits(out.final_hidden.float()))  # (B, T, V) float32
    return out


def time_target_forward(target: Target, tokens: int, bf16: bool, *, rounds: int = 2) -> float:
    """Seconds of one target forward over `tokens` tokens (features and logits, as capture runs it) in fp32 or bf16
    autocast: one warm-up pass, then the best of `rounds`."""
    ids = torch.randint(0, target.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    layers = list(range(target.num_layers))[-1:]
    best = float("inf")
    with torch.inference_mode():
        for i in range(rounds + 1):
            _sync(target)
            t0 = time.perf_counter()
            capture_forward(target, ids, "bf16" if bf16 else "fp32", layer_ids=layers, logits=True)
            _sync(target)
            if i:
                best = min(best, time.perf_counter() - t0)
    return best


def _sync(target: Target) -> None:
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)


def capture_precision(
    target: Target,
    lengths: Sequence[int],
    requested: str = "auto",
    *,
    timer: Callable[[Target, int, bool], float] | None = None,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    use_store: bool = True,
) -> tuple[str, dict[str, float]]:
    """(the precision a capture of sequences of `lengths` tokens computes in, {precision: ms per forward} when timed
    now). `requested` is "auto", "fp32" or "bf16"; `timer(target, tokens, bf16)` → seconds (default
    `time_target_forward`); `all_reduce` sums the timings of a multi-rank capture's ranks, so they all compute alike."""
    own = WEIGHTS.get(target.dtype)
    if own is not None:  # a target loaded in a half type computes in it
        if requested not in ("auto", own, own.split("-")[0]):
            raise ConfigError(
                f"capture precision {requested}: the target is loaded in {own.split('-')[0]} and computes in it; load "
                f"it in float32 to capture in {requested}"
            )
        return own, {}
    if requested in WEIGHTS.values():  # a resumed capture begun with the target loaded in a half type
        raise ConfigError(
            f"capture precision {requested}: this capture was begun with the target loaded in "
            f"{requested.split('-')[0]}; load it that way to resume it (it is loaded in float32 now)"
        )
    if requested not in CHOICES:
        raise ConfigError(f"capture precision {requested!r}: expected one of {', '.join(CHOICES)}")
    if requested != "auto":
        return requested, {}
    if target.device.type != "cpu":  # a GPU computes bf16 natively: no timing (as training's dtype: auto)
        return CAPTURE.override() or "bf16", {}
    tokens = timed_length(lengths)
    timer = timer or time_target_forward
    return CAPTURE.measure(
        choice_key(target, tokens),
        PRECISIONS,
        lambda p: timer(target, tokens, p == "bf16"),
        all_reduce=all_reduce,
        store=CAPTURE.store() if use_store else None,
    )


__all__ = [
    "CAPTURE",
    "CHOICES",
    "as_loaded",
    "capture_forward",
    "capture_precision",
    "choice_key",
    "time_target_forward",
    "timed_length",
]
