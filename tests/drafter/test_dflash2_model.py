"""The DFlash2 network against float64 Python loops: the grouped dynamic causal convolution (blocks packed side by
side never mix, taps before a block's first slot read zero), the whole drafter forward at its identity
initialisation equal to the DFlash drafter it warm-starts from, the selector's scores, the z-lab config and
checkpoint round trips (z-lab's `.weight`-suffixed codebooks too), and the fields DFlash2 refuses by name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from dflashkit.drafter.checkpoint import load_drafter, read_tensors, save_drafter
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads.dflash2_net import grouped_dynamic_conv
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import ConfigError


def config(**kw) -> DrafterConfig:
    base = dict(
        hidden_size=64,
        vocab_size=97,
        num_target_layers=8,
        target_layer_ids=[1, 4, 6],
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=32,
        block_size=4,
        mask_token_id=5,
        kind="dflash2",
        conv_group_size=16,
        conv_kernel_size=3,
        selector_rank=8,
        selector_top_k=4,
    )
    base.update(kw)
    return DrafterConfig(**base)


def conv64(x, delta, base, block_len, group_size):
    """y[t, c] = Σ_τ (base[τ, c] + delta[t, τ, c // group_size]) · x[t − τ, c] within each block, in float64 loops."""
    b, t, h = x.shape
    out = torch.zeros(b, t, h, dtype=torch.float64)
    for i in range(b):
        for s in range(t):
            slot = s % block_len
            for c in range(h):
                acc = 0.0
                for tau in range(base.shape[0]):
                    if slot - tau < 0:
                        continue
                    acc += (float(base[tau, c]) + float(delta[i, s, tau, c // group_size])) * float(x[i, s - tau, c])
                out[i, s, c] = acc
    return out


@pytest.mark.parametrize("block_len,taps", [(4, 2), (3, 3), (5, 4), (2, 1)])
def test_grouped_conv_equals_a_python_loop_within_each_block(block_len: int, taps: int) -> None:
    g = torch.Generator().manual_seed(block_len * 10 + taps)
    h, gs, nb = 8, 4, 3
    x = torch.randn(2, nb * block_len, h, generator=g, dtype=torch.float64)
    delta = torch.randn(2, nb * block_len, taps, h // gs, generator=g, dtype=torch.float64)
    base = torch.randn(taps, h, generator=g, dtype=torch.float64)
    got = grouped_dynamic_conv(x, delta, base, block_len, gs)
    assert torch.allclose(got, conv64(x, delta, base, block_len, gs), atol=1e-12)
    one = grouped_dynamic_conv(
        x[:, block_len : 2 * block_len], delta[:, block_len : 2 * block_len], base, block_len, gs
    )
    assert torch.allclose(one, got[:, block_len : 2 * block_len], atol=1e-12)  # a packed block = the block alone


def test_identity_at_init_drafts_as_the_dflash_checkpoint_it_starts_from() -> None:
    cfg = config()
    torch.manual_seed(0)
    plain = DFlashDrafter(cfg.replace(kind="dflash"))
    two = DFlashDrafter(cfg)
    result = two.load_state_dict(plain.state_dict(), strict=False)
    assert all("conv" in k or "candidate_selector" in k for k in result.missing_keys) and not result.unexpected_keys
    g = torch.Generator().manual_seed(1)
    feats, emb = torch.randn(2, 9, 192, generator=g), torch.randn(2, 8, 64, generator=g)
    kw = dict(
        context_positions=torch.arange(9)[None].expand(2, 9), block_positions=torch.arange(9, 17)[None].expand(2, 8)
    )
    assert torch.equal(plain(feats, emb, block_len=4, **kw), two(feats, emb, block_len=4, **kw))


def test_selector_scores_equal_the_definition() -> None:
    d = DFlashDrafter(config())
    sel = d.candidate_selector
    g = torch.Generator().manual_seed(2)
    hidden, unary = torch.randn(3, 64, generator=g), torch.randn(3, 97, generator=g)
    prev = torch.tensor([4, 50, 96])
    cand = sel.candidates(unary)
    got = sel.scores(unary, hidden, prev, cand).detach()
    a, b = sel.predecessor_codebook.detach().double(), sel.successor_codebook.detach().double()
    ph = hidden.double() @ sel.hidden_projection.weight.detach().double().t()  # (3, r)
    for j in range(3):
        assert cand[j].tolist() == unary[j].topk(4).indices.tolist()
        for k, c in enumerate(cand[j].tolist()):
            want = float(unary[j, c]) + float((a[prev[j]] * ph[j] * b[c]).sum())
            assert float(got[j, k]) == pytest.approx(want, abs=1e-5)


def test_zlab_config_and_checkpoint_round_trip(tmp_path) -> None:
    cfg = config(output_multiplier=1.5, input_embedding_scale=2.0, final_logit_softcapping=30.0)
    raw = cfg.to_zlab_dict()
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert {raw["dflash_config"][k] for k in ("conv_kernel_size", "selector_top_k")} == {3, 4}
    assert raw["dflash_config"]["final_logit_softcapping"] == 30.0
    assert DrafterConfig.from_zlab_dict(raw) == cfg
    for name, value, words in (("selector_rank", "two", "an integer"), ("output_multiplier", [1], "a number")):
        bad = {**raw, "dflash_config": {**raw["dflash_config"], name: value}}  # the head's own field types
        with pytest.raises(ConfigError, match=f"x.json: field 'dflash_config.{name}' must be {words}"):
            DrafterConfig.from_zlab_dict(bad, source="x.json")
    torch.manual_seed(3)
    d = DFlashDrafter(cfg)
    with torch.no_grad():
        d.layers[0].mlp_conv.base_kernel.normal_()
    save_drafter(d, tmp_path / "a")
    tensors = read_tensors(tmp_path / "a")
    assert "candidate_selector.predecessor_codebook" in tensors and "layers.1.attention_conv.base_kernel" in tensors
    back = load_drafter(tmp_path / "a")
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in d.state_dict().items())
    # z-lab's nn.Embedding codebooks carry `.weight`: the same drafter
    renamed = {(k + ".weight" if k.endswith("_codebook") else k): v for k, v in tensors.items()}
    save_file(renamed, str(tmp_path / "a" / "model.safetensors"))
    again = load_drafter(tmp_path / "a")
    assert torch.equal(again.candidate_selector.successor_codebook, d.candidate_selector.successor_codebook)


def test_scaled_logits_and_embeddings() -> None:
    cfg = config(output_multiplier=2.0, final_logit_softcapping=3.0, input_embedding_scale=0.5)
    d = DFlashDrafter(cfg)
    head, h = torch.randn(97, 64), torch.randn(2, 64)
    assert torch.allclose(d.logits(h, head), torch.tanh(2.0 * (h @ head.t()) / 3.0) * 3.0, atol=1e-5)
    table = torch.randn(97, 64)
    emb = d.block_embeddings(torch.tensor([[7]]), table, 4)
    assert torch.allclose(emb[0, 0], 0.5 * table[7]) and torch.allclose(emb[0, 1], 0.5 * table[5])


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("conv_group_size", 24, "a divisor of hidden_size 64"),
        ("conv_kernel_size", 5, "at most block_size 4"),
        ("selector_top_k", 200, "at most the draft vocabulary"),
        ("selector_rank", 0, "conv|selector_rank"),
    ],
)
def test_geometry_refused_by_field(field: str, value: int, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        config(**{field: value})


def test_dflash2_fields_refused_for_another_kind() -> None:
    from dflashkit.drafter.defaults import check_overrides

    with pytest.raises(ConfigError, match="selector_top_k"):
        check_overrides({"kind": "dflash", "selector_top_k": 8}, lambda name: "cli")
