"""Domino's network from its definition, in float64 Python: the GRU's equations (torch's gate order r, z, n, no
biases) and a slot's corrected row — the reference the decode and training tests compare against.

    w = weights64(drafter)                       # float64 copies (requires_grad=True with grad=True)
    states = gru64(w, [embedding rows …])        # the state after each input
    row = corrected64(w, k, base_k, hidden_k, state_k)
"""

from __future__ import annotations

import torch


def weights64(d, grad: bool = False) -> dict:
    """The drafter's GRU and projection weights as float64 leaves, and its uncorrected prefix length."""
    raw = {
        "wi": d.prefix_gru.weight_ih_l0,
        "wh": d.prefix_gru.weight_hh_l0,
        "w1": d.embed_proj[0].weight,
        "w2": d.embed_proj[2].weight,
    }
    out = {k: v.detach().double().requires_grad_(grad) for k, v in raw.items()}
    out["prefix"] = d.config.head_settings.pure_draft_prefix_len
    return out


def gru64(w: dict, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The GRU's states after each input x (H,)."""
    wi, wh = w["wi"], w["wh"]
    g = wh.shape[1]
    h, out = torch.zeros(g, dtype=torch.float64), []
    for x in xs:
        gi, gh = wi @ x.double(), wh @ h
        r = torch.sigmoid(gi[:g] + gh[:g])
        z = torch.sigmoid(gi[g : 2 * g] + gh[g : 2 * g])
        n = torch.tanh(gi[2 * g :] + r * gh[2 * g :])
        h = (1 - z) * n + z * h
        out.append(h)
    return out


def corrected64(w: dict, k: int, base: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Slot k's row: base, plus W2·SiLU(W1·[h; g]) from slot pure_draft_prefix_len on."""
    if k < w["prefix"]:
        return base.double()
    u = w["w1"] @ torch.cat([hidden.double(), state])
    return base.double() + w["w2"] @ (u * torch.sigmoid(u))


__all__ = ["corrected64", "gru64", "weights64"]
