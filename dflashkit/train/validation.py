"""Validation during training: held-out loss, per-slot accuracy and estimated τ (`validate`), and keep_best's
export of the drafter of the best validation pass to OUT/best (`keep_if_best`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dflashkit.io_utils import atomic_write_text
from dflashkit.train.losses import estimated_tau
from dflashkit.train.packing import collate_rows
from dflashkit.train.run import Run, metric_slots
from dflashkit.train.state import save_final
from dflashkit.train.step import StepDraw, prepare_inputs, step_loss


def keep_if_best(run: Run, val: dict[str, Any] | None) -> Path | None:
    """keep_best: when this validation pass has the highest τ so far, export the drafter to OUT/best (+ best.json).

    Collective (the drafter is gathered on every rank); the validation metrics are all-reduced, so every rank takes
    the same branch. Returns OUT/best when written."""
    st = run.state
    if not run.cfg.keep_best or val is None or (st.best_val_tau is not None and val["tau"] <= st.best_val_tau):
        return None
    st.best_val_tau, st.best_val_step = float(val["tau"]), st.step
    drafter = run.gather_state()[0]
    path = None
    if run.dist.is_main:
        path = save_final(run.out, drafter, step=st.step, name="best")
        atomic_write_text(path / "best.json", json.dumps({"step": st.step, "val": val}, indent=1) + "\n")
    run.dist.barrier()
    return path


@torch.no_grad()
def validate(run: Run) -> dict[str, Any] | None:
    """Held-out loss, per-slot accuracy and estimated τ (fixed anchors, no noise), reduced over ranks."""
    if run.val_rows is None:
        return None
    cfg, dist = run.cfg, run.dist
    run.module.eval()
    bs = metric_slots(run.drafter.config)
    sums = torch.zeros(2 + 2 * bs, dtype=torch.float64, device=run.device)  # Σwℓ, Σw, correct(bs), valid(bs)
    mine = list(range(dist.rank, len(run.val_rows), dist.world_size))
    for k in range(0, len(mine), cfg.batch_rows):
        ids = mine[k : k + cfg.batch_rows]
        rows = collate_rows([run.val_rows[i] for i in ids], ids)
        inp = prepare_inputs(
            rows,
            run.drafter.config,
            StepDraw.from_config(
                cfg,
                -1,
                step=run.state.step,  # a head's step-dependent objective (Domino's λ) scored where training is
                progress=run.state.elapsed_s / (60 * cfg.schedule_minutes) if cfg.schedule_minutes else None,
            ),
            device=run.device,
            mask_dtype=run.autocast_dtype or torch.float32,
        )
        out = step_loss(run, inp, rows, 1.0)
        sums += torch.cat(
            [
                torch.stack([out.loss.double(), out.weight_sum.double()]),
                out.correct_counts.double(),
                out.valid_counts.double(),
            ]
        )
    dist.all_reduce(sums)
    run.module.train()
    acc = (sums[2 : 2 + bs] / sums[2 + bs :].clamp_min(1)).tolist()
    return {
        "loss": float(sums[0] / sums[1].clamp_min(1e-12)),
        "accuracy": acc,
        "tau": estimated_tau(acc),
        "supervised": int(sums[2 + bs + 1 :].sum()),
    }


__all__ = ["keep_if_best", "validate"]
