"""Sampling rules for lossless speculative decoding.

- `probs(logits, params)`: the distribution p (or q) after temperature, top-k and top-p.
- Argmax (deterministic) drafts: sample y ~ p at each verified position and accept while y equals the draft;
  the committed tokens are the y's themselves, so the output is exactly distributed as the target's.
- Sampled drafts (d ~ q): accept d with probability min(1, p(d)/q(d)); on rejection resample from
  norm(max(0, p − q)) (Leviathan et al. 2023; Chen et al. 2023).
- Tree nodes (`target_tokens`): one y ~ p per node, the walk follows the child holding y. A node's children are
  deterministic drafts (point masses), and multi-draft recursive rejection sampling over point masses c₁ … c_m
  ends at child cᵢ with probability exactly p(cᵢ) and otherwise draws from p restricted to the other tokens —
  the same law as sampling y ~ p and matching it, so every committed token is distributed as the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"invalid sampling parameters {self}: need temperature ≥ 0, 0 < top_p ≤ 1, top_k ≥ 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()  # the default everywhere: temperature 0


def probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """(…, V) logits → (…, V) probabilities with temperature, top-k and top-p applied (float32)."""
    scores = logits.float() / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = p.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p * keep
        p = torch.zeros_like(p).scatter(-1, order, sorted_p)
        p = p / p.sum(-1, keepdim=True)
    return p


def sample(p: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """(…, V) probabilities → (…) sampled ids."""
    flat = p.reshape(-1, p.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(p.shape[:-1])


def target_tokens(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> Tensor:
    """(N, V) target logits at a tree's nodes → (N,) the target's token at each node: argmax at temperature 0, else
    one independent sample per node (only the nodes on the walked path are ever read)."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(probs(logits, params), generator)


def accept_argmax_drafts(drafts: Tensor, target_p: Tensor, generator: torch.Generator | None = None) -> tuple[int, int]:
    """Sample-and-match for deterministic drafts.

    drafts: (n,) proposed tokens for verify positions 1..n; target_p: (n + 1, V) target distributions at verify
    positions 0..n. Returns (accepted count, next token).
    """
    y = sample(target_p, generator)  # (n + 1,)
    n = drafts.shape[0]
    matches = (y[:n] == drafts).long()
    accepted = int(matches.cumprod(0).sum())
    return accepted, int(y[accepted])


def accept_sampled_drafts(
    drafts: Tensor, target_p: Tensor, draft_q: Tensor, generator: torch.Generator | None = None
) -> tuple[int, int]:
    """min(1, p/q) acceptance with residual resampling.

    drafts: (n,), sampled from draft_q (n, V); target_p: (n + 1, V). Returns (accepted count, next token).
    """
    n = drafts.shape[0]
    idx = drafts[:, None]
    p = target_p[:n].gather(-1, idx)[:, 0]  # (n,)
    q = draft_q.gather(-1, idx)[:, 0]  # (n,)
    u = torch.rand(n, generator=generator, device=p.device)
    ok = (u * q < p).long()  # u < p/q without dividing by q
    accepted = int(ok.cumprod(0).sum())
    if accepted == n:
        return n, int(sample(target_p[n], generator))
    residual = (target_p[accepted] - draft_q[accepted]).clamp_min(0)
    total = residual.sum()
    residual = residual / total if total > 0 else target_p[accepted]
    return accepted, int(sample(residual, generator))
