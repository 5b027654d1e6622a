"""What more training time buys: τ (chain and DDTree) against training minutes, on one quickstart run's data.

    .venv/bin/python bench/curve.py --base runs/quickstart                       # ×1, ×2, ×4, ×8 of 9 minutes
    .venv/bin/python bench/curve.py --base runs/quickstart --multipliers 1,2 --variant warm_start

Each point is the quickstart's training stage (`bench/sweep_defaults.py` variant `--variant`, default "base" =
the current defaults) run for `multiplier × --train-minutes` of wall-clock training, from scratch, with its own
warmup + cosine schedule spanning that budget — exactly what `dflashkit quickstart --train-minutes M` would give
on this machine. Every point is scored as soon as it is trained, by a teacher-forced simulation on held-out
MT-Bench turn-1 prompts (the same transcript cache for all points) — the drafter the quickstart would export,
i.e. its best validation pass (`keep_best`; `drafter_step` in the line) — and appended as ONE JSON line to
OUT/curve.jsonl. Resumable at two levels: a finished point (its line in curve.jsonl) is skipped, and a killed
point's training resumes from its last checkpoint (same schedule). Writes OUT/curve.png (τ against minutes, log2
axis) and OUT/curve.md after every point. The machine must otherwise be idle: budgets are wall-clock.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sweep_defaults


def read_points(path: Path) -> list[dict[str, Any]]:
    """The finished points of a curve (one JSON object per line; a torn last line is ignored)."""
    from dflashkit.train.metrics import read_metrics

    return read_metrics(path)


def _score(drafter: str, name: str, out: Path, args: argparse.Namespace) -> dict[str, float]:
    from dflashkit.cli import main as cli

    sim = out / "sim" / name
    cli(
        [
            "simulate",
            "--dataset",
            "mtbench",
            "--limit",
            str(args.sim_prompts),
            "--max-new-tokens",
            str(args.sim_max_new_tokens),
            "--cache",
            args.sim_cache,
            "--budgets",
            args.budgets,
            "--out",
            str(sim),
            "--quiet",
            "--drafter",
            f"{name}={drafter}",
        ]
    )
    res = json.loads((sim / "results.json").read_text())["results"][name]
    return {m: float(v["tau_macro"]) for m, v in res.items() if "tau_macro" in v}


def plot(points: list[dict[str, Any]], path: Path) -> None:
    """τ per method against training minutes (log2 x axis) → PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    pts = sorted(points, key=lambda p: p["train_minutes"])
    methods = sorted({m for p in pts for m in p["tau"]}, key=lambda m: (m != "chain", len(m), m))
    for m in methods:
        xs = [p["train_minutes"] for p in pts if m in p["tau"]]
        ax.plot(xs, [p["tau"][m] for p in pts if m in p["tau"]], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ticks = sorted({p["train_minutes"] for p in pts})
    ax.set_xticks(ticks, [f"{x:g}" for x in ticks])  # the measured budgets, not powers of two
    ax.minorticks_off()
    ax.set_xlabel("training minutes (this machine, wall-clock)")
    ax.set_ylabel("τ (accepted tokens per round)")
    ax.set_title("τ against training time (held-out MT-Bench turn 1, teacher-forced)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(points: list[dict[str, Any]]) -> str:
    pts = sorted(points, key=lambda p: p["train_minutes"])
    methods = sorted({m for p in pts for m in p["tau"]}, key=lambda m: (m != "chain", len(m), m))
    lines = [
        "| × | train min | steps | drafter of step | s/step | " + " | ".join(f"τ {m}" for m in methods) + " |",
        "|---" * (5 + len(methods)) + "|",
    ]
    for p in pts:
        lines.append(
            f"| {p['multiplier']:g} | {p['train_minutes']:g} | {p['steps']} | "
            f"{p.get('drafter_step', p['steps'])} | {p['seconds_per_step']:.2f} | "
            + " | ".join(f"{p['tau'].get(m, float('nan')):.3f}" for m in methods)
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from dflashkit.quickstart.run import QuickstartSettings

    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base", default=QuickstartSettings().out, help="a finished quickstart run (its data)")
    p.add_argument("--out", default="runs/curve")
    p.add_argument(
        "--variant", default="base", help=f"a bench/sweep_defaults.py variant: {list(sweep_defaults.VARIANTS)}"
    )
    p.add_argument("--multipliers", default="1,2,4,8", help="training budgets as multiples of --train-minutes")
    p.add_argument("--train-minutes", type=float, default=QuickstartSettings().train_minutes)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sim-prompts", type=int, default=16)
    p.add_argument("--sim-max-new-tokens", type=int, default=QuickstartSettings().eval_max_new_tokens)
    p.add_argument("--sim-cache", default="runs/sim_cache")
    p.add_argument("--budgets", default="8", help="DDTree budgets scored next to chain")
    args = p.parse_args(argv)
    if args.variant not in sweep_defaults.VARIANTS:
        raise SystemExit(f"error: --variant {args.variant!r}: expected one of {list(sweep_defaults.VARIANTS)}")
    try:
        mults = [float(x) for x in args.multipliers.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --multipliers {args.multipliers!r}: expected comma-separated numbers") from None
    if not mults or any(m <= 0 for m in mults):
        raise SystemExit(f"error: --multipliers {args.multipliers!r}: expected positive numbers")
    base, out = Path(args.base), Path(args.out)
    if not (base / "features" / "manifest.json").is_file():
        raise SystemExit(f"error: --base {base}: not a finished quickstart run (no features/manifest.json)")
    import torch

    from dflashkit.target.model import Target

    out.mkdir(parents=True, exist_ok=True)
    lines = out / "curve.jsonl"
    torch.manual_seed(0)
    target = Target.load("default")
    spec = sweep_defaults.VARIANTS[args.variant]
    for m in mults:
        minutes = round(m * args.train_minutes, 4)
        if any(pt["train_minutes"] == minutes and pt["variant"] == args.variant for pt in read_points(lines)):
            continue
        name = f"x{m:g}"
        row = sweep_defaults.run_variant(target, args.variant, spec, base, out / name, minutes, args.seed)
        point = {
            "bench": "curve",
            "variant": args.variant,
            "seed": args.seed,
            "multiplier": m,
            "train_minutes": minutes,
            "steps": row["train"]["steps"],
            "drafter_step": row["train"].get("best_step", row["train"]["steps"]),  # keep_best's choice
            "seconds_per_step": row["seconds_per_step"],
            "val": row["train"].get("val"),
            "tau": _score(row["drafter"], name, out, args),
        }
        with open(lines, "a") as f:
            f.write(json.dumps(point) + "\n")
        print(json.dumps(point), flush=True)
        points = [pt for pt in read_points(lines) if pt["variant"] == args.variant]
        plot(points, out / "curve.png")
        (out / "curve.md").write_text(
            f"# τ against training minutes ({args.variant}, seed {args.seed})\n\n{table(points)}\n"
        )
    points = [pt for pt in read_points(lines) if pt["variant"] == args.variant]
    plot(points, out / "curve.png")
    print(table(points))
    return 0


if __name__ == "__main__":
    sys.exit(main())
