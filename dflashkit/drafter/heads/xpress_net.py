"""XPress's causal refiner: a low-rank head that turns each block slot's hidden state, the block's mean state and the
token before the slot into a bias on the backbone's logits, mixed causally across the block.

For a block of bs slots with final-normed hidden states h_0 … h_{bs−1} and previous tokens t_0 … t_{bs−1}
(slot k's t_k is the token of slot k − 1; t_0 the token before the block's first token):

    c_k = [D_h·h_k ; D_g·mean_j h_j]                        (2r)   the pass-invariant part (`hidden_cache`)
    a_k = P·[c_k ; E[t_k]]                                  (r)
    m_k = a_k + Σ_{j ≤ k} L[:, k, j] ⊙ a_j                  (r)    per-channel lower-triangular mixer
    x_k = m_k + D·(SiLU(G·m_k) ⊙ (U·m_k))                   (r)    SwiGLU residual
    z_k = h_k·Wᵀ + R·x_k                                    (V')   the refined logits

E is the refiner's own table over the target vocabulary (V × r), R reads out over the draft vocabulary (V' × r),
L (r, bs, bs) starts at zero and the other matrices at N(0, std²), so an untrained refiner is a near no-op. The
parameters sit under `refiner_head.` with speculators' names (`token_embed`, `down_h`, `down_g`, `in_proj`, `mix_l`,
`mlp_gate`, `mlp_up`, `mlp_down`, `readout`), so its checkpoints load unchanged. The refiner runs in its own
parameters' dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Refiner(nn.Module):
    """The refiner's parameters and its two passes: `hidden_cache` once per block, `features` once per token guess."""

    def __init__(
        self, hidden_size: int, vocab_size: int, draft_vocab_size: int, block_size: int, rank: int, ratio: int
    ):
        super().__init__()
        r = rank
        self.token_embed = nn.Embedding(vocab_size, r)
        self.down_h = nn.Linear(hidden_size, r, bias=False)
        self.down_g = nn.Linear(hidden_size, r, bias=False)
        self.in_proj = nn.Linear(3 * r, r, bias=False)
        self.mix_l = nn.Parameter(torch.zeros(r, block_size, block_size))
        self.mlp_gate = nn.Linear(r, r * ratio, bias=False)
        self.mlp_up = nn.Linear(r, r * ratio, bias=False)
        self.mlp_down = nn.Linear(r * ratio, r, bias=False)
        self.readout = nn.Linear(r, draft_vocab_size, bias=False)
        self.register_buffer("causal", torch.tril(torch.ones(block_size, block_size)), persistent=False)

    def reset(self, std: float) -> None:
        """The references' init: every matrix N(0, std²), the mixer zero."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=std)
        nn.init.zeros_(self.mix_l)

    def hidden_cache(self, hidden: Tensor) -> Tensor:
        """hidden (N, bs, H) whole blocks → c (N, bs, 2r), shared by every pass over the same blocks."""
        hidden = hidden.to(self.down_h.weight.dtype)
        mean = hidden.mean(dim=1, keepdim=True).expand_as(hidden)  # (N, bs, H)
        return torch.cat([self.down_h(hidden), self.down_g(mean)], dim=-1)

    def features(self, prev: Tensor, cache: Tensor) -> Tensor:
        """prev (N, bs) target ids (each slot's previous token), cache (N, bs, 2r) → x (N, bs, r) before the readout."""
        a = self.in_proj(torch.cat([cache, self.token_embed(prev.long()).to(cache.dtype)], dim=-1))  # (N, bs, r)
        mix = self.mix_l * self.causal.to(self.mix_l.dtype)  # (r, bs, bs): slot k reads slots j ≤ k
        m = a + torch.einsum("ckj,njc->nkc", mix, a)
        return m + self.mlp_down(F.silu(self.mlp_gate(m)) * self.mlp_up(m))

    def bias(self, prev: Tensor, cache: Tensor) -> Tensor:
        """The logit bias (N, bs, V') given each slot's previous token."""
        return self.readout(self.features(prev, cache))


def build_refiner(drafter: Any) -> None:
    """Add `refiner_head` to the drafter (its init: `Refiner.reset`)."""
    cfg, s = drafter.config, drafter.config.head_settings
    drafter.refiner_head = Refiner(
        cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size or cfg.vocab_size, cfg.block_size, s.xpress_rank,
        s.xpress_mlp_ratio,
    )  # fmt: skip


def refined_logits(drafter: Any, base: Tensor, prev: Tensor, cache: Tensor) -> Tensor:
    """base (N, bs, V') + the bias given prev (N, bs) → (N, bs, V') float32."""
    return base.float() + drafter.refiner_head.bias(prev, cache).float()


def jacobi(drafter: Any, base: Tensor, cache: Tensor, first: Tensor, before: Tensor, passes: int) -> list[Tensor]:
    """Jacobi decoding of whole blocks: base (N, bs, V') logits, cache (N, bs, 2r), first (N,) the block's slot-0
    token and before (N,) the token before it (target ids) → the refined logits of every pass [(N, bs, V') × passes].

    Pass 0 reads the backbone's argmax as its guesses; pass i + 1 reads pass i's argmax. Slot 0 always holds the
    block's own first token, so slot k's previous token is slot k − 1's guess (slot 1: the first token; slot 0: the
    token before it). The greedy drafts are the last pass's argmax (the backbone's with `passes` = 0)."""
    guess = drafter.to_target_ids(base.argmax(-1))  # (N, bs) target ids
    out = []
    for _ in range(passes):
        guess = torch.cat([first[:, None], guess[:, 1:]], dim=1)
        prev = torch.cat([before[:, None], guess[:, :-1]], dim=1)  # (N, bs)
        logits = refined_logits(drafter, base, prev, cache)
        out.append(logits)
        guess = drafter.to_target_ids(logits.argmax(-1))
    return out


__all__ = ["Refiner", "build_refiner", "jacobi", "refined_logits"]
