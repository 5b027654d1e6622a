"""Training Domino drafters: the objective (1 − λ)·CE(corrected) + λ·CE(backbone) and its gradients against a float64
Python loop of its definition (the GRU's equations, every slot, the uncorrected prefix, a reduced vocabulary's
unsupervised labels), λ's linear decay, and end to end on the tiny target: the loss falls, the correction learns, a
killed run resumes exactly, a DFlash checkpoint warm-starts it, per-slot metrics have the given token's entry first,
and what Domino cannot train with is refused by name."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads import TrainingTerms, head_of
from dflashkit.drafter.heads.domino_loss import lambda_base_at
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import ConfigError
from dflashkit.target.model import Target
from dflashkit.train.config import TrainConfig
from dflashkit.train.loop import train
from helpers.domino_reference import corrected64, gru64, weights64
from helpers.train_runs import write_tokens_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DRAFTER = {"num_hidden_layers": 1, "block_size": 4, "kind": "domino", "gru_hidden_dim": 8, "emb_dim": 8}


def _drafter(prefix: int = 1) -> DFlashDrafter:
    cfg = DrafterConfig(
        hidden_size=32, vocab_size=50, num_target_layers=6, target_layer_ids=[1, 3], num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=32, block_size=4,
        mask_token_id=3, kind="domino", gru_hidden_dim=6, emb_dim=5, pure_draft_prefix_len=prefix,
    )  # fmt: skip
    torch.manual_seed(0)
    d = DFlashDrafter(cfg)
    with torch.no_grad():
        d.embed_proj[2].weight.normal_(0, 1.0)
    return d


def reference64(d, w, hidden, head, labels, prevs, weights, embed, lam, normalizer):
    """(1 − λ)·Σ w_k·CE(corrected) + λ·Σ w_k·CE(base), / N, over slots with a label, from the definitions."""
    total = 0.0
    for n in range(labels.shape[0]):
        states = gru64(w, [embed[int(p)] for p in prevs[n]])
        for k in range(labels.shape[1]):
            y = int(labels[n, k])
            if y < 0:
                continue
            base = head.double() @ hidden[n, k]
            final = corrected64(w, k, base, hidden[n, k], states[k])
            ce_f = -torch.log_softmax(final, -1)[y]
            ce_b = -torch.log_softmax(base, -1)[y]
            total = total + float(weights[k]) * ((1 - lam) * ce_f + lam * ce_b)
    return total / normalizer


@pytest.mark.parametrize("prefix,step", [(1, 0), (1, 3), (0, 10), (2, 5)])
def test_objective_and_its_gradients_equal_a_float64_reference(prefix: int, step: int) -> None:
    d = _drafter(prefix)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 4, 32, generator=g, requires_grad=True)
    head = torch.randn(50, 32, generator=g)
    embed = torch.randn(50, 32, generator=g)
    labels = torch.randint(0, 50, (3, 4), generator=g)
    labels[1, 3] = labels[2, 2:] = -100
    prevs = torch.randint(0, 50, (3, 4), generator=g)
    weights = torch.exp(-torch.arange(4.0) / 7)
    cfg = TrainConfig(lambda_base_start=0.8, lambda_base_decay_ratio=0.5)
    terms = TrainingTerms(
        drafter=d, hidden=hidden, head_weight=head, labels=labels, prev_tokens=prevs, weights=weights,
        normalizer=2.5, step=step, train_cfg=cfg, weights_of=None, embed_weight=embed, total_steps=16,
    )  # fmt: skip
    own = head_of("domino").objective(terms)
    lam = lambda_base_at(cfg.head_options["domino"], step, 16)
    assert lam == pytest.approx(max(0.0, 0.8 * (1 - step / 8)))
    hidden64 = hidden.detach().double().requires_grad_(True)
    w = weights64(d, grad=True)
    want = reference64(d, w, hidden64, head, labels, prevs, weights, embed, lam, 2.5)
    assert float(own.loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    params = [d.prefix_gru.weight_ih_l0, d.prefix_gru.weight_hh_l0, d.embed_proj[0].weight, d.embed_proj[2].weight]
    got = torch.autograd.grad(own.loss, [hidden, *params], allow_unused=True)
    ref = torch.autograd.grad(want, [hidden64, w["wi"], w["wh"], w["w1"], w["w2"]], allow_unused=True)
    for a, b in zip(got, ref, strict=True):
        if b is None:  # prefix ≥ every corrected slot's index: no correction term
            assert a is None or float(a.abs().sum()) == 0
            continue
        assert torch.allclose(a.double(), b, atol=1e-6), float((a.double() - b).abs().max())
    counts = (labels >= 0).sum(0)
    assert own.valid_counts.tolist() == counts.tolist() and (own.correct_counts <= own.valid_counts).all()


def test_lambda_falls_linearly_to_zero_over_the_decay_ratio() -> None:
    cfg = SimpleNamespace(lambda_base_start=1.0, lambda_base_decay_ratio=0.5)
    assert [lambda_base_at(cfg, s, 10) for s in range(7)] == [1.0, 0.8, 0.6, 0.4, pytest.approx(0.2), 0.0, 0.0]
    # a time-based run (its step count unknown ahead): the fraction of the schedule spent
    assert [lambda_base_at(cfg, 10**6, 10**9, f) for f in (0.0, 0.25, 0.5, 0.9)] == [1.0, 0.5, 0.0, 0.0]
    cfg.lambda_base_start = 0.0
    assert lambda_base_at(cfg, 0, 10) == 0.0


def test_a_block_without_live_slots_still_back_propagates() -> None:
    d = _drafter()
    hidden = torch.randn(2, 4, 32, requires_grad=True)
    terms = TrainingTerms(
        drafter=d, hidden=hidden, head_weight=torch.randn(50, 32), labels=torch.full((2, 4), -100),
        prev_tokens=torch.zeros(2, 4, dtype=torch.long), weights=torch.ones(4), normalizer=1.0, step=0,
        train_cfg=TrainConfig(lambda_base_start=1.0, lambda_base_decay_ratio=0.5), weights_of=None,
        embed_weight=torch.randn(50, 32), total_steps=4,
    )  # fmt: skip
    own = head_of("domino").objective(terms)
    own.loss.backward()  # a graph reaching every trainable input, all of it zero
    assert float(own.loss.detach()) == 0.0 and float(hidden.grad.abs().sum()) == 0.0
    assert d.embed_proj[2].weight.grad is not None and float(d.embed_proj[2].weight.grad.abs().sum()) == 0.0


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


def test_a_time_based_run_decays_lambda_by_the_time_spent(tmp_path: Path, target, tiny_llama_dir, monkeypatch):
    """With `schedule_minutes` and no max_steps the horizon is not a step count: the head is told the fraction of
    the schedule spent (training and validation alike), so λ reaches 0 within the run."""
    from dflashkit.drafter.heads.domino import DominoHead

    seen = []
    real = DominoHead.objective

    def spy(self, terms):
        seen.append((terms.step, terms.progress))
        return real(self, terms)

    monkeypatch.setattr(DominoHead, "objective", spy)
    tokens = write_tokens_file(tmp_path / "tokens.jsonl", 4)
    cfg = cfg_for(tmp_path / "t", tokens=str(tokens), online=True, target=str(tiny_llama_dir), max_steps=None,
                  schedule_minutes=0.02, eval_every=0, save_every=0)  # fmt: skip
    train(cfg, target=target)
    progress = [p for _, p in seen]
    assert progress[0] == 0.0 and all(p is not None for p in progress)
    assert progress == sorted(progress) and progress[-1] > 0.5  # λ (ratio 0.5) has reached 0 before the end


@pytest.mark.parametrize(
    "drafter,train_kw,words",
    [
        ({}, {"loss": "kl"}, "loss"),
        ({}, {"position_weights": "dpace"}, "position_weights"),
        ({}, {"fsdp": True}, "fsdp"),
        ({"pure_draft_prefix_len": 4}, {}, "pure_draft_prefix_len"),
    ],
)
def test_refusals_name_the_setting(tmp_path: Path, target: Target, tiny_llama_dir, drafter, train_kw, words) -> None:
    tokens = write_tokens_file(tmp_path / "tokens.jsonl", 2)
    cfg = cfg_for(
        tmp_path / "r", tokens=str(tokens), online=True, target=str(tiny_llama_dir), drafter={**DRAFTER, **drafter},
        **train_kw,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=words):
        train(cfg, target=target)
