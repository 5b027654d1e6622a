"""τ against context length at equal training minutes: the quickstart's short-row drafter against drafters trained
with long rows, with and without a sliding-window layer.

    .venv/bin/python bench/long_context.py                                    # runs/quickstart's data, seeds 0,1
    .venv/bin/python bench/long_context.py --seeds 0,1,2 --train-minutes 3 --sim-prompts 4

Variants (bench/sweep_defaults.py, the quickstart's training stage with one change, each trained for the same
wall-clock minutes on the same machine, seeds interleaved):
    base            the quickstart's drafter: its data, rows of ≤ 1024 tokens, a full-attention layer
    long_rows       + the target's replies to long training prompts (`prepare --data long-context-train`:
                    training-split chats and package sources, 512 … ~4k tokens), rows of ≤ 4096 tokens
    long_rows_swa   the same with the drafter's layer sliding-window (window 1024)
Every drafter is then scored by one teacher-forced simulation (`dflashkit simulate --dataset long-context`, chain
and DDTree) on the long-context evaluation set (held-out chats and other package sources, `--sim-prompts` per
length, 512 … 8192 tokens capped by the target's context), τ per prompt-length bucket. Writes OUT/long_context.json,
OUT/long_context.md (τ micro per bucket, mean ± half-range over seeds, the half-range being the noise a difference
must beat) and OUT/long_context.png (τ against context length, one line per variant and method).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sweep_defaults

VARIANTS = ("base", "long_rows", "long_rows_swa")


def _say(msg: str) -> None:
    print(f"[long-context] {msg}", flush=True)


def table(doc: dict[str, Any], rows: list[dict[str, Any]], method: str) -> tuple[str, dict[str, dict[str, Any]]]:
    """Markdown: one row per variant, τ micro per length bucket (mean ± half-range over seeds); and the numbers."""
    buckets: list[str] = []
    for r in rows:
        buckets += [b for b in doc["results"][r["name"]][method].get("by_length", {}) if b not in buckets]
    numbers: dict[str, dict[str, Any]] = {}
    lines = [
        f"| variant ({method}) | " + " | ".join(buckets) + " | all |",
        "| --- |" + " --- |" * (len(buckets) + 1),
    ]
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [doc["results"][r["name"]][method] for r in rows if r["variant"] == variant]
        cells, numbers[variant] = [], {}
        for b in [*buckets, "all"]:
            vals = [(st if b == "all" else st.get("by_length", {}).get(b, {})).get("tau_micro") for st in mine]
            vals = [v for v in vals if v is not None]
            if not vals:
                cells.append("—")
                continue
            mean, half = statistics.fmean(vals), (max(vals) - min(vals)) / 2
            numbers[variant][b] = {"mean": round(mean, 4), "half_range": round(half, 4), "n": len(vals)}
            cells.append(f"{mean:.3f} ± {half:.3f}")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines), numbers


def plot(numbers: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for label, per in numbers.items():
        buckets = [b for b in per if b != "all"]
        ax.errorbar(
            range(len(buckets)),
            [per[b]["mean"] for b in buckets],
            yerr=[per[b]["half_range"] for b in buckets],
            marker="o",
            capsize=3,
            label=label,
        )
        ax.set_xticks(range(len(buckets)), buckets)
    ax.set_xlabel("prompt length (tokens, bucket)")
    ax.set_ylabel("τ micro (mean ± half-range over seeds)")
    ax.set_title("Acceptance against context length, equal training minutes")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base", default="runs/quickstart", help="a finished quickstart run (its data)")
    p.add_argument("--out", default="runs/long-context")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--train-minutes", type=float, default=3.0)
    p.add_argument("--sim-prompts", type=int, default=3, help="long-context prompts per length")
    p.add_argument("--sim-max-new-tokens", type=int, default=96)
    p.add_argument("--budgets", default="4")
    args = p.parse_args(argv)

    import torch

    from dflashkit.cli import main as cli
    from dflashkit.target.model import Target

    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    base, out = Path(args.base), Path(args.out)
    torch.manual_seed(0)
    target = Target.load("default")
    rows = []
    for name, seed in sweep_defaults.interleaved(list(VARIANTS), seeds):
        _say(f"train {name} seed {seed} for {args.train_minutes} min")
        r = sweep_defaults.run_variant(target, name, sweep_defaults.VARIANTS[name], base, out, args.train_minutes, seed)
        rows.append({**r, "variant": name})
    sim = out / "sim"
    from dflashkit.evaluate.groups import LENGTH_BUCKETS

    limit = str(args.sim_prompts * len(LENGTH_BUCKETS))  # prompts in all, spread over the lengths
    argv_sim = ["simulate", "--dataset", "long-context", "--limit", limit, "--budgets", args.budgets]
    argv_sim += ["--max-new-tokens", str(args.sim_max_new_tokens), "--cache", str(out / "sim_cache"), "--quiet"]
    argv_sim += ["--out", str(sim), *[a for r in rows for a in ("--drafter", f"{r['name']}={r['drafter']}")]]
    if cli(argv_sim) != 0:
        raise SystemExit("error: the simulation failed (see above)")
    doc = json.loads((sim / "results.json").read_text())
    methods = ["chain", *[f"ddtree:{b}" for b in args.budgets.split(",") if b]]
    text, numbers = [], {}
    for m in methods:
        t, numbers[m] = table(doc, rows, m)
        text.append(t)
    plot({f"{v} · {m}": per for m, by in numbers.items() for v, per in by.items()}, out / "long_context.png")
    (out / "long_context.json").write_text(
        json.dumps({"rows": rows, "numbers": numbers, "seeds": seeds, "args": vars(args)}, indent=1) + "\n"
    )
    header = (
        f"# τ micro per context length (teacher-forced, long-context set, {args.sim_prompts} prompts per length; "
        f"mean ± half-range over seeds {seeds}; {args.train_minutes} training minutes each)\n\n"
    )
    (out / "long_context.md").write_text(header + "\n\n".join(text) + "\n\n![τ by length](long_context.png)\n")
    print("\n\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
