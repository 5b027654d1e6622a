"""Runs inside .venv-speculators, never importing dflashkit: speculators' own D-PACE — its position weights
(`speculators.losses.dpace_loss_decay`) and its DSpark + D-PACE loss (`models/dspark/metrics.py::compute_metrics`
with `--loss-fn ce --per-position-loss-weight dpace`: hard-label CE weighted by D-PACE, the confidence BCE on the
fixed exp(−k/4) decay; the eager kernels, not the Triton ones) — for tensors read from a .pt file.

    .venv-speculators/bin/python speculators_dpace.py INPUTS.pt OUTPUTS.pt

INPUTS.pt:  ce (N, γ), valid (N, γ) bool, alpha; and for the loss: logits (N, γ, V) Markov-corrected draft logits,
            targets (N, γ, V) the target's logits (their argmax is the label), confidence (N, γ) logits
OUTPUTS.pt: weights (N, γ); loss (scalar) when the loss inputs were given
"""

from __future__ import annotations

import sys

import torch
from speculators.losses import dpace_loss_decay
from speculators.losses.eager import ce_loss, tv_loss
from speculators.models.dspark.metrics import compute_metrics


def main(inputs: str, outputs: str) -> None:
    ref = torch.load(inputs)
    n, g = ref["ce"].shape
    alpha = float(ref["alpha"])
    mask = ref["valid"].reshape(1, -1)  # (1, N·γ): speculators flattens the blocks
    weights = dpace_loss_decay(
        torch.arange(n * g)[None] % g,
        loss_mask=mask,
        block_size=g,
        dpace_alpha=alpha,
        elementwise_loss=ref["ce"].reshape(1, -1),
    )
    out = {"weights": weights.reshape(n, g)}
    if "logits" in ref:
        v = ref["logits"].shape[-1]
        loss, _ = compute_metrics(
            ref["logits"].reshape(1, n * g, v),
            ref["targets"].reshape(1, n * g, v),
            ref["confidence"].reshape(1, n * g),
            mask.to(torch.float32),
            g,
            loss_config={"ce": (ce_loss, 1.0)},
            tv_loss_fn=tv_loss,
            confidence_head_alpha=1.0,
            per_position_loss_weight="dpace",
            dpace_alpha=alpha,
            sample_from_anchor=True,
        )
        out["loss"] = loss
    torch.save(out, outputs)


if __name__ == "__main__":
    main(*sys.argv[1:3])
