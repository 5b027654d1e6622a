"""How the quickstart's defaults were chosen: train variants under the same wall-clock budget, compare their τ.

    .venv/bin/python bench/sweep_defaults.py                      # every variant below, on runs/quickstart's data
    .venv/bin/python bench/sweep_defaults.py --variants lr3e-3,features3 --train-minutes 4 --sim-prompts 8

Each variant is the quickstart's training stage (`quickstart.stage_train`: warmup + cosine over the training
time itself, so every variant ends with its learning rate decayed) with one setting changed, on the data of a finished quickstart
run (`--base`, default runs/quickstart: its regenerated responses, tokens and captured features). Variants that
change the amount of regenerated data rebuild it from the base run's responses (a prefix of them, in
regeneration order) or extend it by regenerating more (the same prompts order the quickstart uses), then capture
again. All drafters are then scored by one teacher-forced simulation (`dflashkit simulate`: chain and DDTree
budgets) on held-out MT-Bench turn-1 prompts; the table prints τ next to the training stats of each variant.

Variants run one after another (the machine must otherwise be idle: budgets are wall-clock) and are resumable:
a variant whose `OUT/NAME/done.json` exists is not trained again. "base" is the base run's own drafter when its
settings are the current defaults (it is the same training), else it is trained here like the others.
Writes OUT/sweep.json and OUT/sweep.md (plus the simulation's results.json, report.md and PNGs in OUT/sim).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from dflashkit.quickstart import QuickstartSettings, stage_capture, stage_prepare, stage_train, step_seconds

# name → (settings changes, data plan). Data plan: "fraction" keeps that share of the base responses, "more_regen_
# minutes" regenerates that much more; "train_scale" multiplies the training budget (the regeneration/training
# split: the base run spent 6 min regenerating and 9 training).
VARIANTS: dict[str, dict[str, Any]] = {
    "base": {},
    "lr3e-3": {"settings": {"lr": 3e-3}},
    "features3": {"settings": {"drafter_extra": {"num_features": 3}}},
    "mlp896": {"settings": {"drafter_extra": {"intermediate_size": 896}}},
    "regen9_train6": {"more_regen_minutes": 3.0, "train_scale": 6 / 9},
    "regen3_train12": {"fraction": 0.5, "train_scale": 12 / 9},
    "lr7.5e-4": {"settings": {"lr": 7.5e-4}},
    "block4_anchors128": {"settings": {"block_size": 4, "max_anchors": 128}},   # same block tokens per row
    "seed1": {"settings": {"seed": 1}},   # the base again with another seed: how large is the noise?
}


def _say(msg: str) -> None:
    print(f"[sweep] {msg}", flush=True)


def _link(src: Path, dst: Path) -> None:
    if not dst.exists():
        dst.symlink_to(src.resolve(), target_is_directory=src.is_dir())


def _prepare_data(target: Any, spec: dict[str, Any], s: QuickstartSettings, base: Path, out: Path) -> dict[str, Any]:
    """Data and features of a variant in `out` (links to the base run's unless the variant changes the data)."""
    from dflashkit.data import write_tokens
    from dflashkit.info import default_drafter_config
    from dflashkit.regenerate import read_regenerated

    layer_ids = default_drafter_config(target, **s.drafter_overrides()).target_layer_ids
    if "fraction" not in spec and "more_regen_minutes" not in spec:
        _link(base / "data", out / "data")
        _link(base / "features", out / "features")
        return {"data": "base"}
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {}
    if "fraction" in spec:  # a prefix of the base run's responses, tokenised as the quickstart does
        records = read_regenerated(base / "data" / "regenerated.jsonl")
        records = records[: max(1, round(spec["fraction"] * len(records)))]
        with open(data / "regenerated.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        tokens = write_tokens(target.tokenizer, [(r["id"], r["messages"], r["response_token_ids"]) for r in records],
                              data / "tokens.jsonl", max_length=1024, min_supervised=2)
        info.update({"responses": len(records), "supervised_tokens": tokens.supervised})
    else:  # the quickstart's own prepare stage continues the base run's responses (and writes tokens.jsonl)
        if not (data / "regenerated.jsonl").exists():
            shutil.copyfile(base / "data" / "regenerated.jsonl", data / "regenerated.jsonl")
        t0 = time.monotonic()
        more = replace(s, regen_minutes=spec["more_regen_minutes"])
        prep = stage_prepare(target, more, out, time.monotonic() + 60 * more.regen_minutes)
        info.update({"regen_minutes_added": round((time.monotonic() - t0) / 60, 2),
                     "responses": prep["conversations"], "supervised_tokens": prep["supervised_tokens"]})
    t0 = time.monotonic()
    stage_capture(target, layer_ids, out)
    info["capture_minutes"] = round((time.monotonic() - t0) / 60, 2)
    return info


def run_variant(target: Any, name: str, spec: dict[str, Any], base: Path, out_root: Path,
                train_minutes: float) -> dict[str, Any]:
    out = out_root / name
    done = out / "done.json"
    if done.is_file():
        return json.loads(done.read_text())
    s = QuickstartSettings(**{**asdict(QuickstartSettings()), **spec.get("settings", {})})
    base_state = base / "quickstart.json"
    if name == "base" and base_state.is_file():
        state = json.loads(base_state.read_text())
        if {**asdict(s), **state.get("settings", {}), "out": s.out} == asdict(s) and "train" in state.get("done", {}):
            result = {"name": name, "drafter": str(base / "drafter"), "train": state["done"]["train"],
                      "seconds_per_step": step_seconds(base / "train" / "metrics.jsonl"), "data": {"data": "base"},
                      "train_minutes": s.train_minutes, "reused": str(base)}
            out.mkdir(parents=True, exist_ok=True)
            done.write_text(json.dumps(result, indent=1) + "\n")
            return result
    out.mkdir(parents=True, exist_ok=True)
    _say(f"{name}: data")
    data = _prepare_data(target, spec, s, base, out)
    minutes = train_minutes * float(spec.get("train_scale", 1.0))
    _say(f"{name}: training for {minutes:g} min")
    train = stage_train(target, s, out, minutes)
    result = {"name": name, "drafter": train["final"], "train": train, "data": data, "train_minutes": minutes,
              "seconds_per_step": step_seconds(out / "train" / "metrics.jsonl"),
              "settings_changed": spec.get("settings", {})}
    done.write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default=QuickstartSettings().out, help="a finished quickstart run (its data)")
    p.add_argument("--out", default="runs/sweep")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {list(VARIANTS)}")
    p.add_argument("--train-minutes", type=float, default=QuickstartSettings().train_minutes)
    p.add_argument("--sim-prompts", type=int, default=16, help="held-out MT-Bench turn-1 prompts to simulate")
    p.add_argument("--sim-max-new-tokens", type=int, default=QuickstartSettings().eval_max_new_tokens)
    p.add_argument("--sim-cache", default="runs/sim_cache", help="transcript cache (built once, reused)")
    p.add_argument("--budgets", default="4,8")
    args = p.parse_args(argv)

    import torch

    from dflashkit.cli import main as cli
    from dflashkit.target import Target

    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"error: --variants: unknown {unknown}; expected names from {list(VARIANTS)}")
    base, out_root = Path(args.base), Path(args.out)
    if not (base / "features" / "manifest.json").is_file() or not (base / "data" / "regenerated.jsonl").is_file():
        raise SystemExit(f"error: --base {base}: not a finished quickstart run (needs data/regenerated.jsonl and "
                         f"features/); run `dflashkit quickstart --out {base}` first")
    torch.manual_seed(0)
    target = Target.load("default")
    rows = [run_variant(target, n, VARIANTS[n], base, out_root, args.train_minutes) for n in names]
    sim = out_root / "sim"
    cli(["simulate", "--dataset", "mtbench", "--limit", str(args.sim_prompts), "--max-new-tokens",
         str(args.sim_max_new_tokens), "--cache", args.sim_cache, "--budgets", args.budgets,
         "--out", str(sim), "--quiet", *[a for r in rows for a in ("--drafter", f"{r['name']}={r['drafter']}")]])
    doc = json.loads((sim / "results.json").read_text())
    methods = ["chain", *[f"ddtree:{b}" for b in args.budgets.split(",") if b]]
    lines = ["| variant | change | train min | steps | s/step | val loss | " + " | ".join(f"τ {m}" for m in methods)
             + " |", "|---" * (6 + len(methods)) + "|"]
    for r in rows:
        res = doc["results"][r["name"]]
        change = json.dumps(r.get("settings_changed") or {k: v for k, v in VARIANTS[r["name"]].items()
                                                          if k != "settings"}) if r["name"] != "base" else "—"
        val = (r["train"].get("val") or {}).get("loss")
        r["tau"] = {m: res[m]["tau_macro"] for m in methods}
        lines.append(f"| {r['name']} | `{change}` | {r['train_minutes']:g} | {r['train']['steps']} | "
                     f"{r['seconds_per_step']:.2f} | {val if val is None else round(val, 3)} | "
                     + " | ".join(f"{r['tau'][m]:.3f}" for m in methods) + " |")
    table = "\n".join(lines)
    (out_root / "sweep.json").write_text(json.dumps({"rows": rows, "sim": str(sim / "results.json")}, indent=1) + "\n")
    (out_root / "sweep.md").write_text(f"# Quickstart default sweep (τ macro, {args.sim_prompts} held-out MT-Bench "
                                       f"turn-1 prompts, teacher-forced)\n\n{table}\n")
    print(table)
    print(json.dumps({r["name"]: r["tau"] for r in rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
