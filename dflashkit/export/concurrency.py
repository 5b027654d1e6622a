"""How a served drafter pays as concurrent requests grow: throughput, per-request latency and acceptance at each
concurrency, with the drafter and (given a second server of the same target without it) without — the batch size
where the drafter stops paying.

    curve = load_curve("http://127.0.0.1:8080", prompts, LoadSettings(levels=(1, 4, 16)), baseline="http://…:8081")
    print(curve.render())      # per level: tok/s with / without, ×, p50 / p90 latency, τ and accepted per position

At each level c, c clients send requests back to back (prompt token ids, greedy, exactly `max_new_tokens` tokens)
until `rounds × c` requests are answered (at least every prompt once); throughput = output tokens / wall time of the
level, latency = each request's time from send to answer. Acceptance is the level's difference of the server's own
speculative counters (export/served.py reads them) — every request in flight is one of ours, so the difference is
theirs; a server shared with other traffic gives wrong acceptance and throughput, and the report cannot tell.
The with-drafter server and the baseline run one after the other, level by level, so both see the same machine.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from dflashkit.data.server_client import ServerError, ServerPool, ServerTimeouts
from dflashkit.errors import DFlashError
from dflashkit.export.served import ServedError, server_counters


@dataclass(frozen=True)
class LoadSettings:
    levels: tuple[int, ...] = (1, 4, 16)
    max_new_tokens: int = 64
    rounds: int = 2  # requests per client at each level
    metrics_path: str = "/metrics"
    timeouts: ServerTimeouts = field(default_factory=lambda: ServerTimeouts(first_byte_s=600.0, total_s=1200.0))


@dataclass
class Level:
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    latencies_s: list[float]
    drafts: int | None = None  # the server's counters over the level (None: it reports none)
    accepted: int | None = None
    accepted_per_pos: list[int] | None = None

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def latency(self, q: float) -> float:
        xs = sorted(self.latencies_s)
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))] if xs else 0.0

    @property
    def tau(self) -> float | None:
        return (self.accepted + self.drafts) / self.drafts if self.drafts else None


@dataclass
class LoadCurve:
    url: str
    baseline: str | None
    max_new_tokens: int
    levels: list[Level]
    baseline_levels: list[Level]

    def stops_paying(self) -> int | None:
        """The lowest concurrency at which the drafter's throughput is not above the baseline's (None: it pays at
        every level measured, or there is no baseline)."""
        for a, b in zip(self.levels, self.baseline_levels, strict=False):
            if a.tok_per_s <= b.tok_per_s:
                return a.concurrency
        return None

    def as_dict(self) -> dict[str, Any]:
        def level(x: Level) -> dict[str, Any]:
            d = asdict(x)
            d.pop("latencies_s")
            d.update(tok_per_s=round(x.tok_per_s, 2), latency_p50_s=round(x.latency(0.5), 3))
            d.update(latency_p90_s=round(x.latency(0.9), 3), tau=None if x.tau is None else round(x.tau, 3))
            return d

        return {
            "url": self.url,
            "baseline": self.baseline,
            "max_new_tokens": self.max_new_tokens,
            "levels": [level(x) for x in self.levels],
            "baseline_levels": [level(x) for x in self.baseline_levels],
            "stops_paying_at": self.stops_paying(),
        }

    def render(self) -> str:
        lines = [f"load curve of {self.url}" + (f" against {self.baseline}" if self.baseline else "")]
        head = f"  {'conc.':>5} {'tok/s':>8} {'base':>8} {'×':>6} {'p50 s':>7} {'base':>7} {'p90 s':>7} {'τ':>6}"
        lines.append(head + "  accepted/pos")
        for i, x in enumerate(self.levels):
            b = self.baseline_levels[i] if i < len(self.baseline_levels) else None
            base = f"{b.tok_per_s:8.1f}" if b else f"{'—':>8}"
            ratio = f"{x.tok_per_s / b.tok_per_s:6.2f}" if b and b.tok_per_s else f"{'—':>6}"
            p50b = f"{b.latency(0.5):7.2f}" if b else f"{'—':>7}"
            tau = f"{x.tau:6.2f}" if x.tau is not None else f"{'—':>6}"
            lines.append(
                f"  {x.concurrency:>5} {x.tok_per_s:8.1f} {base} {ratio} {x.latency(0.5):7.2f} {p50b} "
                f"{x.latency(0.9):7.2f} {tau}  {x.accepted_per_pos or '—'}"
            )
        if self.baseline_levels:
            stop = self.stops_paying()
            lines.append(
                f"  the drafter stops paying at concurrency {stop}"
                if stop
                else "  the drafter pays at every concurrency measured"
            )
        return "\n".join(lines)


def run_level(pool: ServerPool, prompts: list[list[int]], concurrency: int, settings: LoadSettings) -> Level:
    """One level: `concurrency` clients, `settings.rounds` requests each (at least every prompt once)."""
    total = max(concurrency * settings.rounds, len(prompts))
    work = [prompts[i % len(prompts)] for i in range(total)]
    ask = {"max_tokens": settings.max_new_tokens, "temperature": 0.0, "top_p": 1.0, "seed": 0, "stop_ids": []}

    def one(ids: list[int]) -> tuple[int, float]:
        t0 = time.monotonic()
        c = pool.complete(ids, **ask, ignore_eos=True)
        return len(c.token_ids or []), time.monotonic() - t0

    before = server_counters(pool, settings.metrics_path)
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=concurrency) as ex:
            done = list(ex.map(one, work))
    except ServerError as e:
        raise ServedError(str(e)) from None
    wall = time.monotonic() - t0
    level = Level(concurrency, total, sum(n for n, _ in done), wall, [s for _, s in done])
    after = server_counters(pool, settings.metrics_path) if before is not None else None
    if after is not None and before is not None:
        d = after.minus(before)
        if not d.went_down() and d.drafts:
            level.drafts, level.accepted = round(d.drafts), round(d.accepted or 0)
            level.accepted_per_pos = [round(d.per_pos.get(j, 0.0)) for j in range(max(d.per_pos, default=-1) + 1)]
    return level


def load_curve(
    url: str, prompts: list[list[int]], settings: LoadSettings = LoadSettings(), *, baseline: str | None = None
) -> LoadCurve:
    """The curve of `url` (and of `baseline`, the same target without the drafter) over `settings.levels`."""
    if not prompts:
        raise DFlashError("the load curve needs at least one prompt")

    def pool_of(u: str) -> ServerPool:
        p = ServerPool([u], retries=2, backoff_s=0.5, timeouts=settings.timeouts)
        try:
            p.connect(None)
        except ServerError as e:
            raise ServedError(str(e)) from None
        return p

    spec, base = pool_of(url), (pool_of(baseline) if baseline else None)
    levels, base_levels = [], []
    for c in settings.levels:  # alternate servers level by level: both see the machine as it is then
        levels.append(run_level(spec, prompts, c, settings))
        if base is not None:
            base_levels.append(run_level(base, prompts, c, settings))
    return LoadCurve(url, baseline, settings.max_new_tokens, levels, base_levels)


__all__ = ["Level", "LoadCurve", "LoadSettings", "load_curve", "run_level"]
