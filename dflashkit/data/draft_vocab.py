"""A reduced draft vocabulary built from data: the N most frequent supervised target tokens of a tokens file.

    ids, coverage = frequent_tokens(samples, vocab_size=49152, size=8192)   # ids (N,) sorted; coverage ∈ [0, 1]

A drafter with `draft_vocab_size` N drafts over those N ids only (its LM head is the target's rows of them); the map
is built here from the training data or not at all — a vocabulary that was never built would name one id N times.
Ties (and tokens never seen) are broken by id, so the same data always gives the same vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from dflashkit.data.samples import Sample
from dflashkit.errors import DataError


def frequent_tokens(samples: Iterable[Sample], *, vocab_size: int, size: int) -> tuple[Tensor, float]:
    """(the `size` most frequent supervised token ids, sorted; the fraction of supervised tokens they cover)."""
    if not 1 <= size <= vocab_size:
        raise DataError(
            f"draft_vocab_size = {size}: expected an integer from 1 to the target's vocabulary, {vocab_size}"
        )
    counts = torch.zeros(vocab_size, dtype=torch.long)  # (V,)
    for s in samples:
        ids = s.input_ids[s.loss_mask.bool()]
        counts += torch.bincount(ids, minlength=vocab_size)
    if int(counts.sum()) == 0:
        raise DataError("no supervised tokens to build a draft vocabulary from (every loss mask is empty)")
    order = torch.argsort(counts * vocab_size + (vocab_size - 1 - torch.arange(vocab_size)), descending=True)
    keep = order[:size].sort().values  # (size,)
    return keep, float(counts[keep].sum() / counts.sum().clamp(min=1))


__all__ = ["frequent_tokens"]
