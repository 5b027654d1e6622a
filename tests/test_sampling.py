"""The acceptance rules at T > 0 on distributions that leave nothing to chance (one-hot rows): argmax drafts keep
the longest prefix the target's samples match — a match after a miss does not count — and the next token is the
target's sample right after that prefix; sampled drafts likewise stop at the first refusal."""

from __future__ import annotations

import torch

from dflashkit.sampling import accept_argmax_drafts, accept_sampled_drafts


def _one_hot(tokens: list[int], vocab: int = 12) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()  # (n + 1, V)


def test_argmax_drafts_keep_the_longest_matching_prefix():
    p = _one_hot([5, 7, 9, 2])  # the target's samples at verify positions 0..3
    assert accept_argmax_drafts(torch.tensor([5, 8, 9]), p) == (1, 7)  # the match after the miss is not kept
    assert accept_argmax_drafts(torch.tensor([4, 7, 9]), p) == (0, 5)
    assert accept_argmax_drafts(torch.tensor([5, 7, 9]), p) == (3, 2)  # all kept: the token after the block


def test_sampled_drafts_stop_at_the_first_refusal():
    p = _one_hot([5, 7, 9, 2])
    q = _one_hot([5, 8, 9])  # the draft's own distributions, one-hot on its drafts
    accepted, token = accept_sampled_drafts(torch.tensor([5, 8, 9]), p, q, torch.Generator().manual_seed(0))
    assert (accepted, token) == (1, 7)  # p(8) = 0 refuses slot 2; the residual max(p − q, 0) is one-hot on 7
