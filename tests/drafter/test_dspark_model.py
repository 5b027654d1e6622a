"""DSpark drafters (`kind: dspark`): config.json in the layout DeepSpec and llama.cpp read, bit-exact checkpoint round
trips with the heads' weight names, a fresh drafter equal to its backbone, the Markov chain at inference and the
refusal of DSpark variants dflashkit cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflashkit.drafter.checkpoint import load_drafter, read_tensors, save_drafter
from dflashkit.drafter.config import DrafterConfig, parameter_count
from dflashkit.drafter.heads.dspark_net import markov_chain
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import ConfigError


def small(**kw) -> DrafterConfig:
    base = dict(
        hidden_size=16,
        vocab_size=50,
        num_target_layers=6,
        target_layer_ids=[1, 4],
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=32,
        block_size=4,
        kind="dspark",
        markov_rank=5,
    )
    return DrafterConfig(**{**base, **kw})


def test_config_json_fields_and_round_trip(tmp_path: Path) -> None:
    cfg = small(draft_vocab_size=20)
    raw = cfg.to_zlab_dict()
    assert raw["architectures"] == ["Qwen3DSparkModel"]
    assert raw["markov_rank"] == 5 and raw["markov_head_type"] == "vanilla" and raw["sample_from_anchor"] is True
    assert raw["enable_confidence_head"] is True and raw["confidence_head_with_markov"] is True
    assert raw["target_layer_ids"] == [1, 4] and raw["block_size"] == 4
    assert DrafterConfig.from_zlab_dict(raw) == cfg
    plain = small(kind="dflash", markov_rank=256)  # the rank is not stored for DFlash
    assert "markov_rank" not in plain.to_zlab_dict() and DrafterConfig.from_zlab_dict(plain.to_zlab_dict()) == plain

    torch.manual_seed(0)
    d = DFlashDrafter(cfg)
    with torch.no_grad():
        d.markov_head.markov_w2.weight.normal_()
        d.draft_to_target.copy_(torch.arange(20) * 2)
    assert sum(p.numel() for p in d.parameters()) + 2 * 20 == parameter_count(cfg)
    save_drafter(d, tmp_path / "ck")
    names = set(read_tensors(tmp_path / "ck"))
    assert {
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
        "confidence_head.proj.bias",
    } <= names
    back = load_drafter(tmp_path / "ck")
    assert back.config == cfg
    for k, v in d.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    assert read_tensors(tmp_path / "ck")["markov_head.markov_w2.weight"].shape == (20, 5)  # r → V'


def test_fresh_markov_head_adds_nothing_and_the_chain_is_left_to_right() -> None:
    torch.manual_seed(1)
    d = DFlashDrafter(small(confidence_head=False))
    assert not hasattr(d, "confidence_head") and d.first_draft_slot() == 0
    assert not d.markov_head.bias(torch.tensor([3, 7])).any()  # W2 = 0 at init
    with torch.no_grad():
        d.markov_head.markov_w2.weight.normal_()
    base = torch.randn(3, 50)
    drafts, corrected, prevs = markov_chain(base, 9, d.markov_head, lambda z: int(z.argmax()), lambda i: i)
    assert prevs == [9, drafts[0], drafts[1]]
    for k in range(3):
        row = base[k] + d.markov_head.bias(torch.tensor(prevs[k]))
        torch.testing.assert_close(corrected[k], row)
        assert drafts[k] == int(row.argmax())


def test_unsupported_dspark_variants_are_refused() -> None:
    raw = small().to_zlab_dict()
    for change, match in (
        ({"markov_head_type": "gated"}, "markov_head_type"),
        ({"sample_from_anchor": False}, "sample_from_anchor"),
        ({"confidence_head_with_markov": False}, "confidence_head_with_markov"),
        ({"markov_rank": "big"}, "markov_rank"),
        ({"architectures": ["DSparkDraftModel"]}, "DeepSeek-V4"),
    ):
        with pytest.raises(ConfigError, match=match):
            DrafterConfig.from_zlab_dict({**raw, **change}, source="x/config.json")
    with pytest.raises(ConfigError, match="kind"):
        small(kind="medusa")
    assert json.loads(json.dumps(raw))["architectures"] == ["Qwen3DSparkModel"]
