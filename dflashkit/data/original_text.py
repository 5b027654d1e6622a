"""Training samples from ShareGPT's ORIGINAL replies: more distinct data per minute than regeneration.

Regenerating a response costs one target step per token; teacher-forcing an existing reply costs one target
*forward* over it (the capture pass the regenerated data needs anyway), several times cheaper per supervised token.
The reply is human (or another model's) text, so its tokens are not what the target would say: train on these
samples with `labels: target` — the target's own greedy prediction at every position (captured as `target_tokens`)
— never on the reply's tokens. What it buys: docs/studies.md, "Data levers" (orig_mix).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

ID_PREFIX = "orig-"  # sample ids: "orig-<conversation id>" (a regenerated sample keeps the conversation's id)


def original_text_items(
    tokenizer: Any, n: int, *, exclude: Collection[str], max_prompt_tokens: int, dataset: str = "sharegpt"
) -> list[tuple[str, list[dict[str, str]], None]]:
    """The first `n` conversations of `dataset` (its order) whose id is not in `exclude`, whose prompt fits
    `max_prompt_tokens` and that have a non-empty first assistant reply, as (id, prompt + reply, None) items for
    `data.write_tokens` — the prompt exactly as regeneration would pose it."""
    from dflashkit.data.conversations import encode_prompt, prompt_messages
    from dflashkit.data.datasets import load_dataset
    from dflashkit.errors import DataError

    items: list[tuple[str, list[dict[str, str]], None]] = []
    if n <= 0:
        return items
    convs, _ = load_dataset(dataset, None)
    for c in convs:
        if c.id in exclude:
            continue
        try:
            prompt = prompt_messages(c)
            if len(encode_prompt(tokenizer, prompt)) > max_prompt_tokens:
                continue
        except DataError:
            continue
        reply = next((m for m in c.messages[len(prompt) :] if m["role"] == "assistant"), None)
        if reply is None or not str(reply.get("content", "")).strip():
            continue
        items.append((f"{ID_PREFIX}{c.id}", [*prompt, reply], None))
        if len(items) >= n:
            break
    return items


def used_conversation_ids(sample_ids: Collection[str]) -> set[str]:
    """Conversation ids behind sample ids (regenerated ones as they are, original-text ones without the prefix)."""
    return {i[len(ID_PREFIX) :] if i.startswith(ID_PREFIX) else i for i in sample_ids}


def write_original_text(
    tokenizer: Any,
    n: int,
    out_path: str | Path,
    *,
    exclude: Collection[str],
    max_prompt_tokens: int,
    max_length: int = 1024,
    max_total_tokens: int | None = None,
) -> Any:
    """Tokenise `original_text_items(...)` into `out_path` (tokens.jsonl format). Returns the TokensReport.
    `max_total_tokens` keeps only the first conversations whose tokens fit that many (a capture-time budget)."""
    import json

    from dflashkit.data.tokens_file import TokensReport, write_tokens
    from dflashkit.io_utils import atomic_write_text

    items = original_text_items(tokenizer, n, exclude=exclude, max_prompt_tokens=max_prompt_tokens)
    report = write_tokens(tokenizer, items, out_path, max_length=max_length, min_supervised=2)
    if max_total_tokens is None or report.total_tokens <= max_total_tokens:
        return report
    kept, total, supervised = [], 0, 0
    for line in Path(out_path).read_text().splitlines():
        rec = json.loads(line)
        if total + len(rec["input_ids"]) > max_total_tokens:
            break
        kept.append(line)
        total, supervised = total + len(rec["input_ids"]), supervised + sum(rec["loss_mask"])
    atomic_write_text(Path(out_path), "".join(x + "\n" for x in kept))
    return TokensReport(
        written=len(kept), truncated=report.truncated, total_tokens=total, supervised=supervised, skipped=report.skipped
    )
