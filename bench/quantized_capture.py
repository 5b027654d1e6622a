"""Does training on the numerics a server runs recover acceptance there? Two arms, the same recipe: drafters trained
on the fp32 target (its greedy continuations, its hidden states) and on the Q4_0 GGUF that llama-server loads
(`prepare --target model.Q4_0.gguf`, `capture --target model.Q4_0.gguf`: labels and features from the dequantized
weights), each with several seeds at equal steps, then served by llama-server over the Q4_0 target and,
as the control, the F32 target; acceptance from the server's own counters through `serve-check --server`.

    scripts/build_llamacpp.sh                                       # once
    .venv/bin/python bench/quantized_capture.py --seeds 0,1 --steps 200

Training prompts: ShareGPT (`--train-prompts` conversations, greedy continuations of `--train-tokens`); measured
prompts: MT-Bench turn 1 (`--prompts` × `--max-new-tokens`), none of them trained on. Both arms cost the same per
step (one architecture, one token budget per row), so equal steps are equal minutes; the minutes are printed.
Prints one line per drafter and server, a summary (mean τ per arm and server, the seed spread, the difference), then
ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CLI = [sys.executable, "-m", "dflashkit"]
ROW_TOKENS = 1024


def _run(cmd: list[str], timeout: float) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} … failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quant", default="Q4_0", help="the served GGUF type the second arm trains on")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--train-prompts", type=int, default=64)
    ap.add_argument("--train-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--work", default=None, help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]

    from dflashkit.cpu_products.machine import machine_line
    from dflashkit.data.conversations import prompt_messages
    from dflashkit.evaluate.stats import prompts_for, read_prompts
    from dflashkit.export import llamacpp
    from dflashkit.export.convert import load_any_drafter
    from dflashkit.export.gguf_export import export_gguf
    from dflashkit.export.llama_server import LlamaServer
    from dflashkit.export.served import ServedSettings, check_server
    from dflashkit.target.model import Target

    arms = {"F32": "default", args.quant: str(llamacpp.target_gguf(args.quant))}
    served = {args.quant: llamacpp.target_gguf(args.quant), "F32": llamacpp.f32_target_gguf()}
    print(f"# {machine_line()}; llama.cpp {llamacpp.VERSION}; {len(seeds)} seeds × {args.steps} steps per arm; "
          f"trained on {args.train_prompts} ShareGPT prompts, measured on {args.prompts} MT-Bench prompts × "
          f"{args.max_new_tokens} tokens, greedy", flush=True)  # fmt: skip
    target = Target.load("default")
    records = read_prompts("mtbench", limit=args.prompts)
    prompts, _ = prompts_for(target, records, max_new_tokens=args.max_new_tokens)
    chats = {c.id: prompt_messages(c) for c in (records.conversations or [])}
    items = [SimpleNamespace(id=p.id, ids=list(p.ids), messages=chats.get(p.id)) for p in prompts]

    rows = []
    with tempfile.TemporaryDirectory(prefix="dflashkit-qcap-") as tmp:
        work = Path(args.work or tmp)
        for arm, spec in arms.items():
            prep = work / f"prep-{arm}"
            if not (prep / "tokens.jsonl").is_file():
                t0 = time.monotonic()
                _run([*CLI, "prepare", "--target", spec, "--data", "sharegpt", "--limit", str(args.train_prompts),
                      "--max-new-tokens", str(args.train_tokens), "--out", str(prep), "--compile", "off"],
                     3600)  # fmt: skip
                print(f"prepare {arm}: {time.monotonic() - t0:.0f} s", flush=True)
            fits = prep / "fits.jsonl"  # samples of one packed row (a longer one loses its response to truncation)
            lines = (prep / "tokens.jsonl").read_text().splitlines()
            fits.write_text("".join(f"{x}\n" for x in lines if len(json.loads(x)["input_ids"]) <= ROW_TOKENS))
            features = work / f"capture-{arm}"
            if not (features / "manifest.json").is_file():
                t0 = time.monotonic()
                _run([*CLI, "capture", "--target", spec, "--tokens", str(fits), "--out", str(features),
                      "--dtype", "fp32", "--precision", "fp32", "--compile", "off", "--quiet"], 3600)  # fmt: skip
                print(f"capture {arm}: {time.monotonic() - t0:.0f} s", flush=True)
            for seed in seeds:
                out = work / f"drafter-{arm}-s{seed}"
                t0 = time.monotonic()
                if not (out / "final").is_dir():
                    _run([*CLI, "train", "-", "--no-progress", f"target={spec}", f"features={features}",
                          "drafter.num_hidden_layers=2", "drafter.block_size=4",
                          f"max_steps={args.steps}", f"max_tokens={ROW_TOKENS}", "max_anchors=128", f"seed={seed}",
                          f"out={out}",
                          "tensorboard=false", "dtype=fp32", "compile=off", "save_every=0"], 7200)  # fmt: skip
                minutes = (time.monotonic() - t0) / 60
                drafter = load_any_drafter(str(out / "final"), target=target).eval()
                gguf = out / "drafter.gguf"
                export_gguf(str(out / "final"), gguf, target=llamacpp.f32_target_gguf(), outtype="f32")
                n_max = drafter.config.block_size - drafter.first_draft_slot()
                for kind, path in served.items():
                    extra = ["-md", str(gguf), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(n_max)]
                    with LlamaServer(path, slots=1, threads=2, extra_args=[*extra, "--metrics"]) as srv:
                        report = check_server(target, drafter, srv.url, items,
                                              settings=ServedSettings(args.max_new_tokens))  # fmt: skip
                    e = report.summary()["engine"]
                    row = {"trained_on": arm, "seed": seed, "served": kind, "train_minutes": round(minutes, 2),
                           "drafts": e["drafts"], "accepted_per_pos": e["accepted_per_pos"],
                           "tau": e["tau"]}  # fmt: skip
                    rows.append(row)
                    print(f"trained on {arm:<5} seed {seed}  served {kind:<5} drafts {row['drafts']:>4}  accepted/pos "
                          f"{row['accepted_per_pos']!s:<16} τ {row['tau']:.3f}  ({minutes:.1f} min training)",
                          flush=True)  # fmt: skip

    summary = {}
    for kind in served:
        per_arm = {arm: [r["tau"] for r in rows if r["served"] == kind and r["trained_on"] == arm] for arm in arms}
        summary[kind] = {
            arm: {"mean": round(statistics.fmean(v), 4), "spread": round(max(v) - min(v), 4)}
            for arm, v in per_arm.items()
        }
        a, b = (summary[kind][arm] for arm in arms)
        diff = b["mean"] - a["mean"]
        beyond = abs(diff) > max(a["spread"], b["spread"])
        summary[kind]["difference"] = round(diff, 4)
        summary[kind]["beyond_seed_spread"] = beyond
        print(f"served {kind:<5}: τ trained on F32 {a['mean']:.3f} (spread {a['spread']:.3f}), on {args.quant} "
              f"{b['mean']:.3f} (spread {b['spread']:.3f}); difference {diff:+.3f}"
              f"{' beyond' if beyond else ' within'} the seed spread", flush=True)  # fmt: skip
    print(json.dumps({"bench": "quantized_capture", "machine": machine_line(), "quant": args.quant, "seeds": seeds,
                      "steps": args.steps, "rows": rows, "summary": summary}))  # fmt: skip


if __name__ == "__main__":
    main()
