"""A small batch of DSpark blocks for the loss tests against the reference projects' own code (DeepSpec's loss,
speculators' DSpark + D-PACE): a DSpark drafter of the conftest tiny targets' shape (hidden 64, vocabulary 97) with its
Markov W2 and confidence head moved off their initial values, backbone states, an LM head, and each block's true tokens
with valid prefixes of different lengths (an empty block included)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from dflashkit.drafter.model import DFlashDrafter
from helpers.checkpoints import small_config


class DSparkBlocks(NamedTuple):
    drafter: DFlashDrafter
    hidden: Tensor  # (N, γ, H) final-normed backbone states
    head: Tensor  # (V, H)
    tokens: Tensor  # (N, γ + 1) the given token, then the block's true tokens
    valid: Tensor  # (N, γ) bool, a prefix of each block
    labels: Tensor  # (N, γ) target ids, −100 outside the valid prefix
    prev: Tensor  # (N, γ) teacher forcing: slot k reads the token before it


def dspark_blocks(seed: int = 0, *, rank: int = 6, block: int = 5) -> DSparkBlocks:
    torch.manual_seed(seed)
    drafter = DFlashDrafter(small_config(kind="dspark", markov_rank=rank, block_size=block))
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.normal_(0.0, 0.5)  # W2 starts at zero: give the bias a value
        drafter.confidence_head.proj.weight.normal_(0.0, 0.3)
    hidden, head = torch.randn(7, block, 64), torch.randn(97, 64) * 0.3
    tokens = torch.randint(0, 97, (7, block + 1))
    valid = torch.arange(block)[None] < torch.tensor([0, 1, 2, 3, 5, 5, 4])[:, None]
    labels = torch.where(valid, tokens[:, 1:], -100)
    return DSparkBlocks(drafter, hidden, head, tokens, valid, labels, tokens[:, :-1])
