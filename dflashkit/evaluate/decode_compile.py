"""Whether an evaluation's decoding runs the target's decoder layers through `torch.compile` (`eval --compile
auto | on | off`), decided in the evaluation's warm-up by timing its own untimed runs on this machine (the rule:
`cpu_products.compile_choice`; the layers: `target.compiled_layers`).

    choice = start_choice(target, ["ar", "chain:16", "ddtree:8"], "auto", seconds_left, warm_up=True)
    choice.warm_up(run_round, eager_rate)   # run_round(compiled) → tokens: every method once, a few tokens each
    out = choice.run(lambda compiled: timed_generate(compiled))   # each timed run; a failing compile reruns eagerly

The trial's steps are warm-up rounds — every method of the evaluation for a few tokens, so the widths it verifies
(1, a chain's block, a tree's 1 + B with its mask) are compiled and timed — never the timed prompts. The compiled
layers' graphs have dynamic lengths and their products are `F.linear` (target.compiled_layers), so a width first met
in a timed prompt (a chain's shorter last block, a tree cut short) reuses them. Its work is the tokens a round
generated (rates per 1,000 tokens); the work left is the evaluation's planned tokens (prompts × methods ×
max_new_tokens: an upper bound, runs may stop early) at that rate, capped by its deadline. `auto` tries compiling
only when that is at least ten times the compile time it risks, and keeps the compiled layers only when a round is
faster beyond the noise; a stored trial for this target, precision, device and methods (budgets and verify widths
resolved) decides at once by the work left — its compile time counted as paid when this process compiled them
already (a second temperature). Where products are measured (CPU) the warm-up's own settled runs give the eager
rate, so a short evaluation that never tries costs no extra round; elsewhere one eager round is timed for it.

A choice that is `compiled` pays its compile in one untimed round before the first timed prompt, with or without a
warm-up (`--no-warmup` only leaves `auto` eager: there is no warm-up to time a trial in). Compiled is a whole pass
through torch.compile: the target's layers with inductor's own products, never the C++ layers (`native_layers`),
which are one candidate of eager decoding's measured products — the trial compares the two ways whole. AR and the
speculative methods run alike (the speedup compares like with like); an `hf_baseline` runs transformers' own
`generate`, never compiled. A compiled run that fails (dynamo, inductor, the recompile limit) settles the choice on
eager and the evaluation runs that prompt again eagerly: each progress record says whether its prompt ran compiled,
and results.json counts them (`decode_compile.prompts_compiled`), so a resumed or interrupted evaluation says so.
`DFLASHKIT_CHOICES=decode_compile=on|off` replaces the measurement under `auto`, `=measure` runs the trial whatever
the size; kept in `~/.cache/dflashkit/decode_compile/`, listed by `dflashkit info`. Greedy output is the target's either
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

DECODE_COMPILE = MeasuredCompile("decode_compile", unit="per 1k tokens")
MAX_ROUNDS = 24  # a cap on a trial's warm-up rounds (its schedule takes at most 12: 4 eager, the compile, 1 + 6)
T = TypeVar("T")


def compile_key(target: Target, methods: Sequence[str]) -> str:
    """What a compiled decoding step's speed depends on: the target's shape and precision, the device, and the widths
    the runs verify (`methods`: "ar", "chain:<verify width>", "ddtree:<budget>")."""
    dtype = str(target.dtype).removeprefix("torch.")
    return f"{target_key(target)}:{dtype}:{device_name(target.device)}:{'+'.join(sorted(set(methods)))}"


class DecodeCompile:
    """The compile choice of one evaluation's decoding: its trial in the warm-up, then every timed run as it says."""

    def __init__(self, target: Target, trial: CompileTrial, key: str) -> None:
        self.target, self.trial, self.key = target, trial, key
        self.compiled_once = False  # a compiled round ran in this process: the graphs exist, no timed run compiles

    @property
    def compiled(self) -> bool:
        return self.trial.choice == COMPILED

    def as_dict(self, prompts_compiled: int | None = None) -> dict[str, Any]:
        """What results.json records: the choice, why, and how many of the reported prompts ran compiled."""
        out = {"choice": self.trial.choice or EAGER, "why": self.trial.message}
        return out if prompts_compiled is None else {**out, "prompts_compiled": prompts_compiled}

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
            self.run(run_round, work=lambda tokens: tokens / 1000, say=say)
            rounds += 1
        if not trial.settled:  # cannot happen with the trial's fixed schedule; never leave a timed run undecided
            trial.settle(EAGER, "eager: the trial did not finish in the warm-up")
        self.pay_compile(run_round, say)

    def pay_compile(self, run_round: Callable[[bool], int], say: Callable[[str], None] = print) -> None:
        """When the choice is compiled and nothing was compiled yet: one untimed compiled round."""
        if self.compiled and not self.compiled_once:
            self.run(run_round, say=say)

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
            if compiled:
                self.compiled_once = True
                _compiled_keys(self.target).add(self.key)
            return out

        return self.trial.run_step(
            inside,
            work=work,
            sync=lambda: synchronize(self.target.device),
            say=lambda msg: say(f"decode: torch.compile: {msg}"),
            keep=(DFlashError,),  # the caller's own errors (a prompt too long) are not the compile's
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
    key = compile_key(target, methods)
    if setting == "auto" and not warm_up and DECODE_COMPILE.forced() in (None, "measure"):
        trial = CompileTrial(key, seconds_left, store=DECODE_COMPILE, path=None)
        trial.settle(EAGER, "eager: no warm-up to time a trial in (--no-warmup)")
        return DecodeCompile(target, trial, key)
    sunk = key in _compiled_keys(target)
    return DecodeCompile(target, DECODE_COMPILE.start(key, setting, seconds_left, sunk=sunk), key)


def _compiled_keys(target: Target) -> set[str]:
    """The keys whose decoding this process has run compiled (their graphs exist: a later evaluation pays nothing)."""
    keys = getattr(target, "_decode_compiled_keys", None)
    if keys is None:
        keys = target._decode_compiled_keys = set()
    return keys


__all__ = ["DECODE_COMPILE", "MAX_ROUNDS", "DecodeCompile", "compile_key", "start_choice"]
