"""The target's log-sum-exp over its whole vocabulary at each position of a sequence, chunk by chunk.

    lse = row_logsumexp(target, final_hidden)     # (T,) float32 = log Σ_v exp(verifier_logit_v)
    z = vocab_subset_logits(target, final_hidden, target.lm_head_weight[ids])   # (T, V') those ids' logits
    p = torch.exp(z - lse[:, None])               # the target's probabilities of those ids

Together with the logits of a subset of the vocabulary (a reduced draft vocabulary) it gives the target's exact
probabilities of that subset, exp(z − lse), and the mass outside it — without forming all V logits again. Capture
stores it (`dflashkit capture --target-lse`) and DSpark training reads it (`dflashkit.train.target_lse`).

Both run at the target's own precision (the hidden state is cast to its dtype first, as its forward would hold it),
so the subset's logits are the same numbers as the full logits' columns (up to the products' rounding) and the
probabilities sum to at most one — on a bf16 target too, whose float32 features would otherwise meet a bf16 head.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

_CHUNK_LOGITS = 1 << 25  # positions × vocabulary per chunk (one float32 (chunk, V) tensor: 128 MiB)


@torch.no_grad()
def row_logsumexp(target: Any, final_hidden: Tensor, chunk: int | None = None) -> Tensor:
    """(T,) float32: log Σ_v exp(logit_v) of the target's verifier logits at each position of one sequence.
    final_hidden (T, H): the target's last decoder layer output, before its final norm. The chunking depends on
    the vocabulary only, so the same sequence always gets the same values."""
    t = final_hidden.shape[0]
    vocab = int(target.vocab_size)
    step = chunk if chunk is not None else max(1, _CHUNK_LOGITS // max(1, vocab))
    out = torch.empty(t, dtype=torch.float32, device=final_hidden.device)
    for s in range(0, t, step):
        logits = target.verifier_logits(final_hidden[None, s : s + step].to(target.dtype))[0]  # (c, V)
        out[s : s + step] = torch.logsumexp(logits.float(), dim=-1).to(out.device)
    return out


def vocab_subset_logits(target: Any, final_hidden: Tensor, weight: Tensor) -> Tensor:
    """(T, V') float32: the target's logits of a subset of its vocabulary; `weight` (V', H) holds those rows of its
    plain LM head (`Target.plain_head`). final_hidden (T, H): the last decoder layer's output, before the final norm."""
    h = target.final_norm(final_hidden.to(target.device, target.dtype))  # (T, H) at the target's precision
    return F.linear(h, weight.to(h.device, h.dtype)).float()


__all__ = ["row_logsumexp", "vocab_subset_logits"]
