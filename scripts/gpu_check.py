"""The CUDA path in one prepared check: a tiny random Qwen3 target and every drafter head through the pipeline a user
runs — prepare → capture → train (bf16 autocast, flex attention on CUDA) → eval chain and DDTree, greedy-equal to
the target's own decoding → convert — then training under torchrun on one rank (DDP's process group, FSDP2) over
NCCL, and each head's measured peak memory against the estimate `plan` and train's pre-flight use.

    bash scripts/gpu_check.sh                 # on a machine with one GPU and its own CUDA torch (no network)
    bash scripts/gpu_check.sh --dry           # the same steps on this CPU, fp32 and gloo (CI keeps it runnable)

Writes OUT/gpu_check.json and OUT/gpu_check.md (OUT: --out, else $OUT, else runs/gpu_check); exits 1 when a step
fails or an output is not greedy-equal outside a near-tie. Every step prints one line with its seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# A Qwen3 small enough for seconds per step anywhere, large enough for every head (8 layers: 5 features, 1 … 5).
TINY_QWEN3 = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, max_position_embeddings=2048, rope_theta=1_000_000.0, tie_word_embeddings=True,
)  # fmt: skip
CONVERT_TO = ("zlab", "speculators", "vllm")  # GGUF needs the target as a GGUF: the llamacpp tests


class Check:
    """The steps run so far: each a name, seconds, ok, and what it found."""

    def __init__(self, device: str) -> None:
        self.device, self.steps = device, []

    def cli(self, name: str, argv: list[str], *, refusal_ok: bool = False) -> int:
        """One dflashkit command in this process (no start-up per step); exit 2 is a refusal by name."""
        from dflashkit.cli import main

        t0 = time.monotonic()
        rc = main(argv)
        ok = rc == 0 or (refusal_ok and rc == 2)
        self.record(name, time.monotonic() - t0, ok, "refused by name" if rc == 2 and refusal_ok else f"exit {rc}")
        return rc

    def record(self, name: str, seconds: float, ok: bool, found: str) -> None:
        self.steps.append({"step": name, "seconds": round(seconds, 1), "ok": ok, "found": found})
        print(f"{'ok  ' if ok else 'FAIL'} {name:<44} {seconds:6.1f} s  {found}", flush=True)


def tiny_target(path: Path) -> Path:
    """A random Qwen3 with the embedded default's tokenizer (its chat template), saved as a model directory."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflashkit.target.model import Target

    if (path / "config.json").is_file():
        return path
    tokenizer = Target.load("default").tokenizer
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tokenizer), **TINY_QWEN3)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def greedy_equal(progress: Path) -> tuple[int, int, int]:
    """(runs equal to AR, near-tie departures, other departures) over an eval's progress.jsonl."""
    equal = near = other = 0
    for line in progress.read_text().splitlines():
        for methods in json.loads(line)["runs"].values():
            for run in methods.values():
                verdict = (run.get("divergence") or {}).get("verdict")
                equal += bool(run.get("greedy_equal"))
                near += verdict == "near_tie"
                other += not run.get("greedy_equal") and verdict != "near_tie"
    return equal, near, other


def measured_peak(check: Check, kind: str, target: Path, tokens: Path, run: Path) -> None:
    """Train a few steps in process and compare the device's peak with the pre-flight's estimate of that run."""
    import torch

    from dflashkit.train.loop import train
    from dflashkit.train.memory_check import run_memory

    if not check.device.startswith("cuda"):  # the allocator's peak is measured on CUDA; CPU tests compare RSS
        estimate = run_memory(_peak_config(kind, target, tokens, run, check.device), device=torch.device("cpu")).peak
        check.record(f"{kind}: memory estimate", 0.0, True, f"{estimate / 2**20:.0f} MiB (peak measured on CUDA)")
        return
    cfg = _peak_config(kind, target, tokens, run, check.device)
    t0 = time.monotonic()
    estimate = run_memory(cfg, device=torch.device(check.device)).peak
    torch.cuda.reset_peak_memory_stats()
    train(cfg)
    peak = torch.cuda.max_memory_allocated()
    ratio = peak / estimate
    found = f"peak {peak / 2**20:.0f} MiB, estimate {estimate / 2**20:.0f} MiB (×{ratio:.2f})"
    check.record(f"{kind}: peak memory vs estimate", time.monotonic() - t0, 0.5 <= ratio <= 1.15, found)


def _peak_config(kind: str, target: Path, tokens: Path, run: Path, device: str) -> Any:
    from dflashkit.train.config import TrainConfig

    return TrainConfig(
        out=str(run), target=str(target), tokens=str(tokens), online=True,
        drafter={"kind": kind, "block_size": 8, "num_hidden_layers": 1},
        max_steps=3, progress=False, tensorboard=False, save_every=0, drafter_device=device, target_device=device,
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="on this CPU: fp32, gloo, the same steps")
    ap.add_argument("--out", default=None)
    ap.add_argument("--heads", default=None, help="comma-separated kinds (default: every registered head)")
    ap.add_argument("--steps", type=int, default=30, help="training steps per head")
    args = ap.parse_args()
    import torch

    from dflashkit.drafter.heads import HEADS

    out = Path(args.out or os.environ.get("OUT") or ROOT / "runs" / "gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    if not args.dry and not torch.cuda.is_available():
        print("scripts/gpu_check.sh: no CUDA device answers torch.cuda.is_available(); --dry runs on the CPU")
        return 2
    device = "cpu" if args.dry else "cuda"
    machine = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (dry run)"
    print(f"# {machine}; torch {torch.__version__}; CUDA {torch.version.cuda}", flush=True)
    check = Check(device)
    dev = ["--device", device]
    # on a CPU the measured choices (precision, compile) would time trials; a GPU runs bf16 autocast and flex
    quick = ["dtype=fp32", "compile=off"] if args.dry else []
    target = tiny_target(out / "target")
    tokens = out / "data"
    check.cli("prepare (tiny Qwen3, 8 prompts)", ["prepare", "--target", str(target), *dev, "--data", "sharegpt",
              "--limit", "8", "--max-new-tokens", "32", "--out", str(tokens), "--compile", "off"])  # fmt: skip
    features = out / "capture"
    check.cli("capture (DFlash's layers)", ["capture", "--target", str(target), *dev, "--tokens",
              str(tokens / "tokens.jsonl"), "--out", str(features), "--compile", "off", "--quiet"])  # fmt: skip
    kinds = args.heads.split(",") if args.heads else list(HEADS)
    for kind in kinds:
        run = out / f"train-{kind}"
        rc = check.cli(f"{kind}: train {args.steps} steps", ["train", "-", "--no-progress", f"target={target}",
                       f"tokens={tokens / 'tokens.jsonl'}", "online=true", f"out={run}", f"max_steps={args.steps}",
                       f"drafter.kind={kind}",
                       "drafter.block_size=8", "drafter.num_hidden_layers=1", "tensorboard=false", "save_every=0",
                       f"drafter_device={device}", f"target_device={device}", *quick])  # fmt: skip
        if rc != 0:
            continue
        ev = out / f"eval-{kind}"
        t0 = time.monotonic()
        rc = check.cli(f"{kind}: eval chain + ddtree:4", ["eval", "--target", str(target), *dev, "--drafter",
                       f"{kind}={run / 'final'}", "--methods", "ar,chain,ddtree:4", "--dataset", "mtbench", "--limit",
                       "3", "--max-new-tokens", "32", "--out", str(ev), "--no-warmup", "--compile", "off",
                       "--quiet"])  # fmt: skip
        if rc == 0:
            equal, near, other = greedy_equal(ev / "progress.jsonl")
            check.record(f"{kind}: greedy-equal to the target", time.monotonic() - t0, other == 0,
                         f"{equal} equal, {near} near-tie departures, {other} other")  # fmt: skip
        for fmt in CONVERT_TO:
            check.cli(f"{kind}: convert --to {fmt}", ["convert", str(run / "final"), str(out / f"convert-{kind}-{fmt}"),
                      "--to", fmt], refusal_ok=True)  # fmt: skip
        measured_peak(check, kind, target, tokens / "tokens.jsonl", out / f"peak-{kind}")
    launcher = out / "dflashkit_cli.py"
    launcher.write_text("import sys\nfrom dflashkit.cli import main\nsys.exit(main())\n")
    for layout, extra in (("DDP", []), ("FSDP2", ["fsdp=true"])):
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--standalone", str(launcher),
               "train", "-", "--no-progress", f"target={target}", f"features={features}", "max_steps=5",
               f"out={out / ('torchrun-' + layout.lower())}", "drafter.block_size=8", "tensorboard=false",
               "save_every=0", *quick, *extra]  # fmt: skip
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        tail = (proc.stderr.strip().splitlines() or [""])[-1][:160]
        backend = "nccl" if device == "cuda" else "gloo"
        check.record(f"torchrun 1 rank, {layout} ({backend})", time.monotonic() - t0, proc.returncode == 0,
                     "trained 5 steps" if proc.returncode == 0 else tail)  # fmt: skip
    ok = all(s["ok"] for s in check.steps)
    report = {"machine": machine, "torch": torch.__version__, "cuda": torch.version.cuda, "device": device,
              "ok": ok, "steps": check.steps, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    rows = [f"| {s['step']} | {'ok' if s['ok'] else 'FAIL'} | {s['seconds']} | {s['found']} |" for s in check.steps]
    (out / "gpu_check.md").write_text(
        f"# gpu_check on {machine} (torch {torch.__version__}, CUDA {torch.version.cuda}), {report['date']}\n\n"
        "| step | result | s | found |\n| --- | --- | --- | --- |\n" + "\n".join(rows) + "\n"
    )
    print(f"{'all steps passed' if ok else 'FAILED'}: {out / 'gpu_check.md'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
