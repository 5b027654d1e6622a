"""Domino's correction head: a GRU over the block's previous tokens and a projection that corrects the backbone's
logits of the later slots.

Every slot drafts (as DSpark): slot k of the block at anchor a proposes the token at a + k + 1. Its logits are

    z_k = h_k·Wᵀ                                         k < P            (P = pure_draft_prefix_len: uncorrected)
    z_k = h_k·Wᵀ + W_2·SiLU(W_1·[h_k ; g_k])             k ≥ P
    g_k = GRU(e(t_0), …, e(t_k))                          the state after reading the tokens before slot k + 1

with t_0 the anchor (the bonus token at decoding), t_j the token slot j − 1 proposed (its label in training:
teacher-forced), e the target's embedding table, W the target's LM-head rows of the draft vocabulary. The GRU has no
biases (`prefix_gru.weight_ih_l0` (3G, H), `prefix_gru.weight_hh_l0` (3G, G), gates r, z, n as torch's `nn.GRU`);
the projection is `embed_proj.0.weight` (E, H + G) and `embed_proj.2.weight` (V', E) — the names Model-Optimizer's
and SpecForge's Domino checkpoints use.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def build_correction(drafter: Any) -> None:
    """Add `prefix_gru` and `embed_proj` to the drafter (their init: `reset_correction`)."""
    cfg, s = drafter.config, drafter.config.head_settings
    drafter.prefix_gru = nn.GRU(cfg.hidden_size, s.gru_hidden_dim, num_layers=1, batch_first=True, bias=False)
    drafter.embed_proj = nn.Sequential(
        nn.Linear(cfg.hidden_size + s.gru_hidden_dim, s.emb_dim, bias=False),
        nn.SiLU(),
        nn.Linear(s.emb_dim, cfg.draft_vocab_size or cfg.vocab_size, bias=False),
    )


def reset_correction(drafter: Any, std: float) -> None:
    """The references' init: the projection N(0, std²), the GRU torch's own uniform(±1/√G)."""
    drafter.prefix_gru.reset_parameters()
    for layer in (drafter.embed_proj[0], drafter.embed_proj[2]):
        nn.init.normal_(layer.weight, mean=0.0, std=std)


def token_embeddings(drafter: Any, tokens: Tensor, embed_weight: Tensor) -> Tensor:
    """tokens (…) target ids → (…, H) rows of the target's table, in the drafter's dtype and device."""
    rows = nn.functional.embedding(tokens.to(embed_weight.device), embed_weight)
    return rows.to(drafter.device, drafter.dtype)


def prefix_states(drafter: Any, embeds: Tensor) -> Tensor:
    """embeds (N, L, H) of t_0 … t_{L−1} → (N, L, G): g_k after reading t_0 … t_k."""
    return drafter.prefix_gru(embeds)[0]


def correction(drafter: Any, hidden: Tensor, states: Tensor) -> Tensor:
    """hidden (…, H), states (…, G) → the logit correction (…, V')."""
    return drafter.embed_proj(torch.cat([hidden, states.to(hidden.dtype)], dim=-1))


def corrected_logits(drafter: Any, base: Tensor, hidden: Tensor, embeds: Tensor) -> Tensor:
    """Teacher-forced logits of whole blocks: base (N, bs, V'), hidden (N, bs, H), embeds (N, bs, H) of each slot's
    previous token t_k → (N, bs, V'), slots k < P left as they are."""
    p = drafter.config.head_settings.pure_draft_prefix_len
    states = prefix_states(drafter, embeds)  # (N, bs, G)
    fix = correction(drafter, hidden[:, p:], states[:, p:])  # (N, bs − P, V')
    return torch.cat([base[:, :p], base[:, p:] + fix.to(base.dtype)], dim=1)


class PrefixWalk:
    """The GRU carried token by token along one path of drafts (decoding and DDTree): `step(token)` reads the next
    previous token and returns the new state, from which `logits(k, base_k, h_k)` forms slot k's corrected row."""

    def __init__(self, drafter: Any, embed_weight: Tensor, state: Tensor | None = None) -> None:
        self.drafter, self.embed_weight = drafter, embed_weight
        self.state = state  # (1, 1, G) or None before the first token

    def step(self, token: int) -> PrefixWalk:
        """A new walk whose state has read `token` (a target id) after this one's."""
        x = token_embeddings(self.drafter, torch.tensor([[int(token)]]), self.embed_weight)  # (1, 1, H)
        _, state = self.drafter.prefix_gru(x, self.state)  # (1, 1, G)
        return PrefixWalk(self.drafter, self.embed_weight, state)

    def logits(self, k: int, base: Tensor, hidden: Tensor) -> Tensor:
        """Slot k's row (V',) from its base row (V',) and hidden state (H,), given the tokens read so far."""
        if k < self.drafter.config.head_settings.pure_draft_prefix_len:
            return base
        return base + correction(self.drafter, hidden[None], self.state[0]).float()[0]


__all__ = [
    "PrefixWalk",
    "build_correction",
    "corrected_logits",
    "correction",
    "prefix_states",
    "reset_correction",
    "token_embeddings",
]
