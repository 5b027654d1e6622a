"""Acceptance per group of prompts: by category and by context length, as users report it.

    groups = PromptGroups.of(prompts, length_buckets=(512, 1024, 2048))   # id → category, id → length bucket
    stats["by_category"] = grouped_stats(lengths_by_prompt, groups.category, max_length, drafted_by_prompt)

- A prompt's **category** is the dataset's own (MT-Bench's eight: writing, roleplay, reasoning, math, coding,
  extraction, stem, humanities), a JSONL record's `category` field, or else the dataset's name (HumanEval and
  ShareGPT are one category each).
- Its **length bucket** is the smallest bucket edge ≥ its prompt tokens ("≤1k" holds 513 … 1024 tokens with
  edges 512, 1024, …; a prompt beyond the last edge falls in ">8k").
- Every group's statistics are `stats.acceptance_stats` over that group's prompts alone — τ micro / macro, the
  per-position acceptance vector, accepted / drafted counts — with `n_prompts`; groups come in a fixed order
  (first appearance for categories, ascending for lengths), so tables and plots line up across runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dflashkit.evaluate.stats import acceptance_stats

LENGTH_BUCKETS = (512, 1024, 2048, 4096, 8192)  # prompt tokens: the usual long-context report points


def bucket_name(edge: int) -> str:
    """512 → "≤512", 2048 → "≤2k", 1536 → "≤1.5k"."""
    if edge >= 1024 and edge % 512 == 0:
        k = edge / 1024
        return f"≤{k:g}k"
    return f"≤{edge}"


def length_bucket(n_tokens: int, edges: Sequence[int]) -> str:
    """The bucket of a prompt of `n_tokens` tokens: the smallest edge ≥ n_tokens, else beyond the last."""
    for edge in sorted(edges):
        if n_tokens <= edge:
            return bucket_name(edge)
    last = max(edges)
    return ">" + bucket_name(last)[1:]


def bucket_order(edges: Sequence[int]) -> list[str]:
    """Every bucket name of `edges` in ascending order, the overflow bucket last."""
    return [bucket_name(e) for e in sorted(edges)] + [">" + bucket_name(max(edges))[1:]]


@dataclass(frozen=True)
class PromptGroups:
    """Prompt id → category, and prompt id → length bucket (empty when no buckets were asked for)."""

    category: dict[str, str]
    length: dict[str, str] = field(default_factory=dict)
    length_order: list[str] = field(default_factory=list)

    @staticmethod
    def of(prompts: Iterable[tuple[str, str, int]], length_buckets: Sequence[int] | None = None) -> PromptGroups:
        """From (id, category, prompt tokens) triples."""
        items = list(prompts)
        category = {pid: cat for pid, cat, _ in items}
        if not length_buckets:
            return PromptGroups(category)
        length = {pid: length_bucket(n, length_buckets) for pid, _, n in items}
        return PromptGroups(category, length, bucket_order(length_buckets))


def grouped_stats(
    lengths: Mapping[str, Sequence[int]],
    groups: Mapping[str, str],
    max_length: int,
    drafted: Mapping[str, int] | None = None,
    order: Sequence[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """{group: acceptance statistics + n_prompts} over the prompts of `lengths` (id → acceptance lengths), grouped
    by `groups` (id → group); `drafted`: id → draft tokens verified (adds the accepted / drafted counts); groups in
    `order` (those with no prompt left out), else in first appearance."""
    members: dict[str, list[str]] = {}
    for pid in lengths:
        members.setdefault(groups.get(pid, ""), []).append(pid)
    names = [g for g in order if g in members] if order is not None else list(members)
    out = {}
    for g in names:
        ids = members[g]
        counts = None if drafted is None else [drafted[p] for p in ids]
        out[g] = {**acceptance_stats([lengths[p] for p in ids], max_length, counts), "n_prompts": len(ids)}
    return out


def with_groups(
    stats: dict[str, Any],
    lengths: Mapping[str, Sequence[int]],
    groups: PromptGroups,
    max_length: int,
    drafted: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """`stats` with `by_category` (always) and `by_length` (when the groups have length buckets)."""
    out = dict(stats, by_category=grouped_stats(lengths, groups.category, max_length, drafted))
    if groups.length:
        out["by_length"] = grouped_stats(lengths, groups.length, max_length, drafted, groups.length_order)
    return out


__all__ = [
    "LENGTH_BUCKETS",
    "PromptGroups",
    "bucket_name",
    "bucket_order",
    "grouped_stats",
    "length_bucket",
    "with_groups",
]
