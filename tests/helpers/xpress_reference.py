"""XPress's refiner from its definition, in float64 Python loops: the reference the decode and training tests compare
against.

    w = weights64(drafter)                        # float64 copies (requires_grad=True with grad=True)
    bias = bias64(w, hidden, prev)                # (bs, V'): hidden (bs, H) of a whole block, prev (bs,) target ids
    rows = jacobi64(w, base, hidden, first, before, passes, to_target)   # each pass's refined rows (bs, V')
"""

from __future__ import annotations

import torch


def weights64(d, grad: bool = False) -> dict:
    """The refiner's weights as float64 leaves."""
    ref = d.refiner_head
    names = ("token_embed", "down_h", "down_g", "in_proj", "mlp_gate", "mlp_up", "mlp_down", "readout")
    out = {n: getattr(ref, n).weight.detach().double().requires_grad_(grad) for n in names}
    out["mix_l"] = ref.mix_l.detach().double().requires_grad_(grad)
    return out


def bias64(w: dict, hidden: torch.Tensor, prev: list[int]) -> torch.Tensor:
    """Slot by slot: c_k = [D_h h_k ; D_g mean h], a_k = P [c_k ; E t_k], m_k = a_k + Σ_{j≤k} L[:, k, j] a_j,
    x_k = m_k + D (SiLU(G m_k) · U m_k), bias_k = R x_k."""
    h = hidden.double()
    bs = h.shape[0]
    mean = sum(h[j] for j in range(bs)) / bs
    a = []
    for k in range(bs):
        c = torch.cat([w["down_h"] @ h[k], w["down_g"] @ mean, w["token_embed"][int(prev[k])]])
        a.append(w["in_proj"] @ c)
    rows = []
    for k in range(bs):
        m = a[k] + sum(w["mix_l"][:, k, j] * a[j] for j in range(k + 1))
        g, u = w["mlp_gate"] @ m, w["mlp_up"] @ m
        x = m + w["mlp_down"] @ (g * torch.sigmoid(g) * u)
        rows.append(w["readout"] @ x)
    return torch.stack(rows)


def jacobi64(w: dict, base: torch.Tensor, hidden: torch.Tensor, first: int, before: int, passes: int, to_target):
    """Each pass's refined rows (bs, V'): pass i reads the previous pass's argmax (pass 0: the base rows'), slot 0 the
    block's first token, slot k's previous token the guess of slot k − 1 (slot 0's: `before`)."""
    base = base.double()
    guess = [to_target(int(i)) for i in base.argmax(-1)]
    out = []
    for _ in range(passes):
        guess[0] = first
        prev = [before, *guess[:-1]]
        rows = base + bias64(w, hidden, prev)
        out.append(rows)
        guess = [to_target(int(i)) for i in rows.argmax(-1)]
    return out
