"""`dflashkit train CONFIG.yaml [key=value …]`: train (or resume) a DFlash drafter.

    dflashkit train configs/smollm2.yaml features=runs/smollm2/features out=runs/smollm2/train
    dflashkit train configs/smollm2.yaml max_steps=200 drafter.num_hidden_layers=3
    dflashkit train - tokens=tokens.jsonl online=true          # no YAML: options from the command line only
    torchrun --nproc_per_node 2 $(which dflashkit) train configs/smollm2.yaml

Running the same command again in the same `out` directory resumes from its latest checkpoint. Ctrl-C finishes
the current step, saves a checkpoint and exits with code 130 (stopped, not finished: scripts can tell); a second
Ctrl-C aborts. A run that completes or uses up its time budget exits 0.
"""

from __future__ import annotations

import argparse

from dflashkit.cli import command
from dflashkit.validation import Text, flag


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=flag(Text), help="training config YAML (see configs/smollm2.yaml), or '-' for none")
    # REMAINDER so that `--no-progress` may also follow the overrides (argparse cannot interleave them otherwise)
    p.add_argument(
        "overrides", nargs=argparse.REMAINDER, help="option overrides, key=value (drafter.KEY=VALUE for the drafter)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (e.g. in logs)")


@command("train", "train (or resume) a DFlash drafter from captured or online target features", _train_args)
def _train(args: argparse.Namespace) -> int:
    import torch

    from dflashkit.train.config import TrainConfig
    from dflashkit.train.distributed import read_env
    from dflashkit.train.loop import train

    no_progress = args.no_progress or "--no-progress" in args.overrides
    overrides = [o for o in args.overrides if o != "--no-progress"] + (["progress=false"] if no_progress else [])
    cfg = TrainConfig.load(None if args.config == "-" else args.config, overrides)
    main = read_env()[1] == 0
    if main:
        print(
            f"dflashkit train: {args.config if args.config != '-' else 'command-line options'}\n{cfg.summary()}",
            flush=True,
        )
        note = cfg.cpu_sizing_note(cuda_available=torch.cuda.is_available())
        if note:
            print(f"  note        {note}", flush=True)
    result = train(cfg)
    if main:
        m = result.train_metrics
        last = f"; last loss {m['loss']:.4f}, estimated τ {m['tau']:.2f}" if m else ""
        val = (
            f"; validation loss {result.val_metrics['loss']:.4f}, τ {result.val_metrics['tau']:.2f}"
            if result.val_metrics
            else ""
        )
        print(f"dflashkit train: {result.stopped} at step {result.step} in {result.elapsed_s:.0f} s{last}{val}")
        print(f"  checkpoint  {result.checkpoint}  (resume: run the same command again)")
        if result.final_dir is not None:
            print(f"  drafter     {result.final_dir}  (z-lab format)")
        if result.best_dir is not None:
            print(
                f"  best        {result.best_dir}  (validation τ {result.best_val_tau:.3f} at step "
                f"{result.best_val_step}; keep_best)"
            )
        print(f"  metrics     {result.out_dir / 'metrics.jsonl'}, TensorBoard {result.out_dir / 'tb'}")
    return EXIT_INTERRUPTED if result.stopped == "interrupted" else 0


EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention for a job stopped by Ctrl-C
