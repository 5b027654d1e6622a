"""Tests of dflashkit.train.packing: row plans (capacity, coverage, determinism, truncation), packed rows, padding,
and the split of a global step over ranks and micro-batches."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from dflashkit.data.samples import Sample
from dflashkit.errors import DataError
from dflashkit.train.packing import (
    PackedRows,
    collate_rows,
    epoch_order,
    pack_row,
    plan_rows,
    sample_lengths,
    split_indices,
    step_rows,
    steps_per_epoch,
)


def _sample(i: int, n: int, width: int = 6, targets: bool = True) -> Sample:
    ids = torch.arange(n) + 100 * i
    mask = torch.ones(n, dtype=torch.bool)
    mask[0] = False
    feats = torch.full((n, width), float(i)) + torch.arange(n)[:, None] / 100
    return Sample(f"s{i}", ids, mask, feats, (ids + 1) if targets else None)


@pytest.mark.parametrize("strategy", ["bfd", "greedy"])
def test_plan_capacity_coverage_determinism(strategy: str) -> None:
    g = torch.Generator().manual_seed(0)
    lengths = [*torch.randint(1, 40, (200,), generator=g).tolist(), 75, 120]
    plan = plan_rows(lengths, max_tokens=64, seed=3, strategy=strategy)
    assert plan.truncated == 2
    flat = sorted(i for row in plan.rows for i in row)
    assert flat == list(range(len(lengths)))  # every sample exactly once
    for row, tokens in zip(plan.rows, plan.row_tokens, strict=True):
        assert tokens == sum(min(lengths[i], 64) for i in row) <= 64
    again = plan_rows(lengths, max_tokens=64, seed=3, strategy=strategy)
    assert again.rows == plan.rows
    if strategy == "bfd":
        assert plan.fill > 0.9  # dense
        assert len(plan) <= len(plan_rows(lengths, max_tokens=64, seed=3, strategy="greedy"))


def test_plan_subset_dict_keeps_indices() -> None:
    plan = plan_rows({5: 10, 9: 20, 11: 30}, max_tokens=32)
    assert sorted(i for r in plan.rows for i in r) == [5, 9, 11]


def test_pack_row_layout() -> None:
    row = pack_row([_sample(0, 5), _sample(1, 7)], max_tokens=16)
    assert row.doc_ids.tolist() == [0] * 5 + [1] * 7
    assert row.positions.tolist() == list(range(5)) + list(range(7))
    assert row.input_ids.tolist() == list(range(5)) + list(range(100, 107))
    assert row.loss_mask.tolist() == [False] + [True] * 4 + [False] + [True] * 6
    assert row.features.shape == (12, 6) and row.target_tokens.tolist() == [x + 1 for x in row.input_ids.tolist()]
    long = pack_row([_sample(2, 30)], max_tokens=16)  # one long sample is cut to max_tokens
    assert len(long) == 16 and long.features.shape == (16, 6)
    with pytest.raises(DataError, match="max_tokens"):
        pack_row([_sample(0, 10), _sample(1, 10)], max_tokens=16)
    with pytest.raises(DataError, match="no features"):
        pack_row([Sample("x", torch.arange(3), torch.ones(3, dtype=torch.bool))], max_tokens=8)


def test_collate_pads() -> None:
    rows = [pack_row([_sample(0, 5)], 16), pack_row([_sample(1, 3), _sample(2, 4, targets=False)], 16)]
    b = collate_rows(rows, [7, 8])
    assert b.input_ids.shape == (2, 7) and b.features.shape == (2, 7, 6)
    assert b.doc_ids[0].tolist() == [0] * 5 + [-1, -1]
    assert not b.loss_mask[0, 5:].any() and (b.features[0, 5:] == 0).all()
    assert b.target_tokens[1].tolist()[3:] == [-1] * 4  # sample without targets → −1
    assert b.row_ids == [7, 8] and b.num_tokens == 12
    assert collate_rows(rows, pad_to_multiple=8).input_ids.shape == (2, 8)


def test_packed_rows_dataset_and_lengths() -> None:
    source = [_sample(i, 4 + i) for i in range(6)]
    assert sample_lengths(source) == [4, 5, 6, 7, 8, 9]
    plan = plan_rows(sample_lengths(source), max_tokens=16)
    ds = PackedRows(source, plan)
    assert sum(len(ds[i]) for i in range(len(ds))) == sum(range(4, 10))

    class WithLengths(list):
        lengths: ClassVar[list[int]] = [1, 2]

    assert sample_lengths(WithLengths([None, None])) == [1, 2]  # never touches the items


def test_step_rows_split_is_independent_of_ranks() -> None:
    order = epoch_order(10, seed=0, epoch=0)
    assert sorted(order) == list(range(10)) and order != epoch_order(10, seed=0, epoch=1)
    assert order == epoch_order(10, seed=0, epoch=0)
    spe = steps_per_epoch(10, batch_rows=2, grad_accum=1, world_size=2)
    assert spe == 3  # last step wraps around
    for s in range(spe):
        single = step_rows(order, s, batch_rows=4)
        ranks = [step_rows(order, s, batch_rows=2, rank=r, world_size=2) for r in range(2)]
        accum = step_rows(order, s, batch_rows=1, grad_accum=2, rank=1, world_size=2)
        assert sorted(single[0]) == sorted(ranks[0][0] + ranks[1][0])
        assert len(accum) == 2 and accum[0] + accum[1] == ranks[1][0]
    seen = [i for s in range(spe) for r in range(2) for i in step_rows(order, s, batch_rows=2, rank=r, world_size=2)[0]]
    assert set(seen) == set(range(10))


def test_split_indices() -> None:
    tr, va = split_indices(20, val_fraction=0.25, seed=1)
    assert len(va) == 5 and not set(tr) & set(va) and sorted(tr + va) == list(range(20))
    assert split_indices(20, val_samples=2, seed=1)[1] == split_indices(20, val_samples=2, seed=1)[1]
    assert split_indices(5)[1] == []
    with pytest.raises(DataError):
        split_indices(3, val_samples=3)
