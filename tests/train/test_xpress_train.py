"""Training XPress drafters: the objective L(teacher-forced) + consistency_weight·mean L(free-running rounds) +
base_anchor_weight·L(backbone), L = (1 − α)·TV + α·CE, and its gradients against a float64 Python loop of its
definition (the refiner's equations, argmax guesses between rounds, slot 0 reading the token before the anchor,
unsupervised labels); the token before a document's first anchor; and end to end on the tiny target: the loss falls,
the refiner learns, a killed run resumes exactly, a DFlash checkpoint warm-starts it, and what XPress cannot train
with is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads import TrainingTerms, head_of
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import ConfigError
from dflashkit.target.model import Target
from dflashkit.train.config import TrainConfig
from dflashkit.train.loop import train
from dflashkit.train.losses import DISTRIBUTION_KINDS, LMHead, LossSpec, LossTarget, block_loss, decay_weights
from helpers.train_runs import write_tokens_file
from helpers.xpress_reference import bias64, weights64

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DRAFTER = {"num_hidden_layers": 1, "block_size": 4, "kind": "xpress", "xpress_rank": 8}


def _drafter(bs: int = 4) -> DFlashDrafter:
    cfg = DrafterConfig(
        hidden_size=32, vocab_size=50, num_target_layers=6, target_layer_ids=[1, 3], num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=32, block_size=bs,
        mask_token_id=3, kind="xpress", xpress_rank=6,
    )  # fmt: skip
    torch.manual_seed(0)
    d = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in d.refiner_head.parameters():
            p.normal_(0, 0.4)
    return d


def _terms(d, hidden, head, labels, prevs, weights, target, cfg, normalizer) -> TrainingTerms:
    def backbone_loss(states, rows, kind=None, extra=None):  # as the train step forms it
        spec = LossSpec(kind=kind or cfg.loss, weights=weights, normalizer=normalizer)
        t = LossTarget(logits=target if spec.kind in DISTRIBUTION_KINDS else None)
        return block_loss(states, LMHead(rows, extra), labels, spec, t)

    return TrainingTerms(
        drafter=d, hidden=hidden, head_weight=head, labels=labels, prev_tokens=prevs, weights=weights,
        normalizer=normalizer, step=0, train_cfg=cfg, weights_of=None, backbone_loss=backbone_loss,
    )  # fmt: skip


def reference64(w, hidden, head, labels, prevs, weights, target, cfg, normalizer):
    """The module docstring's loss from the definitions, block by block, slot by slot."""
    opts = cfg.head_options["xpress"]
    alpha = opts.xpress_ce_weight if cfg.loss != "ce" else 1.0

    def term(n, z):  # Σ_k w_k·[(1 − α)·TV + α·CE] over block n's supervised slots
        out = 0.0
        for k in range(z.shape[0]):
            y = int(labels[n, k])
            if y < 0 or float(weights[k]) == 0:
                continue
            q = torch.softmax(z[k], -1)
            tv = 1 - torch.minimum(q, torch.softmax(target[n, k].double(), -1)).sum()
            ce = -torch.log_softmax(z[k], -1)[y]
            out = out + float(weights[k]) * ((1 - alpha) * tv + alpha * ce)
        return out

    total = 0.0
    for n in range(labels.shape[0]):
        base = hidden[n] @ head.double().t()  # (bs, V)
        total = total + term(n, base + bias64(w, hidden[n], prevs[n].tolist()))
        guess, rounds = base.argmax(-1).tolist(), []
        for _ in range(opts.consistency_passes):
            guess[0] = int(prevs[n, 1])  # the anchor
            z = base + bias64(w, hidden[n], [int(prevs[n, 0]), *guess[:-1]])
            rounds.append(term(n, z))
            guess = z.argmax(-1).tolist()
        if rounds:
            total = total + opts.consistency_weight * sum(rounds) / len(rounds)
        total = total + opts.base_anchor_weight * term(n, base)
    return total / normalizer


@pytest.mark.parametrize(
    "loss,passes,cw,bw", [("tv", 3, 0.3, 0.6), ("ce", 2, 0.5, 0.0), ("tv", 0, 0.3, 0.6), ("tv", 1, 1.0, 1.0)]
)
def test_objective_and_its_gradients_equal_a_float64_reference(loss, passes, cw, bw) -> None:
    d = _drafter()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 4, 32, generator=g, requires_grad=True)
    head = torch.randn(50, 32, generator=g) * 0.5
    target = torch.randn(3, 4, 50, generator=g) * 2
    labels = torch.randint(0, 50, (3, 4), generator=g)
    labels[1, 3] = labels[2, 2:] = -100
    prevs = torch.randint(0, 50, (3, 4), generator=g)
    weights = decay_weights(4, 3.0)
    cfg = TrainConfig(loss=loss, xpress_ce_weight=0.1, consistency_weight=cw, consistency_passes=passes,
                      base_anchor_weight=bw)  # fmt: skip
    own = head_of("xpress").objective(_terms(d, hidden, head, labels, prevs, weights, target, cfg, 2.5))
    hidden64 = hidden.detach().double().requires_grad_(True)
    w = weights64(d, grad=True)
    want = reference64(w, hidden64, head, labels, prevs, weights, target, cfg, 2.5)
    assert float(own.loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    ref = d.refiner_head
    params = [ref.token_embed.weight, ref.down_h.weight, ref.down_g.weight, ref.in_proj.weight, ref.mix_l,
              ref.mlp_gate.weight, ref.mlp_up.weight, ref.mlp_down.weight, ref.readout.weight]  # fmt: skip
    names = ["token_embed", "down_h", "down_g", "in_proj", "mix_l", "mlp_gate", "mlp_up", "mlp_down", "readout"]
    got = torch.autograd.grad(own.loss, [hidden, *params])
    want_g = torch.autograd.grad(want, [hidden64, *[w[n] for n in names]])
    for name, a, b in zip(["hidden", *names], got, want_g, strict=True):
        scale = max(1.0, float(b.abs().max()))
        assert float((a.double() - b).abs().max()) <= 1e-5 * scale, name
    assert own.valid_counts.tolist() == (labels >= 0).sum(0).tolist()


@pytest.mark.parametrize("kind,dpace", [("ce", False), ("ce", True), ("tv", False), ("lk_lambda", False)])
def test_extra_rows_equal_the_concatenated_head_without_its_gradient(kind: str, dpace: bool) -> None:
    """block_loss over [h ; x] with frozen rows W and trainable extra rows R gives the loss, predictions and the
    gradients of [h ; x] and R that the concatenated head [W ; R] gives, and forms no gradient for W."""
    g = torch.Generator().manual_seed(5)
    states = torch.randn(3, 4, 32 + 6, generator=g)
    w, r = torch.randn(50, 32, generator=g), torch.randn(50, 6, generator=g) * 0.5
    labels = torch.randint(0, 50, (3, 4), generator=g)
    labels[2, 3] = -100
    target = torch.randn(3, 4, 50, generator=g) if kind != "ce" else None
    spec = LossSpec(kind=kind, normalizer=3.0, chunk_size=2, position_weights="dpace" if dpace else "decay")
    t = LossTarget(logits=target)
    a_states, a_rows = states.clone().requires_grad_(True), torch.cat([w, r], 1).requires_grad_(True)
    want = block_loss(a_states, a_rows, labels, spec, t)
    want.loss.backward()
    b_states, b_r = states.clone().requires_grad_(True), r.clone().requires_grad_(True)
    got = block_loss(b_states, LMHead(w, b_r), labels, spec, t)
    got.loss.backward()
    assert float(got.loss.detach()) == pytest.approx(float(want.loss.detach()), rel=1e-6)
    assert torch.equal(got.correct_counts, want.correct_counts)
    torch.testing.assert_close(b_states.grad, a_states.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b_r.grad, a_rows.grad[:, 32:], rtol=1e-5, atol=1e-6)


def test_the_token_before_the_anchor_is_slot_zeros_previous_token() -> None:
    """Packed rows: slot 0 reads the token before its anchor within the document, the anchor itself at a document's
    first token (speculators' rule); slots k ≥ 1 read a + k − 1."""
    from dflashkit.train.blocks import build_blocks
    from dflashkit.train.packing import RowBatch
    from dflashkit.train.step import block_predecessors

    ids = torch.arange(10, 30)[None]  # (1, 20)
    doc = torch.tensor([[0] * 8 + [1] * 12])
    rows = RowBatch(
        input_ids=ids, doc_ids=doc, positions=torch.cat([torch.arange(8), torch.arange(12)])[None],
        loss_mask=torch.ones(1, 20, dtype=torch.bool), features=torch.zeros(1, 20, 1), target_tokens=None, row_ids=[0],
    )  # fmt: skip
    blocks = build_blocks(rows.input_ids, rows.doc_ids, rows.positions, rows.loss_mask, block_size=4,
                          anchors=[torch.tensor([0, 3, 8, 12])], num_blocks=4)  # fmt: skip
    prev = block_predecessors(rows, blocks)[0]
    assert prev.tolist() == [[10, 10, 11, 12], [12, 13, 14, 15], [18, 18, 19, 20], [21, 22, 23, 24]]


@pytest.fixture(scope="module")
def target(tiny_llama_dir: Path) -> Target:
    return Target.load(tiny_llama_dir)


def cfg_for(out: Path, **kw) -> TrainConfig:
    base = dict(
        out=str(out), drafter=dict(DRAFTER), max_tokens=48, max_steps=8, save_every=4, progress=False,
        tensorboard=False, lr=3e-3, val_samples=1, eval_every=4, loss="tv",
    )  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize(
    "train_kw,words",
    [
        ({"loss": "topk"}, "loss"),
        ({"fsdp": True}, "fsdp"),
        ({"loss": "ce", "xpress_ce_weight": 0.5}, "xpress_ce_weight: 0.5 has no effect with loss: ce"),
        ({"loss": "ce", "consistency_weight": 0.0, "consistency_passes": 5}, "consistency_passes: 5 has no effect"),
    ],
)
def test_refusals_name_the_setting(tmp_path: Path, target: Target, tiny_llama_dir, train_kw, words) -> None:
    tokens = write_tokens_file(tmp_path / "tokens.jsonl", 2)
    cfg = cfg_for(tmp_path / "r", tokens=str(tokens), online=True, target=str(tiny_llama_dir), **train_kw)
    with pytest.raises(ConfigError, match=words):
        train(cfg, target=target)
