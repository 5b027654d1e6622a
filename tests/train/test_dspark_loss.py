"""The DSpark loss against a float64 autograd reference written from DeepSpec's definition (CE + L1 + confidence
BCE, exp(−k/4) weights over a contiguous prefix, one normaliser Σw): values and gradients of every trainable part
(backbone states, W1, W2, confidence head), chunked or not, full or reduced draft vocabulary; and the metrics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads.dspark_loss import DSparkLossSpec, DSparkLossWeights, dspark_loss, dspark_slot_weights
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.train.losses import dpace_weights

V, H, R, G = 13, 8, 3, 4


def tiny_dspark(draft_vocab: int | None = None, confidence: bool = True) -> DFlashDrafter:
    cfg = DrafterConfig(
        hidden_size=H,
        vocab_size=V,
        num_target_layers=4,
        target_layer_ids=[0, 2],
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        intermediate_size=16,
        block_size=G,
        kind="dspark",
        markov_rank=R,
        confidence_head=confidence,
        draft_vocab_size=draft_vocab,
    )
    torch.manual_seed(0)
    d = DFlashDrafter(cfg).double()
    with torch.no_grad():
        d.markov_head.markov_w2.weight.normal_(0, 0.5)  # not the zero init: the bias must matter here
        d.markov_head.markov_w1.weight.normal_(0, 0.5)
        if draft_vocab:
            d.draft_to_target.copy_(torch.tensor([0, 2, 3, 5, 8, 9, 12][:draft_vocab]))
    return d


def _problem(seed: int, n: int = 6):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, G, H, generator=g, dtype=torch.float64)
    head = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (n, G), generator=g)
    for i, keep in enumerate([4, 4, 2, 0, 3, 1][:n]):  # valid prefixes of different lengths
        labels[i, keep:] = -100
    prevs = torch.cat([torch.randint(0, V, (n, 1), generator=g), labels[:, :-1].clamp(min=0)], 1)
    tlogits = torch.randn(n, G, V, generator=g, dtype=torch.float64) * 2
    return hidden, head, labels, prevs, tlogits


def reference(drafter, hidden, head, labels, prevs, tlogits, draft_labels=None):
    """The definition, in float64 autograd, over full (N, γ, V) tensors."""
    m = drafter.markov_head
    d2t = drafter.draft_to_target if drafter.config.draft_vocab_size else torch.arange(V)
    w_head = head[d2t]  # (V', H)
    emb = m.markov_w1(prevs)  # (N, γ, r)
    z = hidden @ w_head.t() + m.markov_w2(emb)  # (N, γ, V')
    logp = z.log_softmax(-1)
    p = logp.exp()
    pt = tlogits.softmax(-1)
    l1 = (p - pt[..., d2t]).abs().sum(-1) + (1 - pt[..., d2t].sum(-1))
    dl = labels if draft_labels is None else draft_labels
    ce = torch.where(dl >= 0, -logp.gather(-1, dl.clamp(min=0)[..., None]).squeeze(-1), 0.0)
    valid = labels != -100
    w = torch.exp(-torch.arange(G, dtype=torch.float64) / 4)[None] * valid
    total = (w * (0.1 * ce + 0.9 * l1)).sum()
    if getattr(drafter, "confidence_head", None) is not None:
        conf = drafter.confidence_head.proj(torch.cat([hidden, emb], -1)).squeeze(-1)
        y = (1 - 0.5 * l1.detach()).clamp(0, 1)
        total = total + (w * F.binary_cross_entropy_with_logits(conf, y, reduction="none")).sum()
    return total / w.sum()


def _grads(drafter, h):
    out = [h.grad, drafter.markov_head.markov_w1.weight.grad, drafter.markov_head.markov_w2.weight.grad]
    if getattr(drafter, "confidence_head", None) is not None:
        out += [drafter.confidence_head.proj.weight.grad, drafter.confidence_head.proj.bias.grad]
    return out


@pytest.mark.parametrize("chunk", [1, 5, None])
@pytest.mark.parametrize("confidence", [True, False])
def test_loss_and_grads_equal_the_float64_reference(chunk: int | None, confidence: bool) -> None:
    hidden, head, labels, prevs, tlogits = _problem(1)
    d_ref, d_got = tiny_dspark(confidence=confidence), tiny_dspark(confidence=confidence)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    ref = reference(d_ref, h1, head, labels, prevs, tlogits)
    ref.backward()
    out = dspark_loss(h2, head, d_got, labels, prevs, tlogits, DSparkLossSpec(chunk_rows=chunk))
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.detach())
    for a, b in zip(_grads(d_got, h2), _grads(d_ref, h1), strict=True):
        torch.testing.assert_close(a, b)


def test_reduced_draft_vocabulary_and_callable_target() -> None:
    hidden, head, labels, prevs, tlogits = _problem(2)
    d_ref, d_got = tiny_dspark(draft_vocab=7), tiny_dspark(draft_vocab=7)
    t2d = torch.full((V,), -100)
    t2d[d_got.draft_to_target] = torch.arange(7)
    draft_labels = torch.where(labels >= 0, t2d[labels.clamp(min=0)], -100)
    assert (draft_labels[labels >= 0] == -100).any()  # some labels fall outside: CE skipped, L1 and BCE kept
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    ref = reference(d_ref, h1, head, labels, prevs, tlogits, draft_labels)
    ref.backward()
    seen = []

    def rows(idx: torch.Tensor) -> torch.Tensor:
        seen.append(idx.numel())
        return tlogits.reshape(-1, V)[idx]

    out = dspark_loss(
        h2, head[d_got.draft_to_target], d_got, labels, prevs, rows, DSparkLossSpec(chunk_rows=4), draft_labels
    )
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.detach())
    for a, b in zip(_grads(d_got, h2), _grads(d_ref, h1), strict=True):
        torch.testing.assert_close(a, b)
    assert sum(seen) == int((labels != -100).sum())  # the target's logits only for supervised slots


def test_float32_close_to_float64_and_metrics() -> None:
    hidden, head, labels, prevs, tlogits = _problem(3)
    d = tiny_dspark()
    ref = dspark_loss(hidden, head, d, labels, prevs, tlogits).loss
    d32 = tiny_dspark().float()
    out = dspark_loss(hidden.float(), head.float(), d32, labels, prevs, tlogits.float())
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-5, atol=1e-6)
    valid = labels != -100
    assert out.valid_counts.tolist() == valid.sum(0).tolist()
    assert out.correct_counts.shape == (G,) and bool((out.correct_counts <= out.valid_counts).all())
    assert float(out.weight_sum) == pytest.approx(float((dspark_slot_weights(G)[None] * valid).sum()))


def test_normaliser_splits_and_bad_labels() -> None:
    hidden, head, labels, prevs, tlogits = _problem(4)
    d = tiny_dspark()
    whole = dspark_loss(hidden, head, d, labels, prevs, tlogits)
    parts = [
        dspark_loss(hidden[s], head, d, labels[s], prevs[s], tlogits[s], DSparkLossSpec(normalizer=whole.weight_sum))
        for s in (slice(0, 2), slice(2, 6))
    ]
    torch.testing.assert_close(sum(p.loss for p in parts), whole.loss)
    gappy = labels.clone()
    gappy[0, 1] = -100  # slot 2 valid after an invalid slot 1: teacher forcing would read a missing label
    with pytest.raises(ValueError, match="prefix"):
        dspark_loss(hidden, head, d, gappy, prevs, tlogits)
    zero = dspark_loss(hidden, head, d, labels, prevs, tlogits, DSparkLossSpec(DSparkLossWeights(0.0, 0.0, 0.0)))
    assert float(zero.loss.detach()) == 0.0


def test_target_logits_per_distinct_position_equal_per_slot() -> None:
    """A callable may return the logits of the distinct positions and each slot's index into them (what training
    does: overlapping blocks share positions); loss and gradients are unchanged."""
    hidden, head, labels, prevs, tlogits = _problem(5)
    n = labels.shape[0]
    tlogits[1:] = tlogits[0]  # every block reads the same positions
    flat = tlogits.reshape(-1, V)
    d1, d2 = tiny_dspark(draft_vocab=7), tiny_dspark(draft_vocab=7)
    t2d = torch.full((V,), -100)
    t2d[d1.draft_to_target] = torch.arange(7)
    dl = torch.where(labels >= 0, t2d[labels.clamp(min=0)], -100)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    per_slot = dspark_loss(h1, head[d1.draft_to_target], d1, labels, prevs, tlogits, draft_labels=dl)
    per_slot.loss.backward()

    def distinct(idx: torch.Tensor):
        pos = idx % G  # slot k of every block is position k
        uniq, inv = torch.unique(pos, return_inverse=True)
        return flat[uniq], inv

    shared = dspark_loss(h2, head[d2.draft_to_target], d2, labels, prevs, distinct, draft_labels=dl)
    shared.loss.backward()
    torch.testing.assert_close(shared.loss, per_slot.loss)
    for a, b in zip(_grads(d2, h2), _grads(d1, h1), strict=True):
        torch.testing.assert_close(a, b)
    assert n > 1


def test_draft_id_logits_with_the_log_sum_exp_equal_the_full_softmax() -> None:
    """The source training uses with a reduced vocabulary (`dflashkit.train.target_lse`): the target's logits of
    the draft ids and its log-sum-exp over the whole vocabulary give the same loss and gradients as its full
    logits (p = exp(z − lse) on the draft ids, the rest of the mass outside)."""
    hidden, head, labels, prevs, tlogits = _problem(6)
    flat = tlogits.reshape(-1, V)
    d1, d2 = tiny_dspark(draft_vocab=7), tiny_dspark(draft_vocab=7)
    d2t = d1.draft_to_target
    t2d = torch.full((V,), -100)
    t2d[d2t] = torch.arange(7)
    dl = torch.where(labels >= 0, t2d[labels.clamp(min=0)], -100)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    full = dspark_loss(h1, head[d2t], d1, labels, prevs, tlogits, draft_labels=dl)
    full.loss.backward()

    def draft_ids_and_lse(idx: torch.Tensor):
        uniq, inv = torch.unique(idx, return_inverse=True)
        return flat[uniq][:, d2t], torch.logsumexp(flat[uniq], dim=-1), inv

    got = dspark_loss(h2, head[d2t], d2, labels, prevs, draft_ids_and_lse, DSparkLossSpec(chunk_rows=5), dl)
    got.loss.backward()
    torch.testing.assert_close(got.loss, full.loss)
    for a, b in zip(_grads(d2, h2), _grads(d1, h1), strict=True):
        torch.testing.assert_close(a, b)


def dpace_reference(drafter, hidden, head, labels, prevs, tlogits, alpha: float, draft_labels=None):
    """DSpark + D-PACE by its definition, float64 with Python loops for the weights: CE_k weighted by D-PACE's
    w_k = Σ_{j≥k} m_j·Π_{i≤j} q̃_i (q̃ = (1 − α)·exp(−CE) + α on valid slots, detached), L1 and BCE by exp(−k/4), all
    divided by the number of valid slots."""
    m = drafter.markov_head
    d2t = drafter.draft_to_target if drafter.config.draft_vocab_size else torch.arange(V)
    emb = m.markov_w1(prevs)
    z = hidden @ head[d2t].t() + m.markov_w2(emb)
    logp = z.log_softmax(-1)
    pt = tlogits.softmax(-1)
    l1 = (logp.exp() - pt[..., d2t]).abs().sum(-1) + (1 - pt[..., d2t].sum(-1))
    dl = labels if draft_labels is None else draft_labels
    ce = torch.where(dl >= 0, -logp.gather(-1, dl.clamp(min=0)[..., None]).squeeze(-1), torch.inf)
    valid = labels != -100
    dw = torch.zeros_like(l1)
    for b in range(labels.shape[0]):
        for k in range(G):
            if not valid[b, k]:
                continue
            for j in range(k, G):
                if valid[b, j]:
                    prod = 1.0
                    for i in range(j + 1):
                        if valid[b, i]:
                            prod *= (1 - alpha) * float(torch.exp(-ce[b, i].detach())) + alpha
                    dw[b, k] += prod
    decay = torch.exp(-torch.arange(G, dtype=torch.float64) / 4)[None] * valid
    total = (dw * torch.where(dl >= 0, ce, 0.0)).sum() + (decay * l1).sum() * 0.9
    conf = drafter.confidence_head.proj(torch.cat([hidden, emb], -1)).squeeze(-1)
    y = (1 - 0.5 * l1.detach()).clamp(0, 1)
    total = total + (decay * F.binary_cross_entropy_with_logits(conf, y, reduction="none")).sum()
    return total / valid.sum()


@pytest.mark.parametrize("draft_vocab", [None, 7])
@pytest.mark.parametrize("alpha", [0.5, 0.1])
def test_dpace_weights_on_the_dspark_ce_equal_the_float64_reference(draft_vocab, alpha) -> None:
    hidden, head, labels, prevs, tlogits = _problem(3)
    d_ref, d_got = tiny_dspark(draft_vocab), tiny_dspark(draft_vocab)
    draft_labels, rows = None, head
    if draft_vocab:  # labels outside the draft vocabulary: no CE, and q = 0 for D-PACE (probability 0)
        t2d = torch.full((V,), -100)
        t2d[d_got.draft_to_target] = torch.arange(draft_vocab)
        draft_labels = torch.where(labels >= 0, t2d[labels.clamp(min=0)], -100)
        assert (draft_labels[labels >= 0] == -100).any()
        rows = head[d_got.draft_to_target]  # (V', H): the head rows of the draft ids
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    ref = dpace_reference(d_ref, h1, head, labels, prevs, tlogits, alpha, draft_labels)
    ref.backward()
    dpace = lambda ce, valid: dpace_weights(ce, valid, alpha)  # noqa: E731
    spec = DSparkLossSpec(DSparkLossWeights(ce=1.0), dpace=dpace, chunk_rows=5)
    out = dspark_loss(h2, rows, d_got, labels, prevs, tlogits, spec, draft_labels)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.detach())
    for a, b in zip(_grads(d_got, h2), _grads(d_ref, h1), strict=True):
        torch.testing.assert_close(a, b)
