"""Where a training step's time goes: the quickstart's real rows, its drafter and settings, each precision timed
side by side and profiled by operator.

    .venv/bin/python bench/train_step_profile.py                           # runs/quickstart, fp32 and bf16
    .venv/bin/python bench/train_step_profile.py --dtypes fp32 --steps 30 --rounds 3 --json-out before.json

The run is the quickstart's training stage as a finished quickstart (`--base`) configured it: its captured features,
its draft vocabulary and drafter (the last checkpoint's `train_config.yaml`, its output redirected to a scratch
directory, step-based, eager: `compile: false`), set up once per precision (`dtype`, so each setup's own one-off
costs stay out of the steps). The precisions alternate in rounds of `--steps` optimizer steps (each after `--warmup`
untimed ones) so a busy machine's drift hits both; a step is the loop's own (`train.loop`: rows, anchors, masks,
forward, loss, backward, clipping, AdamW). Then one profile of `--profile-steps` steps per precision
(torch.profiler, CPU) gives the operators that take the most self time, in ms per step.

Prints the table, the profiles, and ONE final JSON line. Works on any commit that has these functions, so the same
script measures the code before and after a change (run it from each checkout, one after the other, on an otherwise
idle machine).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _config(base: Path, out: Path, dtype: str, steps: int) -> Any:
    import yaml

    from dflashkit.train.config import TrainConfig

    saved = sorted((base / "train" / "checkpoints").glob("step-*/train_config.yaml"))
    if not saved:
        raise SystemExit(f"error: --base {base}: no train/checkpoints/step-*/train_config.yaml (a finished quickstart)")
    d = yaml.safe_load(saved[-1].read_text())
    d.update(
        out=str(out), dtype=dtype, max_steps=steps, schedule_minutes=None, time_budget_minutes=None, eval_every=0,
        keep_best=False, save_every=0, val_samples=0, tensorboard=False, progress=False, compile=False,
    )  # fmt: skip
    return TrainConfig.from_dict(d, source="bench")


class Stepper:
    """One set-up run that takes optimizer steps on demand, epoch after epoch."""

    def __init__(self, base: Path, out: Path, dtype: str, steps: int) -> None:
        from dflashkit.train.run import setup_run

        self.run = setup_run(_config(base, out, dtype, steps))
        self.epoch, self.iter = -1, None

    def step(self) -> float:
        from dflashkit.train import loop
        from dflashkit.train.step import micro_batches

        st = self.run.state
        epoch, in_epoch = divmod(st.step, self.run.steps_per_epoch)
        if epoch != self.epoch:
            self.iter, self.epoch = micro_batches(self.run, epoch, in_epoch), epoch
        t0 = time.perf_counter()
        # the loop's step (older checkouts: `_train_step` took the iterator itself)
        step = getattr(loop, "_compile_aware_step", None) or loop._train_step
        step(self.run, self.iter, epoch, 0.0, None, None)
        return time.perf_counter() - t0


def _profile(stepper: Stepper, steps: int, top: int) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            stepper.step()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in rows)
    out = [{"op": e.key, "ms_per_step": e.self_cpu_time_total / 1000 / steps, "calls": e.count // steps} for e in rows]
    return [{"op": "(all)", "ms_per_step": total / 1000 / steps, "calls": 0}, *out[:top]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="runs/quickstart", help="a finished quickstart run (its features and settings)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated TrainConfig dtypes to compare")
    p.add_argument("--steps", type=int, default=20, help="timed steps per round and precision")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps before each round")
    p.add_argument("--rounds", type=int, default=2, help="rounds; the precisions alternate within each")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--top", type=int, default=12, help="operators listed per profile")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json-out", default=None, help="also write the JSON result here")
    args = p.parse_args(argv)

    import torch

    from dflashkit.cpu_products.machine import machine_line

    if args.threads:
        torch.set_num_threads(args.threads)
    base, dtypes = Path(args.base), [d.strip() for d in args.dtypes.split(",") if d.strip()]
    scratch = Path(tempfile.mkdtemp(prefix="dflashkit-step-profile-"))
    total = args.rounds * (args.warmup + args.steps) + args.profile_steps + 1
    try:
        steppers = {d: Stepper(base, scratch / d, d, total) for d in dtypes}
        times: dict[str, list[float]] = {d: [] for d in dtypes}
        for r in range(args.rounds):
            for d in dtypes if r % 2 == 0 else reversed(dtypes):
                for _ in range(args.warmup):
                    steppers[d].step()
                times[d] += [steppers[d].step() for _ in range(args.steps)]
        profiles = {d: _profile(steppers[d], args.profile_steps, args.top) for d in dtypes}
        used = {d: "bf16" if steppers[d].run.autocast_dtype is not None else "fp32" for d in dtypes}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    med = {d: statistics.median(t) for d, t in times.items()}
    ref = med[dtypes[0]]
    print(f"machine: {machine_line()}")
    print(f"base {base}: {args.rounds} rounds × {args.steps} steps per precision (after {args.warmup} untimed)\n")
    print("| dtype | computes in | s/step (median) | steps/min | × first |")
    print("|---|---|---:|---:|---:|")
    for d in dtypes:
        print(f"| {d} | {used[d]} | {med[d]:.3f} | {60 / med[d]:.0f} | {ref / med[d]:.2f} |")
    for d in dtypes:
        print(f"\nprofile, {d} (ms per step, self time):")
        for row in profiles[d]:
            print(f"  {row['ms_per_step']:8.1f}  {row['op'][:70]}" + (f"  ×{row['calls']}" if row["calls"] else ""))
    result = {
        "bench": "train_step_profile",
        "machine": machine_line(),
        "base": str(base),
        "s_per_step": med,
        "computes_in": used,
        "steps": {d: len(t) for d, t in times.items()},
        "profiles": profiles,
    }
    line = json.dumps(result)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
