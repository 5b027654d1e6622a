"""Shared pieces of the training tests: random token sequences with a tiny target's features, a small training
config, the final weights of a run, a tokens.jsonl for the tiny vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflashkit.data.samples import Sample
from dflashkit.drafter.checkpoint import read_tensors
from dflashkit.target.model import Target
from dflashkit.train.config import TrainConfig

DRAFTER = {"num_hidden_layers": 1, "block_size": 4}


def make_samples(
    target: Target,
    layer_ids: list[int],
    *,
    n: int = 4,
    seed: int = 0,
    lengths: list[int] | None = None,
    prompt: int = 4,
) -> list[Sample]:
    """Random token sequences (first `prompt` tokens unsupervised) with the tiny target's features/argmax."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = lengths[i] if lengths else 18 + 4 * i
        ids = torch.randint(3, target.vocab_size, (t,), generator=g)
        mask = torch.ones(t, dtype=torch.bool)
        mask[:prompt] = False
        res = target.forward(ids[None], layer_ids=layer_ids)
        out.append(Sample(f"s{i}", ids, mask, res.features[0], res.logits[0].argmax(-1)))
    return out


def cfg_for(out: Path, **kw) -> TrainConfig:
    base = dict(
        out=str(out),
        drafter=dict(DRAFTER),
        max_tokens=48,
        max_steps=6,
        save_every=3,
        progress=False,
        tensorboard=False,
        lr=2e-3,
    )
    base.update(kw)
    return TrainConfig(**base)


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return read_tensors(out / "final")


def write_tokens_file(path: Path, n: int) -> Path:
    """tokens.jsonl with `n` random 20-token documents for the tiny vocabulary (first 4 tokens unsupervised)."""
    g = torch.Generator().manual_seed(0)
    with path.open("w") as f:
        for i in range(n):
            ids = torch.randint(3, 97, (20,), generator=g).tolist()
            f.write(json.dumps({"id": f"x{i}", "input_ids": ids, "loss_mask": [0] * 4 + [1] * 16}) + "\n")
    return path
