"""The drafter's own Qwen3 blocks equal transformers' bit for bit (values and gradients, each dtype), and a drafter is
built without importing transformers' modeling code."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import rotate_half as hf_rotate_half

from dflashkit.drafter.qwen3_blocks import DefaultRope, GatedMLP, RMSNorm, rotate_half

DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def _pair(ours: torch.nn.Module, theirs: torch.nn.Module, dtype: torch.dtype) -> None:
    """Same parameters (random, not the initial ones) in `dtype`."""
    torch.manual_seed(0)
    theirs.to(dtype)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p))
    ours.to(dtype)
    ours.load_state_dict(theirs.state_dict())


def _same_with_grads(ours: torch.nn.Module, theirs: torch.nn.Module, x: torch.Tensor) -> None:
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = ours(xa), theirs(xb)
    assert torch.equal(a, b)
    g = torch.randn_like(a)
    a.backward(g)
    b.backward(g)
    assert torch.equal(xa.grad, xb.grad)
    for (na, pa), (nb, pb) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa.grad, pb.grad), na


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_equals_transformers(dtype):
    ours, theirs = RMSNorm(48, eps=1e-5), Qwen3RMSNorm(48, eps=1e-5)
    _pair(ours, theirs, dtype)
    _same_with_grads(ours, theirs, torch.randn(3, 7, 48, dtype=dtype) * 5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mlp_equals_transformers(dtype):
    cfg = Qwen3Config(hidden_size=32, intermediate_size=80, hidden_act="silu")
    ours, theirs = GatedMLP(32, 80, "silu"), Qwen3MLP(cfg)
    _pair(ours, theirs, dtype)
    _same_with_grads(ours, theirs, torch.randn(2, 5, 32, dtype=dtype))


def test_mlp_other_activation_is_transformers_own():
    cfg = Qwen3Config(hidden_size=16, intermediate_size=24, hidden_act="gelu")
    ours, theirs = GatedMLP(16, 24, "gelu"), Qwen3MLP(cfg)
    _pair(ours, theirs, torch.float32)
    _same_with_grads(ours, theirs, torch.randn(4, 16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("theta", [10_000.0, 1_000_000.0])
def test_rope_equals_transformers(dtype, theta):
    cfg = Qwen3Config(
        hidden_size=64, num_attention_heads=4, head_dim=24, max_position_embeddings=4096,
        rope_parameters={"rope_theta": theta, "rope_type": "default"},
    )  # fmt: skip
    ours, theirs = DefaultRope(24, theta), Qwen3RotaryEmbedding(cfg)
    assert torch.equal(ours.inv_freq, theirs.inv_freq)
    x = torch.randn(2, 9, 24, dtype=dtype)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [100, 101, 4000, 3, 2, 1, 0, 17, 4095]])
    for a, b in zip(ours(x, pos), theirs(x, pos), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(rotate_half(x), hf_rotate_half(x))
    assert set(dict(ours.named_buffers())) == set(dict(theirs.named_buffers()))
    assert ours.state_dict().keys() == theirs.state_dict().keys()  # non-persistent: nothing saved


def test_a_drafter_builds_without_transformers_modeling():
    code = (
        "import sys\n"
        "from dflashkit.drafter.config import DrafterConfig\n"
        "from dflashkit.drafter.model import DFlashDrafter\n"
        "DFlashDrafter(DrafterConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,"
        " num_key_value_heads=2, head_dim=16, vocab_size=100, num_target_layers=4, target_layer_ids=[1, 2],"
        " num_hidden_layers=1, block_size=4))\n"
        "print(sorted(m for m in sys.modules\n"
        "             if m.startswith('transformers.models.') or m == 'transformers.modeling_utils'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
