"""Runs inside .venv-speculators, never importing dflashkit: a `dflashkit convert --to speculators` DFlash2 export
loaded by speculators' own `DFlash2DraftModel`, its training forward on one anchor block and its selector objective
(gold token injected at rank K).

    .venv-speculators/bin/python speculators_dflash2.py EXPORT_DIR INPUTS.pt OUTPUTS.pt

INPUTS.pt:  ids (1, T), features (1, T, K·H), final (1, T, H), anchor (int p), gamma (float)
OUTPUTS.pt: kind, hidden (bs, H), logits (bs, V) unary, target_ids (bs,) the verifier's argmax, predecessors (bs,),
            candidates (bs, K) training candidates, scores (bs, K), ce (bs,) per-slot selector CE, loss (the selector
            term as speculators reduces it: Σ decay·CE over the block / valid slots), contains (bs,) gold in top-K.
"""

from __future__ import annotations

import sys

import torch
from speculators import SpeculatorModel
from speculators.models.attention import create_float_mask
from speculators.models.dflash2.metrics import compute_selector_loss, selector_training_candidates


def main(export_dir: str, inputs: str, outputs: str) -> None:
    ref = torch.load(inputs)
    model = SpeculatorModel.from_pretrained(export_dir).eval().float()
    model.config.transformer_layer_config._attn_implementation = "eager"
    model._attn_impl, model._create_mask_fn = "eager", create_float_mask
    ids, p = ref["ids"], int(ref["anchor"])
    seq = ids.shape[1]
    loss_mask = torch.zeros(1, seq, dtype=torch.long)
    loss_mask[0, p] = 1
    with torch.no_grad():
        hidden, logits, targets, aligned, block_idx = model._backbone_forward(
            ref["features"], ids, loss_mask, ref["final"], torch.zeros(1, seq, dtype=torch.long), max_anchors=1
        )
        prev = model._predecessor_ids(ids, block_idx)  # (1, bs)
        target_ids = targets.argmax(-1)  # (1, bs)
        cand = logits.topk(model.candidate_selector.top_k, dim=-1).indices
        train_cand, positions, contains = selector_training_candidates(cand, target_ids)
        scores = model.candidate_selector.score_candidates(logits, hidden, prev.reshape(1, -1), train_cand)
        ce = torch.nn.functional.cross_entropy(scores[0], positions[0], reduction="none")
        valid = torch.ones_like(aligned)  # every slot of the block counts (slot 0 has decay weight 0)
        loss = compute_selector_loss(
            scores, positions, valid, model.block_size, gamma=ref["gamma"], per_position_loss_weight="fixed-exp-decay",
            dpace_alpha=0.5,
        )  # fmt: skip
    torch.save(
        {
            "kind": type(model).__name__,
            "hidden": hidden[0],
            "logits": logits[0],
            "target_ids": target_ids[0],
            "predecessors": prev[0],
            "candidates": train_cand[0],
            "scores": scores[0],
            "ce": ce,
            "loss": loss,
            "contains": contains[0],
        },
        outputs,
    )


if __name__ == "__main__":
    main(*sys.argv[1:4])
