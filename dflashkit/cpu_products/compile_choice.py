"""Whether a repeated step (a training step) runs through `torch.compile`, decided by timing it inside the run's
own first steps and kept in the user cache: the rule behind training's `compile: auto`.

    TRAIN_COMPILE = MeasuredCompile("train_compile")     # its DFLASHKIT_CHOICES entry and store (cpu_products.choice)
    trial = TRAIN_COMPILE.start(key, "auto", remaining_s)   # remaining_s(seconds a unit) → seconds of work left
    trial.current                # "eager" or "compiled": what the next step runs
    trial.finished(seconds, work)  # after every step: its seconds (agreed over ranks) and its work in the run's
                                 # units (1 a training step; tokens a capture batch): the trial advances
    trial.known_rate(rate)       # the eager rate timed elsewhere (an evaluation's warm-up): straight to the gate
    trial.failed(reason)         # the compiled step raised: eager for good, recorded unusable
    out = trial.run_step(step, work=…)   # all of it around one step: step(compiled) run, timed, failures rerun
    trial.settled, trial.choice, trial.message

Compiling costs once — minutes for a drafter's training step on a 2-core CPU, tens of seconds on a GPU — and then
saves a fraction of every step, or nothing: compiled code is not faster on every device and shape, and a CPU run of
minutes never earns minutes of compiling back. So nothing is assumed; the choice is measured where it runs:

1. `on` / `off` (the config, or the kind's entry in `DFLASHKIT_CHOICES`, e.g. `train_compile=off`, which replaces
   the measurement under `auto`) is taken as it is; `measure` runs the trial below whatever the run's length.
2. A stored entry for the key (the step's geometry, precision and device, on this machine, measured within the
   choices' age limit) decides without compiling to find out: compiled when its trial found the compiled step
   faster *and* the time this run will save — the work left × (1 − compiled ÷ eager) — exceeds its compile time.
   An entry that recorded the compiled step unusable keeps it eager.
3. Without one: the first steps run eager and are timed; the trial compiles only when the run's work left is at
   least `TRIAL_FACTOR` × the compile time it risks (the longest recorded on this machine, `UNKNOWN_COMPILE_S` when
   none is) — a short run is never made longer by a trial that cannot pay. Then the first compiled step (its excess
   over an eager step is the compile time), one untimed compiled step, and `ROUNDS` ABBA rounds of compiled and
   eager steps, paired by round as the product choices are (`step_trial.decide`): the compiled step is kept only when
   it is faster beyond the noise, and the entry is stored. Its compile time is sunk by then, so this run keeps the
   faster one whatever the work left.

Every step of a trial is a real step of the run (the same math within float rounding), so the trial costs only the
compile time. A distributed run never reads a store (each node has its own): its ranks time alike and agree.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from dflashkit.cpu_products.choice import ENV, Choice, Store
from dflashkit.cpu_products.step_trial import decide
from dflashkit.errors import ConfigError

SETTINGS = ("auto", "on", "off")
FORCED = ("on", "off", "measure")  # the environment variable's values
EAGER, COMPILED = "eager", "compiled"
WARM_STEPS = 1  # untimed eager steps first (allocator, caches, the products' own trials)
EAGER_STEPS = 3  # timed eager steps before the gate
ROUNDS = 3  # ABBA rounds of (compiled, eager) after the compile
TRIAL_FACTOR = 10.0  # a first trial only where the work left is at least this many times the compile time risked
UNKNOWN_COMPILE_S = 300.0  # the compile time risked where none was ever recorded on this machine
T = TypeVar("T")


@dataclass(frozen=True)
class MeasuredCompile:
    """One kind of step whose compilation is measured: its name (its DFLASHKIT_CHOICES entry and its store in the
    user cache: `cpu_products.choice`) and the unit of work its timings are per ("a step"; "per 1k tokens" where a
    step's work varies)."""

    name: str
    unit: str = "a step"

    @property
    def choice(self) -> Choice:
        return Choice(self.name, FORCED)

    def store_path(self) -> Path | None:
        """This machine's file: <cache>/<name>/<machine>.json (None under DFLASHKIT_CHOICES=store=off)."""
        store = self.choice.store()
        return None if store is None else store.path

    def stored_choices(self, path: Path | None = None) -> dict[str, dict[str, Any]]:
        """The stored entries still usable (well-formed, measured within the age limit), by key."""
        path = self.store_path() if path is None else path
        return {} if path is None else Store(path).read(_well_formed)

    def forced(self) -> str | None:
        """The override in DFLASHKIT_CHOICES (None when there is none); an unknown one is a ConfigError naming it."""
        return self.choice.override()

    def start(
        self,
        key: str,
        setting: str,
        remaining_s: Callable[[float], float],
        *,
        distributed: bool = False,
        write: bool = True,
        path: Path | None = None,
        sunk: bool = False,
    ) -> CompileTrial:
        """The choice for one run's step `key` under `setting` (auto | on | off). `remaining_s(rate)` → seconds of
        work the run has left at `rate` seconds a unit of work; `distributed`: read no store (ranks time alike);
        `write`: store the trial's entry (one rank of a run writes); `path` the store (default this machine's);
        `sunk`: this process compiled these steps already, so a stored verdict's compile time is not paid again."""
        if setting not in SETTINGS:
            raise ConfigError(f"compile: {setting!r}: expected one of {', '.join(SETTINGS)}")
        path = self.store_path() if path is None else path
        trial = CompileTrial(key, remaining_s, store=self, path=path if write else None)
        forced = self.forced() if setting == "auto" else setting
        if forced in ("on", "off"):
            why = self.choice.why(forced) if setting == "auto" else f"compile: {forced}"
            trial.settle(COMPILED if forced == "on" else EAGER, f"{why} → {_word(forced == 'on')}")
        elif forced == "measure":
            trial.gated = False
        elif not distributed:
            stored = self.stored_choices(path).get(key)
            if stored is not None:
                trial.from_entry(stored, sunk=sunk)
            trial.risk_s = max(
                (float(e["compile_s"]) for e in self.stored_choices(path).values() if _number(e.get("compile_s"))),
                default=UNKNOWN_COMPILE_S,
            )
        return trial

    def record(self, path: Path | None, key: str, entry: dict[str, Any]) -> None:
        """Store `entry` for `key` with the time it was measured (nothing when `path` is None)."""
        if path is not None:
            Store(path).record(key, entry, _well_formed)


class CompileTrial:
    """The compile choice of one run's step: settled at the start, or timed inside its first steps."""

    def __init__(
        self, key: str, remaining_s: Callable[[float], float], *, store: MeasuredCompile, path: Path | None
    ) -> None:
        self.key, self.remaining_s, self.store, self.path = key, remaining_s, store, path
        self.gated = True  # a first trial must fit the run (TRIAL_FACTOR); `measure` lifts it
        self.risk_s = UNKNOWN_COMPILE_S
        self.choice: str | None = None  # EAGER or COMPILED once settled
        self.message = ""
        self.schedule = [EAGER] * (WARM_STEPS + EAGER_STEPS)
        self.pos = 0
        self.eager_s: list[float] = []  # the timed eager steps before the compile: seconds a unit of work
        self.compile_s: float | None = None
        self.times: dict[str, list[float]] = {EAGER: [], COMPILED: []}  # the ABBA rounds: seconds a unit

    @property
    def settled(self) -> bool:
        return self.choice is not None

    @property
    def current(self) -> str:
        """What the next step runs."""
        return self.choice if self.choice is not None else self.schedule[self.pos]

    def settle(self, choice: str, message: str) -> None:
        self.choice, self.message = choice, message

    def from_entry(self, entry: dict[str, Any], *, sunk: bool = False) -> None:
        """Settle from a stored trial: eager where the compiled step was unusable or slower, or where this run's
        work left does not repay the compile time (none when `sunk`: compiled in this process already); compiled
        otherwise."""
        if entry.get("unusable"):
            self.settle(EAGER, f"eager: compiling failed here before ({entry['unusable']}; dflashkit info)")
            return
        eager, compiled, compile_s = entry["eager_ms"] / 1e3, entry["compiled_ms"] / 1e3, float(entry["compile_s"])
        timed = (
            f"eager {1e3 * eager:,.0f} ms, compiled {1e3 * compiled:,.0f} ms {self.store.unit}, "
            f"{compile_s:,.0f} s to compile"
        )
        if entry["choice"] != COMPILED:
            self.settle(EAGER, f"{timed} (timed before on this machine) → eager")
            return
        saved = self.remaining_s(eager) * (1 - compiled / eager)
        pays = saved > (0.0 if sunk else compile_s)
        verdict = f"saves ~{saved:,.0f} s of this run" + (
            ", compiled already" if sunk else "" if pays else ", less than it costs"
        )
        self.settle(COMPILED if pays else EAGER, f"{timed} (timed before on this machine): {verdict} → {_word(pays)}")

    def known_rate(self, rate: float) -> None:
        """Eager seconds a unit of work already timed elsewhere (an evaluation's settled warm-up runs): the eager
        steps are skipped and the gate decides now."""
        if self.settled or self.pos:
            return
        self.eager_s = [rate] * EAGER_STEPS
        self.pos = WARM_STEPS + EAGER_STEPS
        self._gate()

    def finished(self, seconds: float, work: float = 1.0) -> None:
        """A step of `current` took `seconds` (agreed over ranks) for `work` units: record it, advance the trial."""
        if self.settled:
            return
        phase, rate = self.schedule[self.pos], seconds / max(work, 1e-12)
        first_compiled = phase == COMPILED and self.compile_s is None
        if self.pos >= WARM_STEPS and self.pos < WARM_STEPS + EAGER_STEPS:
            self.eager_s.append(rate)
        elif first_compiled:  # its excess over the same work done eagerly
            self.compile_s = max(0.0, seconds - statistics.median(self.eager_s) * work)
        elif self.pos > WARM_STEPS + EAGER_STEPS + 1:  # the rounds (after the compile and one untimed step)
            self.times[phase].append(rate)
        self.pos += 1
        if self.pos == WARM_STEPS + EAGER_STEPS:
            self._gate()
        elif self.pos == len(self.schedule):
            self._decide()

    def run_step(
        self,
        step: Callable[[bool], T],
        *,
        work: Callable[[T], float] = lambda _out: 1.0,
        agree: Callable[[float], float] = lambda s: s,
        sync: Callable[[], None] = lambda: None,
        say: Callable[[str], None] = lambda _msg: None,
        keep: tuple[type[BaseException], ...] = (),
        before_retry: Callable[[], None] = lambda: None,
        retry: bool = True,
    ) -> T:
        """One step as the choice says (`step(compiled)`), timed while the choice is open: its seconds (`agree`d over
        ranks; `sync` waits for the device) for `work(result)` units. A compiled step that raises anything but `keep`
        (the caller's own errors, out of memory) runs again eagerly after `before_retry` (gradients dropped) — no
        step lost — and, when the eager step succeeds, the choice settles on eager, recorded unusable (an eager step
        that fails too re-raises its own error, nothing recorded). `retry` False (ranks of one run: the others are
        inside the step's collectives) records the failure and stops with a ConfigError naming the way out. `say`
        gets what was decided."""
        compiled = self.current == COMPILED
        if self.settled and not compiled:
            return step(False)
        timing = not self.settled
        if timing:
            sync()
        t0 = time.perf_counter()
        try:
            out = step(compiled)
        except (*keep, torch_out_of_memory()):
            raise
        except Exception as e:  # torch.compile's failures (dynamo, inductor, the C++ build) share no type
            if not compiled:
                raise
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if not retry:
                self.failed(reason)
                raise ConfigError(
                    f"torch.compile failed in a step of a multi-rank run ({reason[:200]}); recorded for this "
                    f"machine — rerun (the choice now stays eager) or set compile: off"
                ) from e
            before_retry()
            self.settle(EAGER, "")  # the rerun is eager (a caller may read `current` rather than its argument)
            out = step(False)
            self.failed(reason)
            say(f"{self.message}; that step ran again eagerly")
            return out
        if timing:
            sync()
            self.finished(agree(time.perf_counter() - t0), work(out))
            if self.settled:
                say(self.message)
        return out

    def failed(self, reason: str) -> None:
        """The compiled step raised: this run stays eager, and the store says so until the age limit."""
        self.store.record(self.path, self.key, {"choice": EAGER, "unusable": reason[:300]})
        self.settle(EAGER, f"eager: the compiled step failed ({reason[:200]})")

    def _gate(self) -> None:
        """After the timed eager steps: compile now, or stay eager when the run is too short to risk it."""
        step = statistics.median(self.eager_s)
        left = self.remaining_s(step)
        if self.gated and left < TRIAL_FACTOR * self.risk_s:
            self.settle(
                EAGER,
                f"eager: ~{left / 60:,.1f} min of work left, too little to risk compiling (~{self.risk_s:,.0f} s "
                f"{'recorded' if self.risk_s != UNKNOWN_COMPILE_S else 'assumed'} here; tried from "
                f"{TRIAL_FACTOR * self.risk_s / 60:,.0f} min of work, or with {ENV}={self.store.name}=measure)",
            )
            return
        rounds = [(COMPILED, EAGER) if r % 2 == 0 else (EAGER, COMPILED) for r in range(ROUNDS)]
        self.schedule += [COMPILED, COMPILED] + [name for pair in rounds for name in pair]

    def _decide(self) -> None:
        """After the rounds: the compiled step kept only when faster beyond the noise (paired by round)."""
        verdict = decide({"stock": self.times[EAGER], COMPILED: self.times[COMPILED]})
        choice = COMPILED if verdict["choice"] == COMPILED else EAGER
        # a compile found cheap here (graphs or an inductor cache from earlier in this process or machine) does not
        # lower the compile time recorded for the key: a fresh process pays the full one
        before = self.store.stored_choices(self.path).get(self.key, {}) if self.path is not None else {}
        recorded = float(before["compile_s"]) if _number(before.get("compile_s")) else 0.0
        entry = {
            "choice": choice,
            "eager_ms": verdict["stock_ms"],
            "compiled_ms": verdict[f"{COMPILED}_ms"],
            "compile_s": round(max(float(self.compile_s or 0.0), recorded), 2),
        }
        self.store.record(self.path, self.key, entry)
        self.settle(
            choice,
            f"eager {entry['eager_ms']:,.0f} ms, compiled {entry['compiled_ms']:,.0f} ms {self.store.unit} after "
            f"{float(self.compile_s or 0.0):,.0f} s compiling (timed now) → {choice}",
        )


def torch_out_of_memory() -> type[BaseException]:
    """torch's out-of-memory error: a step that runs out of memory is not a compile failure (it is re-raised)."""
    import torch

    return getattr(torch, "OutOfMemoryError", MemoryError)


def target_key(target: Any) -> str:
    """What a target's passes cost, by its shape: architecture, layers, width, vocabulary (a key's first part)."""
    return f"{target.architecture}:l{target.num_layers}:h{target.hidden_size}:v{target.vocab_size}"


def device_name(device: Any) -> str:
    """The device a step's speed depends on beyond this machine's CPU (a store's file is per CPU): "cpu", or
    "cuda:<the GPU's name>"."""
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        return "cuda:" + torch.cuda.get_device_name(device).replace(" ", "_")
    return str(getattr(device, "type", device))


def _word(compiled: bool) -> str:
    return COMPILED if compiled else EAGER


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x >= 0


def _well_formed(_key: str, e: object) -> bool:
    """An entry a choice can be made from: a recorded failure, or a trial's three timings and its verdict."""
    if not isinstance(e, dict) or e.get("choice") not in (EAGER, COMPILED):
        return False
    if e.get("unusable"):
        return isinstance(e["unusable"], str)
    return all(_number(e.get(f)) for f in ("eager_ms", "compiled_ms", "compile_s")) and e["eager_ms"] > 0


__all__ = [
    "COMPILED",
    "EAGER",
    "EAGER_STEPS",
    "FORCED",
    "ROUNDS",
    "SETTINGS",
    "TRIAL_FACTOR",
    "UNKNOWN_COMPILE_S",
    "WARM_STEPS",
    "CompileTrial",
    "MeasuredCompile",
    "device_name",
    "target_key",
]
