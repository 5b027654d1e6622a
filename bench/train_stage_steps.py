"""Steps the quickstart's training stage makes in M minutes, on a finished quickstart's data, with the dflashkit that
PYTHONPATH names — run a checkout of each commit alternately (old, new, new, old) to compare them at equal minutes.

    PYTHONPATH=/tmp/old-checkout .venv/bin/python bench/train_stage_steps.py --minutes 4 --label old
    .venv/bin/python bench/train_stage_steps.py --minutes 4 --label new

Runs `quickstart.stage_train` (the quickstart's drafter, settings and schedule over the training time itself) in a
temporary directory that links the base run's data/ and features/, so nothing of the base run changes; prints one
JSON line: {"label", "code" (the dflashkit it ran), "seed", "steps", "s_per_step", "stopped"}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import dflashkit
from dflashkit.quickstart.run import QuickstartSettings, stage_train
from dflashkit.target.model import Target


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--base", default="runs/quickstart", help="a finished quickstart run (its data/ and features/)")
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="run")
    args = p.parse_args()
    base = Path(args.base).resolve()
    out = Path(tempfile.mkdtemp(prefix=f"stage-{args.label}-"))
    try:
        (out / "data").symlink_to(base / "data")
        (out / "features").symlink_to(base / "features")
        r = stage_train(Target.load("default"), QuickstartSettings(seed=args.seed), out, args.minutes)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(json.dumps({"label": args.label, "code": dflashkit.__file__, "seed": args.seed, "steps": r["steps"],
                      "s_per_step": r["seconds_per_step"], "stopped": r["stopped"]}))  # fmt: skip


if __name__ == "__main__":
    main()
