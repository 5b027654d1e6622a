"""`tokens.jsonl`: conversations and regenerated transcripts tokenised into training samples, written atomically.

    report = write_tokens(tokenizer, items, "data/tokens.jsonl", max_length=3072)

One line per sample, `{"id", "input_ids", "loss_mask": [0|1, …]}` — the unit every later stage reads. An item is
(id, messages, response ids): with the target's first-turn response ids the sample is the prompt plus exactly those
ids (`conversations.tokenize_regenerated`); with a list of id lists (one per regenerated turn, `--turns all`) the
samples of `turns.tokenize_turns` (one that supervises every reply, or one per turn, ids `ID`, `ID#2`, …); with
None the messages are rendered with the chat template and every assistant turn supervised
(`conversations.tokenize_for_training`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashkit.data.conversations import TokenizedSample, tokenize_for_training, tokenize_regenerated
from dflashkit.data.turns import tokenize_turns
from dflashkit.errors import DataError


@dataclass
class TokensReport:
    """What `write_tokens` wrote and skipped."""

    written: int = 0
    truncated: int = 0
    total_tokens: int = 0
    supervised: int = 0
    split_turns: int = 0  # multi-turn transcripts written as one sample per turn (their contexts do not chain)
    skipped: dict[str, str] = field(default_factory=dict)


def write_tokens(
    tokenizer: Any,
    items: Any,
    out_path: str | Path,
    *,
    max_length: int,
    chat_template_kwargs: dict[str, Any] | None = None,
    min_supervised: int = 1,
    progress: bool = False,
) -> TokensReport:
    """Tokenise conversations into `tokens.jsonl` (atomically): one `{"id", "input_ids", "loss_mask"}` per line.

    items: (id, messages, response ids | per-turn id lists | None), see the module docstring. Samples with
    fewer than `min_supervised` supervised tokens within `max_length` are skipped with a reason.
    """
    from tqdm import tqdm

    from dflashkit.io_utils import atomic_path

    items = list(items)
    report = TokensReport()
    with atomic_path(Path(out_path)) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for sample_id, messages, response_ids in tqdm(
            items, desc="tokenise", unit="conv", disable=not progress or len(items) < 200
        ):
            try:
                samples = _samples(tokenizer, messages, response_ids, max_length, chat_template_kwargs)
            except DataError as e:
                report.skipped[sample_id] = str(e)
                continue
            if len(samples) > 1:
                report.split_turns += 1
            for k, sample in enumerate(samples):
                _write_sample(
                    f, report, sample_id if k == 0 else f"{sample_id}#{k + 1}", sample, min_supervised, max_length
                )
    return report


def _samples(
    tokenizer: Any,
    messages: list[dict[str, str]],
    response_ids: Any,
    max_length: int,
    kwargs: dict[str, Any] | None,
) -> list[TokenizedSample]:
    if response_ids is None:
        return [tokenize_for_training(tokenizer, messages, max_length=max_length, chat_template_kwargs=kwargs)]
    if response_ids and isinstance(response_ids[0], list):
        return tokenize_turns(tokenizer, messages, response_ids, max_length=max_length, chat_template_kwargs=kwargs)
    return [
        tokenize_regenerated(tokenizer, messages[:-1], response_ids, max_length=max_length, chat_template_kwargs=kwargs)
    ]


def _write_sample(
    f: Any, report: TokensReport, sample_id: str, sample: TokenizedSample, min_supervised: int, max_length: int
) -> None:
    if sample.num_supervised < min_supervised:
        report.skipped[sample_id] = (
            f"no supervised tokens within max length {max_length}"
            if sample.num_supervised == 0
            else f"only {sample.num_supervised} supervised tokens (need {min_supervised})"
        )
        return
    row = {"id": sample_id, "input_ids": sample.input_ids, "loss_mask": [int(b) for b in sample.loss_mask]}
    f.write(json.dumps(row) + "\n")
    report.written += 1
    report.truncated += int(sample.truncated)
    report.total_tokens += len(sample.input_ids)
    report.supervised += sample.num_supervised


__all__ = ["TokensReport", "write_tokens"]
