"""A product choice timed inside the real decoding steps: each candidate runs whole steps in turn, ABBA-interleaved,
and a step's time is the interval between two consecutive openings of the same pass (its first product).

Why not time the products alone: on a 2-core AMD EPYC VM (AVX2, MKL 2024.2, torch 2.13.0+cpu) a pass of SmolLM2's
210 layer products at 16 rows, timed back to back on fixed inputs, took 84 ms with F.linear and 80 ms
weight-stationary, while inside real batch-16 decoding steps the same products took 160 ms and 102 ms a step
(torch.profiler, 12 steps): the isolated pass kept F.linear and regeneration ran 20 % slower than it could. The
step's own time is what a choice is for, so it is what is timed.

    trial = StepTrial(["stock", "few_rows", "onednn"], repeats=5)
    trial.opened(now, unbroken=True)      # at every opening of the pass at this row count
    trial.current                         # the candidate the products of this step run
    trial.done, trial.times               # after repeats × candidates recorded steps: decide(trial.times)

An interval is recorded only when nothing else came between the two openings (`unbroken`: no opening of another
row count, no stock-products block such as a prefill); otherwise the same candidate runs the next step again.
"""

from __future__ import annotations


class StepTrial:
    """The schedule and the recorded step times of one pass group at one row count."""

    def __init__(self, names: list[str], repeats: int) -> None:
        if not names or repeats < 1:
            raise ValueError("a step trial needs at least one candidate and one repeat")
        self.schedule = [n for r in range(repeats) for n in (names if r % 2 == 0 else names[::-1])]
        self.times: dict[str, list[float]] = {n: [] for n in names}
        self.pos = 0  # the schedule entry whose step runs now
        self.started: float | None = None  # when the running step opened

    @property
    def current(self) -> str:
        return self.schedule[min(self.pos, len(self.schedule) - 1)]

    @property
    def done(self) -> bool:
        return self.pos >= len(self.schedule)

    def opened(self, now: float, *, unbroken: bool) -> None:
        """A new opening of the pass: the running step (if any, and unbroken) ends now and is recorded."""
        if self.started is not None and unbroken and not self.done:
            self.times[self.current].append(now - self.started)
            self.pos += 1
        self.started = now


__all__ = ["StepTrial"]
