"""DSpark's two small heads on top of the DFlash backbone (DeepSpec's vanilla Markov head and confidence head).

    Markov head      bias(prev) = W2 · W1[prev]        W1: (V, r) embedding over TARGET ids, W2: r → V' (the draft
                                                       vocabulary: V' = draft_vocab_size, else V)
                     slot k's logits = backbone logits_k + bias(prev_k); prev_0 = the block's given token, prev_k =
                     the token of slot k − 1 (teacher-forced in training, the drafted one at inference)
    Confidence head  conf_k = sigmoid(w · [h_k ; W1[prev_k]] + b)          (H + r → 1), the chance slot k is accepted

Weight names follow DeepSpec and llama.cpp's converter: `markov_head.markov_w1.weight`, `markov_head.markov_w2.weight`,
`confidence_head.proj.{weight,bias}`. `markov_chain` is the inference-time left-to-right pass over a block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


class MarkovHead(nn.Module):
    """Low-rank previous-token bias on the draft logits (DeepSpec's "vanilla" Markov head)."""

    def __init__(self, vocab_size: int, rank: int, out_vocab: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # indexed by target ids
        self.markov_w2 = nn.Linear(rank, out_vocab, bias=False)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """W1 ~ N(0, std²); W2 = 0, so a fresh DSpark drafter drafts exactly as its backbone until W2 learns."""
        nn.init.normal_(self.markov_w1.weight, std=std)
        nn.init.zeros_(self.markov_w2.weight)

    def prev_embeddings(self, prev_ids: Tensor) -> Tensor:
        """(…) target ids → (…, r)."""
        return self.markov_w1(prev_ids.long().to(self.markov_w1.weight.device))

    def bias(self, prev_ids: Tensor) -> Tensor:
        """(…) target ids → (…, V') logit bias."""
        return self.markov_w2(self.prev_embeddings(prev_ids))


class ConfidenceHead(nn.Module):
    """One linear layer over [h_k ; W1[prev_k]] → the logit of slot k's acceptance probability."""

    def __init__(self, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)

    def forward(self, hidden: Tensor, prev_embeddings: Tensor) -> Tensor:
        """hidden (…, H), prev_embeddings (…, r) → confidence logits (…) (apply sigmoid for a probability)."""
        feats = torch.cat([hidden, prev_embeddings.to(hidden.dtype)], dim=-1)  # (…, H + r)
        return self.proj(feats.to(self.proj.weight.dtype)).squeeze(-1)


def markov_chain(
    base_logits: Tensor,
    first_prev: int,
    head: MarkovHead,
    pick: Callable[[Tensor], int],
    to_target_id: Callable[[int], int],
) -> tuple[list[int], Tensor, list[int]]:
    """The inference pass over one block, left to right.

    base_logits (n, V') backbone logits of slots 0..n−1; first_prev: the block's given token (a target id);
    pick(logits (V',)) → a draft id (argmax, or a sample); to_target_id maps a draft id to a target id.
    Returns (drafts as target ids, the corrected logits (n, V') each draft was picked from, the prev target id of
    every slot — what the confidence head reads)."""
    prev = int(first_prev)
    drafts: list[int] = []
    prevs: list[int] = []
    rows = []
    for k in range(base_logits.shape[0]):
        prevs.append(prev)
        row = base_logits[k] + head.bias(torch.tensor(prev)).to(base_logits.dtype)  # (V',)
        rows.append(row)
        prev = to_target_id(pick(row))
        drafts.append(prev)
    corrected = torch.stack(rows) if rows else base_logits[:0]
    return drafts, corrected, prevs


__all__ = ["ConfidenceHead", "MarkovHead", "markov_chain"]
