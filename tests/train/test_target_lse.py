"""The per-row log-sum-exp cache DSpark training uses with a reduced draft vocabulary: equal to the log-sum-exp of
the target's verifier logits, chunking changes nothing, a row is computed once and keyed by its content (tokens
and documents), the cache stays within its bound, and a bf16 target gets the values of its own logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflashkit.target.model import Target
from dflashkit.train.target_lse import RowLogSumExp, row_logsumexp

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target(tiny_llama_dir: Path) -> Target:
    return Target.load(tiny_llama_dir)


def _final(target: Target, t: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, target.hidden_size, generator=g) * 3  # (T, H) a last layer's output before the norm


def test_row_logsumexp_equals_the_verifier_logits_and_ignores_chunking(target: Target) -> None:
    assert target.plain_head
    final = _final(target, 11, 0)
    want = torch.logsumexp(target.verifier_logits(final[None])[0].double(), dim=-1)  # (T,)
    for chunk in (None, 1, 4, 11):
        got = row_logsumexp(target, final, chunk=chunk)
        assert got.dtype == torch.float32 and got.shape == (11,)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)


def test_cache_computes_each_row_once_keyed_by_content(target: Target) -> None:
    finals = torch.stack([_final(target, 9, 1), _final(target, 9, 2)])  # (B, T, H)
    ids = torch.tensor([[5] * 9, [6] * 9])
    docs = torch.tensor([[0] * 9, [0] * 4 + [1] * 5])
    cache = RowLogSumExp()
    first = cache.rows(target, finals, ids, docs)
    assert first.shape == (2, 9) and cache.computed == 2 and len(cache) == 2
    for i in range(2):
        torch.testing.assert_close(first[i], row_logsumexp(target, finals[i]), rtol=0, atol=0)
    again = cache.rows(target, finals[[1, 0]], ids[[1, 0]], docs[[1, 0]])  # the same rows, another batch order
    assert cache.computed == 2 and torch.equal(again, first[[1, 0]])
    cache.rows(target, finals[:1], ids[:1], docs[1:])  # same tokens, other documents: another row
    assert cache.computed == 3


def test_cache_keeps_at_most_max_positions(target: Target) -> None:
    cache = RowLogSumExp(max_positions=20)
    finals = torch.stack([_final(target, 8, s) for s in range(4)])
    docs = torch.zeros(4, 8, dtype=torch.long)
    ids = torch.arange(4)[:, None].expand(4, 8)
    for i in range(4):  # 8 positions each: two rows fit in 20
        cache.rows(target, finals[i : i + 1], ids[i : i + 1], docs[i : i + 1])
    assert len(cache) == 2 and cache.computed == 4
    cache.rows(target, finals[3:], ids[3:], docs[3:])  # the newest is kept
    assert cache.computed == 4
    cache.rows(target, finals[:1], ids[:1], docs[:1])  # the oldest was dropped: computed again
    assert cache.computed == 5


def test_a_bf16_target_gets_the_log_sum_exp_of_its_own_logits(tiny_llama_dir: Path) -> None:
    """A bf16 target (CUDA's default) with float32 features, as training and capture read them: the log-sum-exp is
    that of the logits the target forms at its own precision (no dtype clash in the head), and the draft-id logits
    DSpark training forms are a subset of those same logits."""
    from dflashkit.target.logsumexp import vocab_subset_logits

    target = Target.load(tiny_llama_dir, dtype="bf16")
    final = _final(target, 7, 3)  # (T, H) float32, as read from features
    logits = target.verifier_logits(final.to(torch.bfloat16)[None])[0].float()  # (T, V) the target's own
    got = row_logsumexp(target, final)
    torch.testing.assert_close(got, torch.logsumexp(logits, dim=-1), rtol=1e-5, atol=1e-4)
    ids = torch.tensor([3, 5, 40, 96])
    sub = vocab_subset_logits(target, final, target.lm_head_weight[ids])  # (T, 4)
    assert sub.dtype == torch.float32
    torch.testing.assert_close(sub, logits[:, ids], rtol=1e-2, atol=1e-3)  # the same logits, up to bf16 rounding
    assert float(torch.exp(sub - got[:, None]).sum(-1).max()) <= 1 + 1e-2
