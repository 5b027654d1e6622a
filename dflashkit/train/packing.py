"""Sequence packing for training: samples → rows of at most `max_tokens` tokens → padded batches of rows.

    plan = plan_rows(lengths, max_tokens=3072, seed=0)          # which samples share a row (deterministic)
    rows = PackedRows(feature_source, plan)                      # rows[i] -> PackedRow (loads its samples)
    batch = collate_rows([rows[i] for i in ids])                 # RowBatch, rows padded to one length T

A row holds whole documents back to back; `doc_ids` (−1 on padding) and per-document `positions` keep them apart
(the training mask never lets a block see another document). The target's argmax tokens and top-k log-probs travel
with their positions (`target_tokens` −1, `topk_ids` −1 / `topk_logprobs` −inf where a sample has none and on
padding; the target's log-sum-exp per position, `target_lse`, only when every sample has it); shifting them to the
slot they supervise is `dflashkit.train.slot_targets`'s job. A sample longer than
`max_tokens` is cut to `max_tokens` (counted in `PackPlan.truncated`). Packing is best-fit-decreasing ("bfd", ties
broken by a seeded shuffle) or greedy in a seeded order ("greedy").

Distribution over steps and ranks: each epoch permutes the rows with a seed derived from (seed, epoch); a global
step takes the next `batch_rows × grad_accum × world_size` rows of that order (wrapping around at the end of the
epoch so every rank gets the same number of steps), and rank r takes its own contiguous share of them. The union
of the rows of one step is the same for any split of the same global batch (1 rank × 2 rows = 2 ranks × 1 row).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dflashkit.data.samples import Sample
from dflashkit.errors import DataError


def mix_seed(*parts: Any) -> int:
    """A 63-bit seed from any tuple of ints/strings (stable across processes and Python versions)."""
    digest = hashlib.blake2b(repr(tuple(parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


# ---------------------------------------------------------------------------------------------- planning
@dataclass
class PackPlan:
    """Which dataset indices go into which row (in row order), and how many samples were truncated."""

    rows: list[list[int]]  # dataset indices per row
    row_tokens: list[int]  # tokens per row after truncation
    max_tokens: int
    truncated: int  # samples longer than max_tokens (cut to max_tokens)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return sum(self.row_tokens)

    @property
    def fill(self) -> float:
        """Fraction of the row capacity holding real tokens."""
        return self.num_tokens / max(1, len(self.rows) * self.max_tokens)


def sample_lengths(source: Any) -> list[int]:
    """Token counts of a feature source without computing features where the source allows it.

    Uses `source.lengths` (list or method) when present, else `source.samples`, else `len(source[i])`."""
    lengths = getattr(source, "lengths", None)
    if lengths is not None:
        return [int(x) for x in (lengths() if callable(lengths) else lengths)]
    samples = getattr(source, "samples", None)
    if samples is not None and len(samples) == len(source):
        return [len(s) for s in samples]
    return [len(source[i]) for i in range(len(source))]


def plan_rows(
    lengths: Sequence[int] | dict[int, int], *, max_tokens: int, seed: int = 0, strategy: str = "bfd"
) -> PackPlan:
    """Pack samples (index → length) into rows of ≤ max_tokens tokens; deterministic given `seed`.

    lengths: a list (index i has lengths[i]) or a dict {dataset index: length} (e.g. a train/val subset).
    strategy: "bfd" best-fit-decreasing (dense rows) or "greedy" (seeded order, new row when the next one misses).
    """
    if max_tokens < 2:
        raise DataError(f"max_tokens must be ≥ 2, got {max_tokens}")
    if strategy not in ("bfd", "greedy"):
        raise ValueError(f"packing strategy must be 'bfd' or 'greedy', got {strategy!r}")
    items = list(lengths.items()) if isinstance(lengths, dict) else list(enumerate(lengths))
    items = [(int(i), int(n)) for i, n in items if int(n) > 0]
    g = torch.Generator().manual_seed(mix_seed(seed, "pack"))
    order = torch.randperm(len(items), generator=g).tolist()
    items = [items[k] for k in order]
    truncated = sum(1 for _, n in items if n > max_tokens)
    items = [(i, min(n, max_tokens)) for i, n in items]
    rows: list[list[int]] = []
    fill: list[int] = []
    if strategy == "greedy":
        for i, n in items:
            if rows and fill[-1] + n <= max_tokens:
                rows[-1].append(i)
                fill[-1] += n
            else:
                rows.append([i])
                fill.append(n)
    else:
        items.sort(key=lambda x: -x[1])  # stable: the seeded order breaks ties
        free: list[tuple[int, int]] = []  # sorted (remaining capacity, row id)
        for i, n in items:
            k = bisect.bisect_left(free, (n, -1))  # the tightest row that still fits
            if k < len(free):
                _, r = free.pop(k)
                rows[r].append(i)
                fill[r] += n
            else:
                r = len(rows)
                rows.append([i])
                fill.append(n)
            if max_tokens - fill[r] > 0:
                bisect.insort(free, (max_tokens - fill[r], r))
    return PackPlan(rows=rows, row_tokens=fill, max_tokens=max_tokens, truncated=truncated)


def _loss_mask(source: Any, i: int) -> Tensor:
    """Sample i's loss mask without computing features where the source allows it."""
    getter = getattr(source, "loss_mask", None)
    if callable(getter):
        return getter(i)
    samples = getattr(source, "samples", None)
    return (samples[i] if samples is not None and len(samples) == len(source) else source[i]).loss_mask


def supervision_problem(source: Any, plan: PackPlan) -> str | None:
    """Why no row of `plan` can hold a training block, or None when one can (checked before training runs).

    A block needs an anchor: two consecutive supervised tokens of one document within the first `max_tokens`
    tokens of its sample. The scan stops at the first such sample, so it costs one loss mask when all is well."""
    earliest, none_at_all, n = None, 0, 0
    for row in plan.rows:
        for i in row:
            mask = _loss_mask(source, i).bool()  # (T,)
            pairs = (mask[:-1] & mask[1:]).nonzero()
            if pairs.numel() and int(pairs[0]) + 1 < plan.max_tokens:
                return None
            n += 1
            if pairs.numel():
                earliest = int(pairs[0]) if earliest is None else min(earliest, int(pairs[0]))
            else:
                none_at_all += 1
    if not n:
        return "no training samples (the training split is empty)"
    if earliest is None:
        return (
            f"none of the {n} training samples has two consecutive supervised tokens (loss_mask): there is "
            f"nothing to train on; check that the data marks the assistant responses"
        )
    some_none = f" ({none_at_all} have none at all)" if none_at_all else ""
    return (
        f"max_tokens={plan.max_tokens} leaves nothing to train on: samples are cut to their first "
        f"{plan.max_tokens} tokens, but the supervised (response) tokens of all {n} training samples start at "
        f"position {earliest} (0-based) or later{some_none}, so every loss would be 0; raise max_tokens above "
        f"{earliest + 1} (the responses come after the prompts)"
    )


# ---------------------------------------------------------------------------------------------- rows
@dataclass
class PackedRow:
    """One packed row of T ≤ max_tokens real tokens (no padding yet)."""

    input_ids: Tensor  # (T,) long
    doc_ids: Tensor  # (T,) long, 0..n_docs−1
    positions: Tensor  # (T,) long, restarting at 0 for every document
    loss_mask: Tensor  # (T,) bool
    features: Tensor  # (T, K·H)
    target_tokens: Tensor | None  # (T,) long, −1 where a sample has none; None when no sample has any
    topk_ids: Tensor | None = None  # (T, K) long, −1 where a sample has none; None when no sample has any
    topk_logprobs: Tensor | None = None  # (T, K) float32, −inf where a sample has none
    target_lse: Tensor | None = None  # (T,) float32; None unless every sample has it

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def pack_row(samples: Sequence[Sample], max_tokens: int) -> PackedRow:
    """Concatenate whole samples (each cut to max_tokens) into one row."""
    if not samples:
        raise DataError("cannot pack an empty row")
    ids, docs, pos, mask, feats, tgts, top_ids, top_lp = [], [], [], [], [], [], [], []
    have_targets = any(s.target_tokens is not None for s in samples)
    ks = {int(s.topk_ids.shape[1]) for s in samples if s.topk_ids is not None}
    if len(ks) > 1:
        raise DataError(f"samples of one row hold different numbers of top-k log-probs {sorted(ks)}")
    k = ks.pop() if ks else 0
    lses = [] if all(s.target_lse is not None for s in samples) else None
    for d, s in enumerate(samples):
        if s.features is None:
            raise DataError(
                f"sample {s.id!r} has no features; train from `dflashkit capture` output or set online: true"
            )
        n = min(len(s), max_tokens)
        if s.features.shape[0] < n:
            raise DataError(
                f"sample {s.id!r}: features cover {s.features.shape[0]} positions but it has {len(s)} tokens"
            )
        ids.append(s.input_ids[:n].long())
        docs.append(torch.full((n,), d, dtype=torch.long))
        pos.append(torch.arange(n, dtype=torch.long))
        mask.append(s.loss_mask[:n].bool())
        feats.append(s.features[:n])
        if lses is not None:
            if s.target_lse.shape[0] < n:
                raise DataError(f"sample {s.id!r}: target_lse covers {s.target_lse.shape[0]} of its {len(s)} tokens")
            lses.append(s.target_lse[:n].float())
        if have_targets:
            tgts.append(
                s.target_tokens[:n].long() if s.target_tokens is not None else torch.full((n,), -1, dtype=torch.long)
            )
        if k:
            if s.topk_ids is None or s.topk_logprobs is None:
                top_ids.append(torch.full((n, k), -1, dtype=torch.long))
                top_lp.append(torch.full((n, k), float("-inf")))
            else:
                if s.topk_ids.shape[0] < n or s.topk_logprobs.shape != s.topk_ids.shape:
                    raise DataError(
                        f"sample {s.id!r}: top-k ids {list(s.topk_ids.shape)} and log-probs "
                        f"{list(s.topk_logprobs.shape)} must both cover its {len(s)} tokens"
                    )
                top_ids.append(s.topk_ids[:n].long())
                top_lp.append(s.topk_logprobs[:n].float())
    total = sum(len(x) for x in ids)
    if total > max_tokens:
        raise DataError(f"row holds {total} tokens > max_tokens {max_tokens} (the pack plan and data disagree)")
    widths = {f.shape[1] for f in feats}
    if len(widths) != 1:
        raise DataError(f"samples of one row have different feature widths {sorted(widths)}")
    return PackedRow(
        input_ids=torch.cat(ids),
        doc_ids=torch.cat(docs),
        positions=torch.cat(pos),
        loss_mask=torch.cat(mask),
        features=torch.cat(feats),
        target_tokens=torch.cat(tgts) if have_targets else None,
        topk_ids=torch.cat(top_ids) if k else None,
        topk_logprobs=torch.cat(top_lp) if k else None,
        target_lse=torch.cat(lses) if lses is not None else None,
    )


class PackedRows(torch.utils.data.Dataset):
    """Map-style dataset of packed rows over a feature source (`source[i] -> Sample` with features)."""

    def __init__(self, source: Any, plan: PackPlan) -> None:
        self.source = source
        self.plan = plan

    def __len__(self) -> int:
        return len(self.plan.rows)

    def __getitem__(self, row: int) -> PackedRow:
        return pack_row([self.source[i] for i in self.plan.rows[row]], self.plan.max_tokens)


@dataclass
class RowBatch:
    """B rows padded to a common length T. Padding: doc_ids −1, loss_mask False, features 0, ids 0, target tokens
    and top-k ids −1, top-k log-probs −inf, target log-sum-exp 0."""

    input_ids: Tensor  # (B, T) long
    doc_ids: Tensor  # (B, T) long
    positions: Tensor  # (B, T) long
    loss_mask: Tensor  # (B, T) bool
    features: Tensor  # (B, T, K·H)
    target_tokens: Tensor | None  # (B, T) long, −1 where unknown / padding
    row_ids: list[int]  # global row indices (seed anchors and noise per row)
    topk_ids: Tensor | None = None  # (B, T, K) long, −1 where unknown / padding
    topk_logprobs: Tensor | None = None  # (B, T, K) float32, −inf where unknown / padding
    target_lse: Tensor | None = None  # (B, T) float32; None unless every row has it

    @property
    def num_tokens(self) -> int:
        return int((self.doc_ids >= 0).sum())

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> RowBatch:
        mv = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return RowBatch(
            mv(self.input_ids),
            mv(self.doc_ids),
            mv(self.positions),
            mv(self.loss_mask),
            mv(self.features),
            mv(self.target_tokens),
            list(self.row_ids),
            mv(self.topk_ids),
            mv(self.topk_logprobs),
            mv(self.target_lse),
        )


def collate_rows(
    rows: Sequence[PackedRow], row_ids: Sequence[int] | None = None, *, pad_to_multiple: int = 1
) -> RowBatch:
    """Pad rows to the longest one (rounded up to `pad_to_multiple`) and stack them."""
    if not rows:
        raise DataError("cannot collate an empty batch")
    b = len(rows)
    t = max(len(r) for r in rows)
    t = int(math.ceil(t / pad_to_multiple) * pad_to_multiple)
    width = rows[0].features.shape[1]
    input_ids = torch.zeros(b, t, dtype=torch.long)
    doc_ids = torch.full((b, t), -1, dtype=torch.long)
    positions = torch.zeros(b, t, dtype=torch.long)
    loss_mask = torch.zeros(b, t, dtype=torch.bool)
    features = torch.zeros(b, t, width, dtype=rows[0].features.dtype)  # (B, T, K·H)
    have_targets = any(r.target_tokens is not None for r in rows)
    targets = torch.full((b, t), -1, dtype=torch.long) if have_targets else None
    ks = {int(r.topk_ids.shape[1]) for r in rows if r.topk_ids is not None}
    if len(ks) > 1:
        raise DataError(f"rows of one batch hold different numbers of top-k log-probs {sorted(ks)}")
    k = ks.pop() if ks else 0
    top_ids = torch.full((b, t, k), -1, dtype=torch.long) if k else None  # (B, T, K)
    top_lp = torch.full((b, t, k), float("-inf")) if k else None  # (B, T, K)
    lse = torch.zeros(b, t) if all(r.target_lse is not None for r in rows) else None  # (B, T)
    for i, r in enumerate(rows):
        n = len(r)
        if r.features.shape[1] != width:
            raise DataError(f"rows of one batch have feature widths {width} and {r.features.shape[1]}")
        input_ids[i, :n] = r.input_ids
        doc_ids[i, :n] = r.doc_ids
        positions[i, :n] = r.positions
        loss_mask[i, :n] = r.loss_mask
        features[i, :n] = r.features
        if targets is not None and r.target_tokens is not None:
            targets[i, :n] = r.target_tokens
        if k and r.topk_ids is not None:
            top_ids[i, :n] = r.topk_ids
            top_lp[i, :n] = r.topk_logprobs
        if lse is not None:
            lse[i, :n] = r.target_lse
    return RowBatch(
        input_ids,
        doc_ids,
        positions,
        loss_mask,
        features,
        targets,
        list(row_ids) if row_ids is not None else list(range(b)),
        top_ids,
        top_lp,
        lse,
    )


# ---------------------------------------------------------------------------------------------- schedule
def rows_per_step(*, batch_rows: int, grad_accum: int, world_size: int) -> int:
    return batch_rows * grad_accum * world_size


def steps_per_epoch(num_rows: int, *, batch_rows: int, grad_accum: int = 1, world_size: int = 1) -> int:
    """Optimizer steps in one pass over `num_rows` rows (the last step wraps around to fill the global batch)."""
    if num_rows < 1:
        raise DataError("no training rows: the dataset is empty (or every sample went to validation)")
    return math.ceil(num_rows / rows_per_step(batch_rows=batch_rows, grad_accum=grad_accum, world_size=world_size))


def epoch_order(num_rows: int, *, seed: int, epoch: int) -> list[int]:
    """The row order of one epoch: a permutation seeded by (seed, epoch)."""
    g = torch.Generator().manual_seed(mix_seed(seed, "epoch", epoch))
    return torch.randperm(num_rows, generator=g).tolist()


def step_rows(
    order: Sequence[int],
    step_in_epoch: int,
    *,
    batch_rows: int,
    grad_accum: int = 1,
    rank: int = 0,
    world_size: int = 1,
) -> list[list[int]]:
    """This rank's micro-batches (lists of row ids) for one optimizer step of the epoch given by `order`."""
    g = rows_per_step(batch_rows=batch_rows, grad_accum=grad_accum, world_size=world_size)
    n = len(order)
    start = step_in_epoch * g
    chunk = [order[(start + j) % n] for j in range(g)]  # wraps around on the last step
    local = chunk[rank * batch_rows * grad_accum : (rank + 1) * batch_rows * grad_accum]
    return [local[m * batch_rows : (m + 1) * batch_rows] for m in range(grad_accum)]


def split_indices(
    n: int, *, val_fraction: float = 0.0, val_samples: int | None = None, seed: int = 0
) -> tuple[list[int], list[int]]:
    """(train, held-out) dataset indices: a seeded random subset of `val_samples` (or round(fraction·n))."""
    k = int(val_samples) if val_samples is not None else round(val_fraction * n)
    if k <= 0:
        return list(range(n)), []
    if k >= n:
        raise DataError(f"validation would take {k} of {n} samples; leave some for training")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(mix_seed(seed, "val"))).tolist()
    return sorted(perm[k:]), sorted(perm[:k])


__all__ = [
    "PackPlan",
    "PackedRow",
    "PackedRows",
    "RowBatch",
    "collate_rows",
    "epoch_order",
    "mix_seed",
    "pack_row",
    "plan_rows",
    "rows_per_step",
    "sample_lengths",
    "split_indices",
    "step_rows",
    "steps_per_epoch",
]
