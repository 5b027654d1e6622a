"""DFlash2's two network parts on the DFlash backbone (z-lab's DFlash2DraftModel): the grouped dynamic causal
convolution around every sublayer, and the candidate selector.

Convolution (per decoder layer, one around attention and one around the MLP, on the block's hidden states only —
the context K/V still come from the target features). With K taps, G = H / group_size groups, g(c) the group of
channel c and t a slot of one block:

    δ            = kernel_projection(x)                     (T, 2, K, G)   one projection, both sides
    prepare:  x_in[t, c] = Σ_τ (base[0, τ, c] + δ[t, 0, τ, g(c)]) · x[t − τ, c]      the sublayer reads x_in
    finish:   y_out[t, c] = Σ_τ (base[1, τ, c] + δ[t, 1, τ, g(c)]) · y[t − τ, c]      y = the sublayer's output

Taps that reach before the first slot of a block read zero, so blocks packed side by side in training never mix.
At init base[:, 0] = 1, the other taps 0 and kernel_projection = 0: both convolutions are the identity and a DFlash
checkpoint warm-starts a DFlash2 drafter that drafts exactly as it did.

Candidate selector: unary logits U (the LM head's, × output_multiplier, softcapped), candidates C = top-K of U, and
the score of candidate c after predecessor p given the slot's hidden state h

    S(p, c) = U[c] + ⟨A[p] ⊙ P·h, B[c]⟩                      A: (V, r) over target ids, B: (V', r) over draft ids,
                                                            P: (H → r)

The predecessor of the first draft is the block's given token, then the previous slot's chosen token. Names match
z-lab's checkpoint keys: `layers.N.{attention,mlp}_conv.{base_kernel,kernel_projection.weight}`,
`candidate_selector.{predecessor_codebook,successor_codebook,hidden_projection.weight}` (codebooks without `.weight`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def scaled_logits(cfg: Any, logits: Tensor) -> Tensor:
    """The LM head's logits × output_multiplier, then tanh-capped at final_logit_softcapping (both off by default):
    the settings of the drafter config `cfg`."""
    m = cfg.head_settings.output_multiplier
    if m != 1.0:
        logits = logits * m
    cap = cfg.head_settings.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap


def grouped_dynamic_conv(x: Tensor, delta: Tensor, base: Tensor, block_len: int, group_size: int) -> Tensor:
    """x (B, T, H), delta (B, T, K, G), base (K, H) → (B, T, H); T a multiple of `block_len`, taps stop at a block's
    first slot."""
    b, t, h = x.shape
    taps, groups = base.shape[0], h // group_size
    xb = x.view(b, t // block_len, block_len, groups, group_size)  # (B, Nb, bl, G, gs)
    db = delta.view(b, t // block_len, block_len, taps, groups)  # (B, Nb, bl, K, G)
    out = torch.zeros_like(xb)
    for tau in range(min(taps, block_len)):
        shifted = xb if tau == 0 else F.pad(xb[:, :, : block_len - tau], (0, 0, 0, 0, tau, 0))  # slot t reads t − τ
        coef = base[tau].to(x.dtype).view(groups, group_size) + db[:, :, :, tau, :, None]  # (B, Nb, bl, G, gs)
        out = out + coef * shifted
    return out.view(b, t, h)


class GroupedDynamicCausalConv(nn.Module):
    """The pair of convolutions around one sublayer: `prepare` before it, `finish` after it."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # (side, tap, channel)
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The identity: base tap 0 = 1, the other taps and the projection 0."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, x: Tensor, block_len: int) -> tuple[Tensor, Tensor]:
        """x (B, T, H) → (the sublayer's input (B, T, H), the output side's dynamic kernel (B, T, K, G))."""
        delta = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)  # (B, T, 2, K, G)
        return grouped_dynamic_conv(x, delta[..., 0, :, :], self.base_kernel[0], block_len, self.group_size), delta[
            ..., 1, :, :
        ]

    def finish(self, y: Tensor, delta: Tensor, block_len: int) -> Tensor:
        """The sublayer's output y (B, T, H) convolved with the kernel `prepare` returned."""
        return grouped_dynamic_conv(y, delta, self.base_kernel[1], block_len, self.group_size)

    def around(self, sublayer: Callable[[Tensor], Tensor], x: Tensor, block_len: int) -> Tensor:
        """finish(sublayer(prepare(x)))."""
        inner, delta = self.prepare(x, block_len)
        return self.finish(sublayer(inner), delta, block_len)


class CandidateSelector(nn.Module):
    """Edge scores S(p, c) of candidates c after predecessor p (module docstring)."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, hidden_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))  # A, by target id
        self.successor_codebook = nn.Parameter(torch.empty(draft_vocab_size, rank))  # B, by draft id
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)  # P

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """A, B, P ~ N(0, std²), as the references initialise them."""
        for w in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(w, std=std)

    def context(self, hidden: Tensor, prev_ids: Tensor) -> Tensor:
        """hidden (…, H), predecessors (…) as target ids → A[p] ⊙ P·h (…, r)."""
        proj = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))
        return self.predecessor_codebook[prev_ids.long().to(proj.device)] * proj

    def scores(self, unary: Tensor, hidden: Tensor, prev_ids: Tensor, candidates: Tensor) -> Tensor:
        """unary (…, V'), hidden (…, H), predecessors (…), candidates (…, K) draft ids → S (…, K)."""
        ctx = self.context(hidden, prev_ids)  # (…, r)
        pair = (ctx[..., None, :] * self.successor_codebook[candidates]).sum(-1)  # (…, K)
        return unary.gather(-1, candidates) + pair.to(unary.dtype)

    def candidates(self, unary: Tensor) -> Tensor:
        """The top-K unary candidates (…, K) draft ids, best first."""
        return unary.topk(min(self.top_k, unary.shape[-1]), dim=-1).indices


__all__ = ["CandidateSelector", "GroupedDynamicCausalConv", "grouped_dynamic_conv", "scaled_logits"]
