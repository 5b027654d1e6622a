"""The Domino network and its checkpoint layout: the references' tensor names and shapes, the z-lab config with
`projector_type: domino` both ways, teacher-forced corrected logits of whole blocks against a float64 Python loop,
the parameter count from the config, the references' init, and what dflashkit cannot run refused by name."""

from __future__ import annotations

import pytest
import torch

from dflashkit.drafter.checkpoint import load_drafter, read_tensors, save_drafter
from dflashkit.drafter.config import DrafterConfig, parameter_count
from dflashkit.drafter.heads.domino_net import corrected_logits, token_embeddings
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import ConfigError
from helpers.domino_reference import corrected64, gru64, weights64

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def config(**kw) -> DrafterConfig:
    base = dict(
        hidden_size=64, vocab_size=97, num_target_layers=8, target_layer_ids=[1, 4, 6], num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=32, block_size=4,
        mask_token_id=5, kind="domino", gru_hidden_dim=12, emb_dim=10,
    )  # fmt: skip
    return DrafterConfig(**{**base, **kw})


def test_tensors_have_the_references_names_shapes_and_count() -> None:
    for vocab in (None, 40):
        cfg = config(draft_vocab_size=vocab)
        d = DFlashDrafter(cfg)
        sd = d.state_dict()
        v = vocab or 97
        assert sd["prefix_gru.weight_ih_l0"].shape == (36, 64) and sd["prefix_gru.weight_hh_l0"].shape == (36, 12)
        assert sd["embed_proj.0.weight"].shape == (10, 76) and sd["embed_proj.2.weight"].shape == (v, 10)
        assert not any("bias" in k for k in sd if k.startswith(("prefix_gru", "embed_proj")))
        own = sum(p.numel() for p in d.parameters()) + (2 * vocab if vocab else 0)
        assert parameter_count(cfg) == own


def test_init_is_the_references() -> None:
    torch.manual_seed(0)
    d = DFlashDrafter(config(gru_hidden_dim=64, emb_dim=256))
    bound = 1 / 64**0.5  # torch's GRU init: uniform(±1/√G)
    assert d.prefix_gru.weight_hh_l0.abs().max() <= bound and d.prefix_gru.weight_hh_l0.abs().max() > 0.9 * bound
    std = float(d.embed_proj[2].weight.detach().std())
    assert 0.015 < std < 0.025  # N(0, 0.02²), the drafter's init std


def test_zlab_config_and_checkpoint_round_trip(tmp_path) -> None:
    cfg = config(pure_draft_prefix_len=2)
    raw = cfg.to_zlab_dict()
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["emb_dim"] == 10
    dc = raw["dflash_config"]
    assert (dc["projector_type"], dc["shift_label"], dc["pure_draft_prefix_len"]) == ("domino", True, 2)
    assert (dc["gru_hidden_dim"], dc["emb_dim"]) == (12, 10)
    assert DrafterConfig.from_zlab_dict(raw) == cfg
    torch.manual_seed(3)
    d = DFlashDrafter(cfg)
    save_drafter(d, tmp_path / "a")
    assert {"prefix_gru.weight_ih_l0", "embed_proj.2.weight"} <= set(read_tensors(tmp_path / "a"))
    back = load_drafter(tmp_path / "a")
    assert back.config.kind == "domino"
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in d.state_dict().items())


@pytest.mark.parametrize(
    "change,words",
    [
        ({"shift_label": False}, "shift_label false"),
        ({"gru_hidden_dim": None}, "needs dflash_config.gru_hidden_dim"),
        ({"emb_dim": "ten"}, "field 'dflash_config.emb_dim' must be an integer"),
        ({"pure_draft_prefix_len": 4}, "pure_draft_prefix_len"),
        ({"shift_label": None}, "needs dflash_config.shift_label"),
        ({"pure_draft_prefix_len": None}, "needs dflash_config.pure_draft_prefix_len"),
    ],
)
def test_configs_dflashkit_cannot_run_are_refused_by_name(change, words) -> None:
    raw = config().to_zlab_dict()
    raw["dflash_config"].update(change)
    for name, value in change.items():
        if value is None:
            del raw["dflash_config"][name]
    with pytest.raises(ConfigError, match=words):
        DrafterConfig.from_zlab_dict(raw, source="x.json")


def test_teacher_forced_blocks_equal_a_float64_loop() -> None:
    for prefix in (0, 1, 3):
        torch.manual_seed(prefix)
        d = DFlashDrafter(config(pure_draft_prefix_len=prefix))
        with torch.no_grad():
            d.embed_proj[2].weight.normal_(0, 1.0)
        g = torch.Generator().manual_seed(7)
        base, hidden = torch.randn(2, 4, 97, generator=g), torch.randn(2, 4, 64, generator=g)
        embed, prevs = torch.randn(97, 64, generator=g), torch.randint(0, 97, (2, 4), generator=g)
        got = corrected_logits(d, base, hidden, token_embeddings(d, prevs, embed))
        w = weights64(d)
        for n in range(2):
            states = gru64(w, [embed[int(p)] for p in prevs[n]])
            for k in range(4):
                want = corrected64(w, k, base[n, k], hidden[n, k], states[k])
                assert torch.allclose(got[n, k].double(), want, atol=1e-5), (prefix, n, k)
                if k < prefix:
                    assert torch.equal(got[n, k], base[n, k])
