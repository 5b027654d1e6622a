"""A product choice timed inside the real decoding steps: each candidate runs whole steps in turn, ABBA-interleaved,
and a step's time is the interval between two consecutive openings of the same pass (its first product).

Why not time the products alone: a pass of products timed back to back on fixed inputs does not rank the candidates
as a real decoding step does — inside a step the other ops (attention, norms, the cache) share the caches and the
memory bandwidth, so two candidates that tie in isolation can differ widely in a step, and an isolated timing keeps
F.linear where a weight-stationary product makes regeneration clearly faster. The step's own time is what a choice
is for, so it is what is timed.

    trial = StepTrial(["stock", "few_rows", "onednn"], repeats=5)
    trial.opened(now, unbroken=True)      # at every opening of the pass at this row count
    trial.current                         # the candidate the products of this step run
    trial.done, trial.times               # after repeats × candidates recorded steps: decide(trial.times)
    decide(times)                         # the rule, for these and for products timed alone: paired by round
    unclear(times), trial.extend(repeats) # ahead in the median, not round by round: more rounds first

An interval is recorded only when nothing else came between the two openings (`unbroken`: no opening of another
row count, no stock-products block such as a prefill); otherwise the same candidate runs the next step again.
"""

from __future__ import annotations

import statistics

MIN_GAIN = 0.03  # another candidate must beat stock by at least this much (and by more than the noise) to be chosen
MAX_EXTENSIONS = 2  # an unclear trial gets up to this many more sets of rounds before stock is kept


class StepTrial:
    """The schedule and the recorded step times of one pass group at one row count."""

    def __init__(self, names: list[str], repeats: int) -> None:
        if not names or repeats < 1:
            raise ValueError("a step trial needs at least one candidate and one repeat")
        self.names = list(names)
        self.schedule: list[str] = []
        self.extensions = -1  # rounds added after the first `repeats` (extend): none yet
        self.extend(repeats)
        self.times: dict[str, list[float]] = {n: [] for n in names}
        self.pos = 0  # the schedule entry whose step runs now
        self.started: float | None = None  # when the running step opened

    def extend(self, repeats: int) -> None:
        """`repeats` more rounds, the ABBA alternation continued (an unclear verdict is timed further)."""
        first = len(self.schedule) // len(self.names)
        names = self.names
        self.schedule += [n for r in range(first, first + repeats) for n in (names if r % 2 == 0 else names[::-1])]
        self.extensions += 1

    @property
    def current(self) -> str:
        return self.schedule[min(self.pos, len(self.schedule) - 1)]

    @property
    def done(self) -> bool:
        return self.pos >= len(self.schedule)

    def restart_round(self) -> None:
        """Back to the start of the running round, its steps dropped (a trial paused mid-round: a round is a set of
        neighbours in time, so it is timed again whole when the trial resumes)."""
        width = len(self.times)
        start = (self.pos // width) * width
        for name in self.schedule[start : self.pos]:
            self.times[name].pop()
        self.pos, self.started = start, None

    def opened(self, now: float, *, unbroken: bool) -> None:
        """A new opening of the pass: the running step (if any, and unbroken) ends now and is recorded."""
        if self.started is not None and unbroken and not self.done:
            self.times[self.current].append(now - self.started)
            self.pos += 1
        self.started = now


def _verdict(times: dict[str, list[float]]) -> tuple[str, dict[str, float], bool]:
    """(choice, each other candidate's median ratio to stock, whether the fastest leads stock beyond MIN_GAIN in the
    median): per candidate its time over stock's in each round; the one with the lowest median ratio is chosen when
    it leads and its upper-quartile ratio is below 1 (it beat stock in three rounds of four or more)."""
    stock = times["stock"]
    ratios = {
        n: sorted(t / s for t, s in zip(v, stock, strict=True) if s > 0) for n, v in times.items() if n != "stock"
    }
    median_ratio = {n: statistics.median(r) for n, r in ratios.items() if r}
    best = min(median_ratio, key=lambda n: median_ratio[n], default=None)
    leads = best is not None and median_ratio[best] < 1 - MIN_GAIN
    wins = leads and ratios[best][(3 * len(ratios[best])) // 4] < 1
    return (best if wins else "stock"), median_ratio, leads


def decide(times: dict[str, list[float]]) -> dict[str, float | str | None]:
    """Paired by round: the timings of one ABBA round are neighbours in time, so a slow phase of the machine, or the
    context growing over a trial's steps, hits every candidate of the round alike. Per candidate, its time over
    stock's in each round; the candidate with the lowest median ratio is kept when that median is below 1 − MIN_GAIN
    and its upper-quartile ratio is below 1 (it beat stock in three rounds of four or more); stock otherwise —
    never slower than stock beyond the noise."""
    choice, median_ratio, _ = _verdict(times)
    entry: dict[str, float | str | None] = {"choice": choice}
    entry.update({f"{name}_ms": round(1e3 * statistics.median(v), 4) for name, v in times.items()})
    entry.update({f"{name}_vs_stock": round(m, 4) for name, m in median_ratio.items()})
    return entry


def unclear(times: dict[str, list[float]]) -> bool:
    """Whether the verdict is stock only for want of rounds: the fastest candidate's median ratio is beyond MIN_GAIN
    but it lost to stock in more than a quarter of the rounds. Timed further (StepTrial.extend, MAX_EXTENSIONS
    times) before stock is kept: a trial cut short in a warm-up can keep stock for a verify width where another
    candidate is clearly faster, and every later chain round then pays the slower verify (enough to make chain
    decoding slower than AR)."""
    choice, _, leads = _verdict(times)
    return leads and choice == "stock"


__all__ = ["MAX_EXTENSIONS", "MIN_GAIN", "StepTrial", "decide", "unclear"]
