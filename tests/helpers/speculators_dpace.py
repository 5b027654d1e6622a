"""Runs inside .venv-speculators, never importing dflashkit: speculators' own D-PACE position weights
(`speculators.losses.dpace_loss_decay`) for per-slot cross-entropies and a validity mask read from a .pt file.

    .venv-speculators/bin/python speculators_dpace.py INPUTS.pt OUTPUTS.pt

INPUTS.pt:  ce (N, γ) float, valid (N, γ) bool, alpha (float)
OUTPUTS.pt: weights (N, γ), as speculators computes them over its flattened (1, N·γ) blocks
"""

from __future__ import annotations

import sys

import torch
from speculators.losses import dpace_loss_decay


def main(inputs: str, outputs: str) -> None:
    ref = torch.load(inputs)
    n, g = ref["ce"].shape
    weights = dpace_loss_decay(
        torch.arange(n * g)[None] % g,
        loss_mask=ref["valid"].reshape(1, -1),
        block_size=g,
        dpace_alpha=float(ref["alpha"]),
        elementwise_loss=ref["ce"].reshape(1, -1),
    )
    torch.save({"weights": weights.reshape(n, g)}, outputs)


if __name__ == "__main__":
    main(*sys.argv[1:3])
