"""The Qwen3 building blocks a drafter layer is made of — RMSNorm, the gated MLP, default RoPE and `rotate_half` —
with transformers' parameter names and arithmetic, op for op, so their outputs are bit-identical to
`transformers.models.qwen3.modeling_qwen3`'s (tests/drafter/test_qwen3_blocks.py) while building a drafter imports no
transformers modeling code (about two seconds of a command that only sizes a drafter, as train's pre-flight does).

    norm = RMSNorm(1024, eps=1e-6)          # weight (H,)
    mlp = GatedMLP(1024, 3072, "silu")      # gate_proj, up_proj, down_proj
    rope = DefaultRope(128, theta=1e6)      # cos, sin = rope(x, position_ids)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """w · x / sqrt(mean(x²) + eps), the statistic in float32 and the product in the input's dtype (Qwen3's rule)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        input_dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def activation(name: str) -> nn.Module:
    """The activation module transformers' ACT2FN gives for `name`; SiLU (every Qwen3 drafter) without importing it."""
    if name == "silu":
        return nn.SiLU()
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) · up_proj(x)), no biases."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = activation(hidden_act)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DefaultRope(nn.Module):
    """RoPE of the default type: inv_freq_i = 1 / θ^(2i / d); cos / sin of position · inv_freq, the two halves
    repeated, computed in float32 and cast to the input's dtype."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))  # (d/2,)
        self.attention_scaling = 1.0
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        # position_ids: (B, T) → cos, sin: (B, T, d)
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) → (−x2, x1) over the last dimension's halves."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


__all__ = ["DefaultRope", "GatedMLP", "RMSNorm", "activation", "rotate_half"]
