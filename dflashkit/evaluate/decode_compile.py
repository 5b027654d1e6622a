"""Whether an evaluation's decoding runs the target's decoder layers through `torch.compile` (`eval --compile
auto | on | off`), decided in the evaluation's warm-up by timing its own untimed runs on this machine (the rule:
`cpu_products.compile_choice`; the layers: `target.compiled_layers`).

    choice = start_choice(target, ["ar", "chain", "ddtree:8"], "auto", seconds_left, warm_up=True)
    choice.warm_up(run_round, eager_rate)   # run_round(compiled) → tokens: every method once, a few tokens each
    out = choice.run(lambda compiled: timed_generate(compiled))   # each timed run; a failing compile reruns eagerly

The trial's steps are warm-up rounds — every method of the evaluation for a few tokens, so every width it verifies
(1, a chain's block, a tree's 1 + B with its mask) is compiled and timed — never the timed prompts, so no prompt's
time holds a compile. Its work is the tokens a round generated (rates per 1,000 tokens); the work left is the
evaluation's planned tokens (prompts × methods × max_new_tokens) at that rate, capped by its deadline. `auto` tries
compiling only when that is at least ten times the compile time it risks, and keeps the compiled layers only when a
round is faster beyond the noise; a stored trial for this target, precision, device and methods decides at once by
the work left. The warm-up's own settled runs give the eager rate, so a short evaluation that never tries costs no
extra round. A choice that is `compiled` pays its compile in one untimed warm-up round before anything is timed.

Without a warm-up (`--no-warmup`) `auto` stays eager: there is nowhere to time a trial or pay a compile outside the
timed prompts. AR and the speculative methods run alike (the speedup compares like with like); an `hf_baseline` runs
transformers' own `generate`, never compiled. Where the products choice of a width is the C++ layers
(`native_layers`), that width's passes run those: the compiled layers serve the passes through transformers' layers.
`DFLASHKIT_DECODE_COMPILE=on|off` replaces the measurement under `auto`, `=measure` runs the trial whatever the
size; kept in `~/.cache/dflashkit/decode_compile/`, listed by `dflashkit info`. Greedy output is the target's either
way up to float rounding (a near-tie of two logits may resolve differently; AR and drafts share the same layers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, TypeVar

from dflashkit.cpu_products.compile_choice import (
    COMPILED,
    EAGER,
    CompileTrial,
    MeasuredCompile,
    device_name,
    target_key,
)
from dflashkit.errors import DFlashError
from dflashkit.target.compiled_layers import compiled_layers
from dflashkit.target.devices import synchronize

if TYPE_CHECKING:
    from dflashkit.target.model import Target

DECODE_COMPILE = MeasuredCompile("decode_compile", "DFLASHKIT_DECODE_COMPILE", unit="per 1k tokens")
ENV_VAR = DECODE_COMPILE.env_var
MAX_ROUNDS = 24  # a trial's rounds at most (1 compile + 1 untimed + its ABBA rounds; fewer when the rate is known)
T = TypeVar("T")


def compile_key(target: Target, methods: Sequence[str]) -> str:
    """What a compiled decoding step's speed depends on: the target's shape and precision, the device, and the widths
    the methods verify (named by the methods, budgets resolved)."""
    dtype = str(target.dtype).removeprefix("torch.")
    return f"{target_key(target)}:{dtype}:{device_name(target.device)}:{'+'.join(sorted(set(methods)))}"


class DecodeCompile:
    """The compile choice of one evaluation's decoding: its trial in the warm-up, then every timed run as it says."""

    def __init__(self, target: Target, trial: CompileTrial) -> None:
        self.target, self.trial = target, trial
        self.compiled_once = False  # a compiled round ran in this process: the graphs exist, no timed run compiles

    @property
    def compiled(self) -> bool:
        return self.trial.choice == COMPILED

    @property
    def message(self) -> str:
        return self.trial.message

    def as_dict(self) -> dict[str, Any]:
        """What results.json records: the choice and why."""
        return {"choice": self.trial.choice or EAGER, "why": self.trial.message}

    def warm_up(
        self,
        run_round: Callable[[bool], int],
        eager_rate_s: float | None,
        say: Callable[[str], None] = print,
    ) -> None:
        """Untimed rounds until the choice is settled (`run_round(compiled)` → tokens generated; `eager_rate_s`: eager
        seconds per 1,000 tokens already timed, or None to time eager rounds first); then, when it is compiled, one
        compiled round so the timed runs find every graph built."""
        trial = self.trial
        if eager_rate_s is not None and eager_rate_s > 0:
            trial.known_rate(eager_rate_s)
            if trial.settled:
                say(f"decode: torch.compile: {trial.message}")
        rounds = 0
        while not trial.settled and rounds < MAX_ROUNDS:
            self.run(lambda compiled: run_round(compiled), work=lambda tokens: tokens / 1000, say=say)
            rounds += 1
        if not trial.settled:  # cannot happen with the trial's fixed schedule; never leave a timed run undecided
            trial.settle(EAGER, "eager: the trial did not finish in the warm-up")
        if self.compiled and not self.compiled_once:
            self.run(lambda compiled: run_round(compiled), say=say)

    def run(
        self,
        step: Callable[[bool], T],
        *,
        work: Callable[[T], float] = lambda _out: 1.0,
        say: Callable[[str], None] = print,
    ) -> T:
        """One run as the choice says (`step(compiled)`), timed by the trial while it is open; a compiled run that
        raises runs again eagerly and the choice settles on eager (recorded, so later evaluations stay eager)."""

        def inside(compiled: bool) -> T:
            with compiled_layers(self.target) if compiled else nullcontext():
                out = step(compiled)
            self.compiled_once |= compiled
            return out

        return self.trial.run_step(
            inside,
            work=work,
            sync=lambda: synchronize(self.target.device),
            say=lambda msg: say(f"decode: torch.compile: {msg}"),
            keep=(DFlashError, ValueError),  # the caller's own errors (a prompt too long) are not the compile's
        )


def start_choice(
    target: Target,
    methods: Sequence[str],
    setting: str,
    seconds_left: Callable[[float], float],
    *,
    warm_up: bool = True,
) -> DecodeCompile:
    """The compile choice of one evaluation (`seconds_left(rate)`: its planned work at `rate` seconds per 1,000
    tokens; `warm_up` False: `auto` stays eager)."""
    if setting == "auto" and not warm_up and DECODE_COMPILE.forced() in (None, "measure"):
        trial = CompileTrial(compile_key(target, methods), seconds_left, store=DECODE_COMPILE, path=None)
        trial.settle(EAGER, "eager: no warm-up to time a trial or pay a compile in (--no-warmup)")
        return DecodeCompile(target, trial)
    return DecodeCompile(target, DECODE_COMPILE.start(compile_key(target, methods), setting, seconds_left))


__all__ = ["DECODE_COMPILE", "ENV_VAR", "MAX_ROUNDS", "DecodeCompile", "compile_key", "start_choice"]
