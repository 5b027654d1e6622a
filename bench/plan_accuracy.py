"""How well `dflashkit plan --calibrate` predicts a training step's time on this machine: the rate is measured the
way the plan measures it (`diagnose.plan.calibrate_for`: real drafter steps at the plan's row and half of it, the
target's forward), then real training
runs of other geometries (`dflashkit train`: online features from the embedded SmolLM2-135M, one document per
row) are timed and set beside the prediction.

    .venv/bin/python bench/plan_accuracy.py                     # five geometries, 4 steps each
    .venv/bin/python bench/plan_accuracy.py --steps 6 --out runs/plan_accuracy

A geometry's measured time is the median `step_s` of its steps after the first (which builds AdamW's state). Prints
a table (predicted, measured, ratio) and ends with one JSON line; writes OUT/plan_accuracy.json. The issue's bar:
every ratio within 0.75 … 1.25.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

# (drafter layers, block size, tokens per row, blocks per row)
GEOMETRIES = ((2, 16, 512, 32), (5, 16, 1024, 64), (3, 16, 1024, 128), (1, 16, 2048, 64), (5, 8, 768, 96))


def _tokens(path: Path, vocab: int, length: int, n: int) -> Path:
    g = torch.Generator().manual_seed(0)
    with path.open("w") as f:
        for i in range(n):
            ids = torch.randint(100, vocab, (length,), generator=g).tolist()
            f.write(json.dumps({"id": f"x{i}", "input_ids": ids, "loss_mask": [0] * 32 + [1] * (length - 32)}) + "\n")
    return path


def measure(target: Any, out: Path, geometry: tuple[int, int, int, int], steps: int) -> float:
    """Median seconds of a real training step of `geometry` (after the first)."""
    from dflashkit.train.config import TrainConfig
    from dflashkit.train.loop import train

    layers, bs, tokens, blocks = geometry
    name = f"g{layers}-{bs}-{tokens}-{blocks}"
    shutil.rmtree(out / name, ignore_errors=True)  # a fresh run, not a resumed one
    data = _tokens(out / f"{name}.jsonl", target.vocab_size, tokens - 4, steps + 1)
    cfg = TrainConfig(
        out=str(out / name), target="default", tokens=str(data), online=True,
        drafter={"num_hidden_layers": layers, "block_size": bs}, max_tokens=tokens, max_anchors=blocks,
        max_steps=steps, save_every=0, progress=False, tensorboard=False, grad_accum=1, batch_rows=1,
    )  # fmt: skip
    times: list[float] = []
    train(cfg, target=target, callbacks=[lambda e: times.append(float(e.metrics["step_s"]))])
    return statistics.median(times[1:])


def predict(target_shape: Any, rate: Any, geometry: tuple[int, int, int, int]) -> float:
    from dflashkit.drafter.config import DrafterConfig
    from dflashkit.train.memory import StepShape
    from dflashkit.train.step_cost import step_cost

    layers, bs, tokens, blocks = geometry
    cfg = DrafterConfig.for_target(
        hidden_size=target_shape.hidden_size, vocab_size=target_shape.vocab_size,
        num_target_layers=target_shape.num_layers, mask_token_id=0, num_hidden_layers=layers, block_size=bs,
    )  # fmt: skip
    return rate.seconds(step_cost(cfg, target_shape, StepShape(1, tokens, blocks), online=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default="runs/plan_accuracy")
    args = ap.parse_args(argv)
    from dflashkit.cpu_products.machine import machine_line
    from dflashkit.diagnose.plan import PlanRequest, calibrate_for, make_plan
    from dflashkit.target.model import Target

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = make_plan(PlanRequest(target="default", out=str(out / "plan")))  # this CPU's plan for the default
    shape = plan.target
    rate, records = calibrate_for(plan)  # what `plan --calibrate` measures
    print(f"machine: {machine_line()}", flush=True)
    print(f"rates: step {rate.flops_per_s / 1e9:.1f}, target forward {rate.forward_flops_per_s / 1e9:.1f} GFLOP/s")
    target = Target.load("default")
    rows = []
    print(f"{'layers':>6} {'block':>5} {'tokens':>6} {'blocks':>6} {'predicted s':>11} {'measured s':>10} {'ratio':>6}")
    for g in GEOMETRIES:
        pred, meas = predict(shape, rate, g), measure(target, out, g, args.steps)
        rows.append({"geometry": dict(zip(("layers", "block", "tokens", "blocks"), g, strict=True)),
                     "predicted_s": pred, "measured_s": meas, "ratio": pred / meas})  # fmt: skip
        print(f"{g[0]:>6} {g[1]:>5} {g[2]:>6} {g[3]:>6} {pred:>11.3f} {meas:>10.3f} {pred / meas:>6.2f}", flush=True)
    worst = max(abs(r["ratio"] - 1) for r in rows)
    doc = {"bench": "plan_accuracy", "machine": machine_line(), "rate_flops_per_s": rate.flops_per_s,
           "forward_flops_per_s": rate.forward_flops_per_s,
           "calibration": records, "rows": rows, "worst_relative_error": worst}  # fmt: skip
    (out / "plan_accuracy.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(
        json.dumps({"bench": "plan_accuracy", "worst_relative_error": round(worst, 3), "within_25pct": worst <= 0.25})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
