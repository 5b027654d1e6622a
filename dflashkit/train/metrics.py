"""Training metrics: one JSON object per line in `out/metrics.jsonl`, the same scalars in TensorBoard (`out/tb`).

Train records carry `"split": "train"`; validation records `"split": "val"`. Per-position accuracy is a list over
block slots (slot 0 is the clean anchor token and always unsupervised). `RollingStats` keeps the last N step
losses and reports P10 / median / mean / P90 — a bimodal or collapsing loss shows up there before the mean moves.

On resume, `MetricsLogger(resume_step=k)` drops records of steps after k (those steps are trained again).
Only rank 0 creates a logger with `enabled=True`; the others get a no-op logger.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dflashkit.io_utils import atomic_write_text


class RollingStats:
    """Percentiles of the last `window` values."""

    def __init__(self, window: int = 100, values: Iterable[float] = ()) -> None:
        self.values: deque[float] = deque(values, maxlen=window)

    def add(self, value: float) -> None:
        if math.isfinite(value):
            self.values.append(float(value))

    def summary(self, prefix: str = "loss") -> dict[str, float]:
        if not self.values:
            return {}
        xs = sorted(self.values)

        def q(p: float) -> float:  # linear interpolation, as numpy's default
            pos = p * (len(xs) - 1)
            lo, hi = math.floor(pos), math.ceil(pos)
            return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

        return {
            f"{prefix}_p10": q(0.1),
            f"{prefix}_median": q(0.5),
            f"{prefix}_mean": sum(xs) / len(xs),
            f"{prefix}_p90": q(0.9),
        }


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl (skips a torn last line)."""
    out = []
    path = Path(path)
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class MetricsLogger:
    """Appends records to metrics.jsonl and scalars to TensorBoard; a no-op when `enabled` is False."""

    def __init__(
        self, out_dir: str | Path, *, enabled: bool = True, tensorboard: bool = True, resume_step: int | None = None
    ) -> None:
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self.tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file():
            keep = [r for r in read_metrics(self.path) if resume_step is not None and r.get("step", 0) <= resume_step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in keep))
        self._file = self.path.open("a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(
                log_dir=str(Path(out_dir) / "tb"), purge_step=resume_step + 1 if resume_step is not None else None
            )

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()
        if self.tb is not None:
            step = int(record["step"])
            split = record.get("split", "train")
            for key, value in record.items():
                if key in ("step", "split", "epoch"):
                    continue
                if isinstance(value, bool):
                    value = float(value)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(f"{split}/{key}", value, step)
                elif isinstance(value, list) and key == "accuracy":
                    for k, v in enumerate(value[1:], start=1):
                        self.tb.add_scalar(f"{split}/acc_slot{k:02d}", v, step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()


__all__ = ["MetricsLogger", "RollingStats", "read_metrics"]
