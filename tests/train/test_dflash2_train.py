"""Training DFlash2 drafters: the selector term against a float64 Python loop of its definition (both rules — gold
injected at rank K, strict top-K — slot decay or uniform weights, the warmup and ramp of its weight), its gradient
against autograd of that reference, and end to end on the tiny target: the loss falls, the selector and the
convolutions learn, a killed run resumes exactly, a DFlash checkpoint warm-starts it, and what DFlash2 cannot train
with is refused by name."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflashkit.drafter.checkpoint import load_drafter
from dflashkit.drafter.heads import TrainingTerms
from dflashkit.drafter.heads.dflash2 import DFlash2Head
from dflashkit.drafter.heads.dflash2_loss import selector_loss, selector_weight_at
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import ConfigError
from dflashkit.target.model import Target
from dflashkit.train.config import TrainConfig
from dflashkit.train.loop import train
from dflashkit.train.losses import decay_weights
from helpers.train_runs import write_tokens_file

DRAFTER = {"num_hidden_layers": 1, "block_size": 4, "kind": "dflash2", "selector_rank": 8, "selector_top_k": 4}
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _drafter(seed: int = 0, vocab: int = 50) -> DFlashDrafter:
    from dflashkit.drafter.config import DrafterConfig

    cfg = DrafterConfig(
        hidden_size=32, vocab_size=vocab, num_target_layers=6, target_layer_ids=[1, 3], num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=32, block_size=4,
        mask_token_id=3, kind="dflash2", conv_group_size=16, selector_rank=4, selector_top_k=3,
        output_multiplier=1.5,
    )  # fmt: skip
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in (d.candidate_selector.predecessor_codebook, d.candidate_selector.successor_codebook):
            p.normal_(0, 1.0)
    return d


def reference64(d, hidden, head, labels, prevs, weights, rule, decay, normalizer):
    """Σ_k w_k·CE_k / N over live slots, each slot's K-way CE built from the definition in float64."""
    sel = d.candidate_selector
    a = sel.predecessor_codebook.double()
    b = sel.successor_codebook.double()
    p = sel.hidden_projection.weight.double()
    k = sel.top_k
    total = 0.0
    for n in range(labels.shape[0]):
        for s in range(labels.shape[1]):
            y = int(labels[n, s])
            if y < 0 or float(weights[s]) == 0:
                continue
            h = hidden[n, s].double()
            u = d.config.head_settings.output_multiplier * (head.double() @ h)  # (V,)
            cands = u.topk(k).indices.tolist()
            if y not in cands:
                if rule == "strict":
                    continue
                cands[-1] = y
            ph = p @ h
            scores = torch.stack([u[c] + (a[int(prevs[n, s])] * ph * b[c]).sum() for c in cands])
            ce = -torch.log_softmax(scores, -1)[cands.index(y)]
            total = total + (float(weights[s]) if decay else 1.0) * ce
    return total / normalizer


@pytest.mark.parametrize("rule,decay", [("inject", True), ("strict", True), ("inject", False)])
def test_selector_term_and_its_gradient_equal_a_float64_reference(rule: str, decay: bool) -> None:
    d = _drafter()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 4, 32, generator=g, requires_grad=True)
    head = torch.randn(50, 32, generator=g)
    labels = torch.randint(0, 50, (5, 4), generator=g)
    labels[1, 2] = labels[3, 0] = -100
    prevs = torch.randint(0, 50, (5, 4), generator=g)
    weights = decay_weights(4)
    with torch.no_grad():  # a few labels inside the top-K, so both branches of the rules run
        for n in (0, 2, 4):
            labels[n, 1] = int((1.5 * head @ hidden[n, 1]).argmax())
    cfg = SimpleNamespace(selector_rule=rule, selector_decay=decay, selector_weight=0.7, selector_warmup_steps=0,
                          selector_ramp_steps=0)  # fmt: skip
    terms = TrainingTerms(
        drafter=d, hidden=hidden, head_weight=head, labels=labels, prev_tokens=prevs, weights=weights,
        normalizer=3.0, step=0, train_cfg=cfg, weights_of=lambda ce, counted: weights[None].expand_as(ce) * counted,
    )  # fmt: skip
    got = selector_loss(terms, cfg, terms.weights_of)
    hidden64 = hidden.detach().double().requires_grad_(True)
    want = 0.7 * reference64(d, hidden64, head, labels, prevs, weights, rule, decay, 3.0)
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    (gh,) = torch.autograd.grad(got, hidden)
    (wh,) = torch.autograd.grad(want, hidden64)
    assert torch.allclose(gh.double(), wh, atol=1e-5)
    assert gh[1, 2].abs().sum() == 0 and gh[:, 0].abs().sum() == 0  # no label / the anchor slot: no gradient


def test_selector_weight_warms_up_then_ramps() -> None:
    cfg = SimpleNamespace(selector_weight=2.0, selector_warmup_steps=3, selector_ramp_steps=4)
    assert [selector_weight_at(cfg, s) for s in range(9)] == [0, 0, 0, 0.5, 1.0, 1.5, 2.0, 2.0, 2.0]
    cfg.selector_ramp_steps = 0
    assert [selector_weight_at(cfg, s) for s in (2, 3)] == [0, 2.0]


@pytest.fixture(scope="module")
def target(tiny_llama_dir: Path) -> Target:
    return Target.load(tiny_llama_dir)


def cfg_for(out: Path, **kw) -> TrainConfig:
    base = dict(
        out=str(out), drafter=dict(DRAFTER), max_tokens=48, max_steps=8, save_every=4, progress=False,
        tensorboard=False, lr=3e-3, val_samples=1, eval_every=4,
    )  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def test_the_step_scales_the_unary_logits_once(tmp_path: Path, target: Target, tiny_llama_dir, monkeypatch) -> None:
    """With output_multiplier m the block objective reads m·W's rows; the selector term gets the LM head's own rows W
    (it scales its candidates' logits itself: `selector_terms`), so its scores are m·h·W + pair, not m²·h·W."""
    seen = []
    real = DFlash2Head.training_loss

    def spy(self, terms):
        seen.append(terms.head_weight.detach().clone())
        return real(self, terms)

    monkeypatch.setattr(DFlash2Head, "training_loss", spy)
    tokens = write_tokens_file(tmp_path / "tokens.jsonl", 2)
    drafter = {**DRAFTER, "output_multiplier": 1.5}
    kw = dict(tokens=str(tokens), online=True, target=str(tiny_llama_dir), max_steps=1, drafter=drafter)
    train(cfg_for(tmp_path / "m", **kw), target=target)
    d = load_drafter(tmp_path / "m" / "final")
    rows = target.lm_head_weight.float()
    if d.config.draft_vocab_size is not None:
        rows = rows[d.draft_to_target]
    assert seen and torch.equal(seen[0].float(), rows)


@pytest.mark.parametrize(
    "drafter,train_kw,words",
    [
        ({}, {"loss": "topk"}, "topk"),
        ({"final_logit_softcapping": 30.0}, {}, "final_logit_softcapping"),
        ({}, {"fsdp": True}, "fsdp"),
    ],
)
def test_refusals_name_the_setting(tmp_path: Path, target: Target, tiny_llama_dir, drafter, train_kw, words) -> None:
    tokens = write_tokens_file(tmp_path / "tokens.jsonl", 2)
    cfg = cfg_for(
        tmp_path / "r", tokens=str(tokens), online=True, target=str(tiny_llama_dir),
        drafter={**DRAFTER, **drafter}, **train_kw,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=words):
        train(cfg, target=target)
