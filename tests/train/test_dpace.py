"""D-PACE position weights (`position_weights: dpace`): the weights against a float64 Python loop of the closed form,
the chunked loss and its gradients against a float64 reference (frozen and trainable head), the normaliser's
split invariance, refusals with soft losses, the config rules, and a short training run through the whole loop."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dflashkit.data.samples import Sample
from dflashkit.drafter.checkpoint import read_tensors
from dflashkit.drafter.defaults import default_drafter_config
from dflashkit.errors import ConfigError
from dflashkit.target.model import Target
from dflashkit.train.config import TrainConfig, check_resume_compatible
from dflashkit.train.loop import train
from dflashkit.train.losses import LossSpec, LossTarget, block_loss, dpace_weights, draft_slot_weights
from dflashkit.train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def loop_weights(ce: list[list[float]], valid: list[list[bool]], alpha: float) -> list[list[float]]:
    """The D-PACE formula slot by slot, in Python floats (float64)."""
    out = []
    for ce_b, m_b in zip(ce, valid, strict=True):
        bs = len(ce_b)
        c, prod = [], 1.0
        for j in range(bs):
            q_tilde = (1 - alpha) * math.exp(-ce_b[j]) + alpha if m_b[j] else 1.0
            prod *= q_tilde
            c.append(prod)
        out.append([sum(c[k] for k in range(j, bs) if m_b[k]) if m_b[j] else 0.0 for j in range(bs)])
    return out


def _problem(seed: int, n: int = 9, bs: int = 5, h: int = 6, v: int = 13):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, bs, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (n, bs), generator=g)
    labels[torch.rand(n, bs, generator=g) < 0.2] = -100  # gaps inside blocks too
    labels[0] = -100  # a padding block
    return hidden, weight, labels


def reference_loss(hidden, weight, labels, alpha: float):
    """Σ m_j·w_j·CE_j / Σ m_j in float64, w from the Python loop (a constant: no gradient through it)."""
    logits = hidden.double() @ weight.double().t()  # (N, bs, V)
    ce = -logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)  # (N, bs)
    valid = labels != -100
    valid[:, 0] = False  # slot 0 is the anchor
    w = torch.tensor(loop_weights(ce.detach().tolist(), valid.tolist(), alpha), dtype=torch.float64)
    m = valid.double()
    return (m * w * ce).sum() / m.sum()


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_weights_equal_the_closed_form_loop(alpha: float) -> None:
    g = torch.Generator().manual_seed(1)
    ce = torch.rand(6, 7, generator=g, dtype=torch.float64) * 4
    valid = torch.rand(6, 7, generator=g) > 0.25
    valid[:, 0] = False
    got = dpace_weights(ce, valid, alpha)
    torch.testing.assert_close(got, torch.tensor(loop_weights(ce.tolist(), valid.tolist(), alpha), dtype=torch.float64))
    if alpha == 1.0:  # q̃ ≡ 1: w_j = the number of valid slots from j on
        counts = torch.flip(torch.cumsum(torch.flip(valid.double(), [-1]), -1), [-1]) * valid
        torch.testing.assert_close(got, counts)


def test_weights_fall_behind_an_unlikely_slot() -> None:
    valid = torch.tensor([[False, True, True, True]])
    confident = dpace_weights(torch.tensor([[0.0, 0.01, 0.01, 0.01]]), valid, 0.5)
    blocked = dpace_weights(torch.tensor([[0.0, 9.0, 0.01, 0.01]]), valid, 0.5)
    assert blocked[0, 2] < 0.6 * confident[0, 2] and blocked[0, 3] < 0.6 * confident[0, 3]
    assert (confident[0, 1:] > 0).all() and confident[0, 0] == 0


@pytest.mark.parametrize("alpha", [0.0, 0.5])
@pytest.mark.parametrize("chunk", [1, 4, None])
@pytest.mark.parametrize("train_head", [False, True])
def test_loss_and_grads_equal_the_float64_reference(alpha: float, chunk: int | None, train_head: bool) -> None:
    hidden, weight, labels = _problem(2)
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_(train_head)
    ref = reference_loss(h_ref, w_ref, labels, alpha)
    ref.backward()
    h32, w32 = hidden.float().requires_grad_(), weight.float().requires_grad_(train_head)
    out = block_loss(h32, w32, labels, LossSpec(position_weights="dpace", dpace_alpha=alpha, chunk_size=chunk))
    out.loss.backward()
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h32.grad.double(), h_ref.grad, rtol=1e-4, atol=1e-6)
    if train_head:
        torch.testing.assert_close(w32.grad.double(), w_ref.grad, rtol=1e-4, atol=1e-6)
    else:
        assert w32.grad is None
    valid = (labels != -100) & (torch.arange(labels.shape[1]) > 0)
    assert float(out.weight_sum) == valid.sum()  # N = Σ m, the number of valid draft slots


def test_global_normaliser_makes_splits_add_up() -> None:
    hidden, weight, labels = _problem(3, n=8)
    whole = block_loss(hidden, weight, labels, LossSpec(position_weights="dpace"))
    n = whole.weight_sum
    parts = [
        block_loss(hidden[s], weight, labels[s], LossSpec(position_weights="dpace", normalizer=n))
        for s in (slice(0, 3), slice(3, 8))
    ]
    torch.testing.assert_close(sum(p.loss for p in parts), whole.loss)
    assert torch.equal(sum(p.correct_counts for p in parts), whole.correct_counts)


def test_differs_from_the_decay_and_is_refused_with_soft_losses() -> None:
    hidden, weight, labels = _problem(4)
    assert not torch.allclose(
        block_loss(hidden, weight, labels).loss,
        block_loss(hidden, weight, labels, LossSpec(position_weights="dpace")).loss,
    )
    target = torch.randn(*labels.shape, weight.shape[0], dtype=torch.float64)
    with pytest.raises(ValueError, match="hard-label cross-entropy"):
        block_loss(hidden, weight, labels, LossSpec(kind="kl", position_weights="dpace"), LossTarget(logits=target))
    with pytest.raises(ValueError, match="position_weights"):
        block_loss(hidden, weight, labels, LossSpec(position_weights="linear"))
    with pytest.raises(ValueError, match="dpace_alpha"):
        dpace_weights(torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool), 1.5)
    assert draft_slot_weights(4).tolist() == [0.0, 1.0, 1.0, 1.0]


def test_config_rules_and_resume_lock() -> None:
    TrainConfig(features="f", position_weights="dpace", dpace_alpha=0.3).validate()
    for bad, field in (
        (dict(position_weights="dpace", loss="topk"), "position_weights"),
        (dict(position_weights="dpace", loss="kl"), "position_weights"),
        (dict(position_weights="dpace", gamma=5.0), "gamma"),
        (dict(dpace_alpha=0.3), "dpace_alpha"),
        (dict(position_weights="dpace", dpace_alpha=1.5), "dpace_alpha"),
    ):
        with pytest.raises(ConfigError, match=field):
            TrainConfig(features="f", **bad).validate()
    summary = TrainConfig(features="f", position_weights="dpace").summary()
    assert "D-PACE position weights (α 0.5)" in summary
    with pytest.raises(ConfigError, match="position_weights"):
        check_resume_compatible(TrainConfig().to_dict(), TrainConfig(position_weights="dpace"), where="run")
    saved = {k: v for k, v in TrainConfig().to_dict().items() if k not in ("position_weights", "dpace_alpha")}
    check_resume_compatible(saved, TrainConfig(), where="old run")  # checkpoints that predate the fields


def test_train_with_dpace_learns_validates_and_resumes_exactly(tmp_path: Path, tiny_llama_dir: Path) -> None:
    target = Target.load(tiny_llama_dir)
    drafter = {"num_hidden_layers": 1, "block_size": 4}
    layer_ids = default_drafter_config(target, **drafter).target_layer_ids
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(4):
        ids = torch.randint(3, target.vocab_size, (18 + 4 * i,), generator=g)
        mask = torch.ones(ids.numel(), dtype=torch.bool)
        mask[:4] = False
        res = target.forward(ids[None], layer_ids=layer_ids)
        samples.append(Sample(f"s{i}", ids, mask, res.features[0], res.logits[0].argmax(-1)))

    def cfg(out: str) -> TrainConfig:
        return TrainConfig(
            out=str(tmp_path / out),
            drafter=dict(drafter),
            max_tokens=48,
            max_steps=8,
            save_every=4,
            progress=False,
            tensorboard=False,
            lr=3e-3,
            val_samples=1,
            eval_every=4,
            position_weights="dpace",
        )

    straight = train(cfg("a"), dataset=samples, target=target)
    assert straight.step == 8 and straight.val_metrics is not None and math.isfinite(straight.val_metrics["loss"])
    losses = [r["loss"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if r["split"] == "train"]
    assert all(0 < v < 50 for v in losses) and losses[-1] < losses[0]

    def kill(end) -> None:
        if end.step == 4:
            raise RuntimeError("simulated kill")

    with pytest.raises(RuntimeError, match="simulated kill"):
        train(cfg("b"), dataset=samples, target=target, callbacks=[kill])
    resumed = train(cfg("b"), dataset=samples, target=target)
    assert resumed.step == 8
    a, b = read_tensors(tmp_path / "a" / "final"), read_tensors(tmp_path / "b" / "final")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
