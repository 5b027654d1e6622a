"""Runs inside .venv-speculators, never importing dflashkit: a `dflashkit convert --to speculators` XPress export
loaded by speculators' own `XPressDraftModel`, its training forward over given anchors (speculators' anchor draw
replaced by them) with the {"ce": 0.1, "tv": 0.9} loss, and every refiner pass it ran.

    .venv-speculators/bin/python speculators_xpress.py EXPORT_DIR INPUTS.pt OUTPUTS.pt

INPUTS.pt:  ids (1, T), features (1, T, K·H), final (1, T, H), doc (1, T) document ids, anchors (list of int),
            gamma (float)
OUTPUTS.pt: kind, hidden (N·bs, H) block states, logits (N·bs, V) backbone logits, targets (N·bs, V) the verifier's,
            mask (N·bs,) aligned loss mask, prevs [(N, bs) previous tokens of each refiner pass: teacher-forced first,
            then the rounds], biases [(N, bs, V) of each pass], loss, metrics (floats)
"""

from __future__ import annotations

import sys

import torch
from speculators import SpeculatorModel
from speculators.losses import resolve_loss_config
from speculators.models.attention import create_float_mask
from speculators.models.dflash import core as dflash_core


def main(export_dir: str, inputs: str, outputs: str) -> None:
    ref = torch.load(inputs)
    model = SpeculatorModel.from_pretrained(export_dir).eval().float()
    model.config.transformer_layer_config._attn_implementation = "eager"
    model._attn_impl, model._create_mask_fn = "eager", create_float_mask
    # speculators 0.9.0's from_pretrained leaves the refiner's non-persistent `causal_tril` buffer uninitialised
    # (transformers builds the model on the meta device and only loads the checkpoint's tensors): set it as its
    # constructor does
    bs = model.block_size
    model.refiner_head.causal_tril = torch.tril(torch.ones(bs, bs))
    anchors = torch.tensor(ref["anchors"], dtype=torch.long)
    n = anchors.numel()
    dflash_core.select_anchors = lambda loss_mask, num, bs: (anchors.clone(), torch.ones(n, dtype=torch.bool))
    seen: dict = {"prevs": [], "biases": []}
    backbone, block_bias = model._backbone_forward, model.refiner_head.block_bias

    def spy_backbone(*args, **kw):
        out = backbone(*args, **kw)
        seen["backbone"] = out
        return out

    def spy_bias(prev, hidden_states=None, hcache=None):
        out = block_bias(prev, hidden_states=hidden_states, hcache=hcache)
        seen["prevs"].append(prev.clone())
        seen["biases"].append(out.detach().clone())
        return out

    model._backbone_forward, model.refiner_head.block_bias = spy_backbone, spy_bias
    seq = ref["ids"].shape[1]
    with torch.no_grad():
        _, loss, metrics = model(
            hidden_states=ref["features"], input_ids=ref["ids"], loss_mask=torch.ones(1, seq, dtype=torch.long),
            verifier_last_hidden_states=ref["final"], document_ids=ref["doc"], max_anchors=n,
            loss_config=resolve_loss_config('{"ce": 0.1, "tv": 0.9}', "eager"), gamma=ref["gamma"],
        )  # fmt: skip
    hidden, logits, targets, mask, _ = seen["backbone"]
    torch.save(
        {
            "kind": type(model).__name__,
            "hidden": hidden[0],
            "logits": logits[0],
            "targets": targets[0],
            "mask": mask[0],
            "prevs": seen["prevs"],
            "biases": seen["biases"],
            "loss": float(loss),
            "metrics": {k: float(v) for k, v in metrics.items()},
        },
        outputs,
    )


if __name__ == "__main__":
    main(*sys.argv[1:4])
