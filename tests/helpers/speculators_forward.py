"""Runs inside .venv-speculators, never importing dflashkit: loads a `dflashkit convert --to speculators` export with
speculators' own model class (`SpeculatorModel.from_pretrained`, which takes the embeddings and the verifier's tables
from `speculators_config.verifier.name_or_path`) and runs its training forward on one anchor block.

    .venv-speculators/bin/python speculators_forward.py EXPORT_DIR INPUTS.pt OUTPUTS.pt

INPUTS.pt:  ids (1, T), features (1, T, K·H) in aux_hidden_state_layer_ids order, final (1, T, H), anchor (int p)
OUTPUTS.pt: kind, hidden (γ, H) final-normed block states, logits (γ, V') — with DSpark's Markov bias, the previous
            tokens teacher-forced as in speculators' training — and, for DSpark, confidence (γ,) logits.

Attention runs eagerly (speculators' float mask): its default flex attention compiles, which a CPU check need not.
"""

from __future__ import annotations

import sys

import torch
from speculators import SpeculatorModel
from speculators.models.attention import create_float_mask


def main(export_dir: str, inputs: str, outputs: str) -> None:
    ref = torch.load(inputs)
    model = SpeculatorModel.from_pretrained(export_dir).eval().float()
    model.config.transformer_layer_config._attn_implementation = "eager"
    model._attn_impl, model._create_mask_fn = "eager", create_float_mask
    ids, p = ref["ids"], int(ref["anchor"])
    seq = ids.shape[1]
    loss_mask = torch.zeros(1, seq, dtype=torch.long)
    loss_mask[0, p] = 1  # the one valid anchor: speculators' random anchor choice can only pick p
    with torch.no_grad():
        hidden, logits, _, _, block_idx = model._backbone_forward(
            ref["features"], ids, loss_mask, ref["final"], torch.zeros(1, seq, dtype=torch.long), max_anchors=1
        )
        out = {"kind": type(model).__name__, "block_positions": block_idx, "hidden": hidden[0]}
        logits = logits[0]  # (γ, V')
        if getattr(model, "markov_head", None) is not None:
            prev = ids[0, block_idx].view(1, -1)  # sample_from_anchor: slot k's previous token is the one at p + k
            emb = model.markov_head.prev_embeddings(prev)  # (1, γ, r)
            logits = logits + model.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden, prev_emb=emb)[0]
            out["confidence"] = model.confidence_head(torch.cat([hidden[0], emb[0].to(hidden.dtype)], dim=-1))
        out["logits"] = logits
    torch.save(out, outputs)


if __name__ == "__main__":
    main(*sys.argv[1:4])
