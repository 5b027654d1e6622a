"""Runs inside .venv-speculators, never importing dflashkit: speculators' own eager acceptance-rate losses
(`speculators.losses.eager`: `tv_loss`, `neg_log_acceptance_loss`, `lk_hybrid_loss`) per position, for tensors read
from a .pt file.

    .venv-speculators/bin/python speculators_losses.py INPUTS.pt OUTPUTS.pt

INPUTS.pt:  logits (M, V) draft logits, targets (M, V) target logits, eta (the hybrid's η)
OUTPUTS.pt: tv, nla, lk_hybrid — each (M,) float32, one value per position
"""

from __future__ import annotations

import sys

import torch
from speculators.losses.eager import lk_hybrid_loss, neg_log_acceptance_loss, tv_loss


def main(inputs: str, outputs: str) -> None:
    ref = torch.load(inputs)
    logits, targets = ref["logits"][None], ref["targets"][None]  # (1, M, V): speculators' [batch, seq, vocab]
    out = {
        "tv": tv_loss(logits, targets)[0],
        "nla": neg_log_acceptance_loss(logits, targets)[0],
        "lk_hybrid": lk_hybrid_loss(logits, targets, eta=float(ref["eta"]))[0],
    }
    torch.save(out, outputs)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
