"""Runs inside .venv-speculators (z-lab's `dflash` 0.1.0 installed there), never importing dflashkit: z-lab's own
`DFlash2DraftModel` drafts one block from a drafter directory, or first builds one (random weights, its convolutions
and selector moved off their identity / initial values) and saves it with `save_pretrained`.

    .venv-speculators/bin/python dflash_reference.py load DRAFTER_DIR INPUTS.pt OUTPUTS.pt
    .venv-speculators/bin/python dflash_reference.py save DRAFTER_DIR INPUTS.pt OUTPUTS.pt   (DRAFTER_DIR holds a
                                                                                             config.json to build from)

INPUTS.pt:  features (1, Tc, K·H) the context, noise (1, bs, H) the block's embeddings (input_embedding_scale applied,
            as z-lab's generate does), positions (1, Tc + bs), lm_head (V, H), anchor (int, the block's given token)
OUTPUTS.pt: hidden (bs − 1, H) the draft slots' final-normed states, logits (bs − 1, V) unary logits (output
            multiplier and softcap applied), candidates (bs − 1, K), path (bs − 1,) the greedy walk, scores (bs − 1, K)
            each slot's selector scores given its predecessor on that walk.
"""

from __future__ import annotations

import sys

import torch
from dflash.model import DFlash2DraftModel
from torch import nn
from transformers import AutoConfig


def main(mode: str, drafter_dir: str, inputs: str, outputs: str) -> None:
    ref = torch.load(inputs)
    if mode == "save":
        config = AutoConfig.from_pretrained(drafter_dir)
        config.architectures = ["DFlash2DraftModel"]
        torch.manual_seed(7)
        model = DFlash2DraftModel(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.normal_(0, 0.3 if "conv" in name else 0.05)
        model.save_pretrained(drafter_dir)
    model = DFlash2DraftModel.from_pretrained(drafter_dir, torch_dtype=torch.float32).eval()
    model.config._attn_implementation = "sdpa"
    head = nn.Linear(ref["lm_head"].shape[1], ref["lm_head"].shape[0], bias=False)
    head.weight.data.copy_(ref["lm_head"])
    with torch.no_grad():
        out = model(target_hidden=ref["features"], noise_embedding=ref["noise"], position_ids=ref["positions"])
        hidden = out[:, 1:]  # (1, bs − 1, H)
        logits = model.compute_logits(hidden, head)
        anchor = torch.tensor([int(ref["anchor"])])
        path, candidates, _ = model.propose(hidden, anchor, head, 0.0)
        sel, prev, scores = model.candidate_selector, anchor, []
        projected = sel.hidden_projection(hidden)
        for j in range(hidden.shape[1]):
            pair = (sel.predecessor_codebook(prev) * projected[:, j])[:, None, :] * sel.successor_codebook(
                candidates[:, j]
            )
            scores.append(logits[:, j].gather(-1, candidates[:, j]) + pair.sum(-1))
            prev = path[:, j]
    torch.save(
        {
            "hidden": hidden[0],
            "logits": logits[0],
            "candidates": candidates[0],
            "path": path[0],
            "scores": torch.stack(scores, 1)[0],
        },
        outputs,
    )


if __name__ == "__main__":
    main(*sys.argv[1:5])
