"""Regenerate responses with the target: the target writes the first assistant turn of every conversation.

DFlash drafters learn the target's own distribution, so training responses are the target's (paper §4.2).
`regenerate` renders each prompt (`dflashkit.data.conversations.prompt_messages`: messages before the first
assistant turn) with the chat template and `add_generation_prompt=True`, runs HF `generate` on left-padded batches
of prompts sorted by length (greedy when temperature == 0, else sampling with temperature/top_p and no top-k), and
stops at the tokenizer's eos / end-of-turn tokens. Output, one JSON line per conversation, flushed per batch:

    {"id": ..., "messages": [...prompt..., {"role": "assistant", "content": response}],
     "response_token_ids": [...generated ids, the stop token included when finished...],
     "finished": true|false,      # false: max_new_tokens reached before a stop token
     "generation": {"max_new_tokens", "temperature", "top_p", "chat_template_kwargs", "target"}}

Resumable: ids already in the output file are skipped; a last line cut by a kill (no newline / bad JSON) is
dropped. Resuming with different generation settings is refused (the file would mix two distributions).
Sampling is seeded once per call (`seed`), so sampled text after a resume differs from an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dflashkit.data.conversations import Conversation, encode_prompt, end_of_turn_ids, prompt_messages
from dflashkit.errors import DataError
from dflashkit.output_dir import one_writer
from dflashkit.target.model import Target


@dataclass
class RegenStats:
    total: int = 0  # conversations asked for
    already_done: int = 0  # found in the output file (resume)
    generated: int = 0  # written by this call
    finished: int = 0  # of those, ended with a stop token
    skipped: dict[str, str] = field(default_factory=dict)  # id → reason (no user turn, prompt too long)
    new_tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 2)}


def read_regenerated(path: str | Path, *, repair: bool = False) -> list[dict[str, Any]]:
    """Records of a regeneration file. A last line without its newline (cut by a kill mid-write) is ignored, and
    removed from the file when `repair`; a damaged complete line raises DataError naming file:line."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    complete, sep, tail = data.rpartition(b"\n")
    records: list[dict[str, Any]] = []
    for lineno, raw in enumerate(complete.split(b"\n") if sep else [], start=1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
            if not isinstance(rec, dict) or "id" not in rec or "messages" not in rec:
                raise ValueError("expected an object with 'id' and 'messages'")
        except ValueError as e:
            raise DataError(
                f"{path}:{lineno}: damaged regeneration record ({e}); delete the line or the file to regenerate it"
            ) from None
        records.append(rec)
    if repair and tail:
        with open(path, "r+b") as f:
            f.truncate(len(data) - len(tail))
    return records


def _settings(
    target: Target, max_new_tokens: int, temperature: float, top_p: float, chat_template_kwargs: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "max_new_tokens": int(max_new_tokens),
        "temperature": float(temperature),
        "top_p": float(top_p),
        "chat_template_kwargs": dict(chat_template_kwargs or {}),
        "target": target.source,
    }


def _batches(items: list[Any], size: int) -> Iterable[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


@torch.inference_mode()
def generate_batch(
    target: Target,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_ids: list[int] | None = None,
) -> list[tuple[list[int], bool]]:
    """Generate for a batch of prompt ids (left-padded). Returns (response ids incl. the stop token, finished)."""
    from transformers import GenerationConfig

    from dflashkit.data.conversations import default_stop_token_ids

    stop_ids = stop_ids or default_stop_token_ids(target)  # the config's eos for a target without tokenizer files
    if not stop_ids:
        raise DataError(f"target {target.source}: no tokenizer and no eos_token_id in its config; pass stop_ids")
    pad = getattr(target.tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else stop_ids[0]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # (B, T) left-padded
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[b, width - len(p) :] = 1
    sample = temperature > 0
    cfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        temperature=temperature if sample else None,
        top_p=top_p if sample else None,
        top_k=0 if sample else None,
        eos_token_id=stop_ids,
        pad_token_id=pad,
    )
    out = target.model.generate(
        input_ids=ids.to(target.device), attention_mask=mask.to(target.device), generation_config=cfg
    )
    new = out[:, width:].tolist()  # (B, ≤ max_new_tokens)
    stops = set(stop_ids)
    results = []
    for row in new:
        end = next((j for j, t in enumerate(row) if t in stops), None)
        results.append((row[: end + 1], True) if end is not None else (row, False))
    return results


def regenerate(
    target: Target,
    conversations: list[Conversation],
    out_path: str | Path,
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    batch_size: int = 8,
    chat_template_kwargs: dict[str, Any] | None = None,
    seed: int = 0,
    max_prompt_length: int | None = None,
    progress: bool = True,
) -> RegenStats:
    """Write the target's response to the first assistant turn of each conversation to `out_path` (JSONL)."""
    if target.tokenizer is None:
        raise DataError(f"target {target.source}: no tokenizer found (regeneration needs one with a chat template)")
    if max_new_tokens < 1 or batch_size < 1:
        raise DataError(f"max_new_tokens={max_new_tokens}, batch_size={batch_size}: expected positive integers")
    out_path = Path(out_path)
    with one_writer(out_path.parent, "dflashkit prepare"):
        settings = _settings(target, max_new_tokens, temperature, top_p, chat_template_kwargs)
        existing = read_regenerated(out_path, repair=True)
        for k, rec in enumerate(existing, start=1):
            if rec.get("generation") != settings:
                raise DataError(
                    f"{out_path}:{k}: written with generation settings {rec.get('generation')}, but this run "
                    f"uses {settings}; use another output directory or delete the file"
                )
        done = {str(r["id"]) for r in existing}
        stats = RegenStats(total=len(conversations))
        todo: list[tuple[Conversation, list[dict[str, str]], list[int]]] = []
        ids_seen: set[str] = set()
        for conv in conversations:
            if conv.id in ids_seen:
                raise DataError(f"duplicate conversation id {conv.id!r} ({conv.source}): ids must be unique")
            ids_seen.add(conv.id)
            if conv.id in done:
                stats.already_done += 1
                continue
            try:
                prompt = prompt_messages(conv)
            except DataError:
                stats.skipped[conv.id] = "no user message before the first assistant turn"
                continue
            ids = encode_prompt(target.tokenizer, prompt, chat_template_kwargs)
            if max_prompt_length is not None and len(ids) >= max_prompt_length:
                stats.skipped[conv.id] = f"prompt has {len(ids)} tokens ≥ max length {max_prompt_length}"
                continue
            todo.append((conv, prompt, ids))
        todo.sort(key=lambda t: -len(t[2]))  # similar lengths share a batch; longest (largest memory) first
        stop_ids = end_of_turn_ids(target.tokenizer, getattr(target.model.generation_config, "eos_token_id", None))
        torch.manual_seed(seed)
        start = time.perf_counter()
        bar = tqdm(total=len(todo), unit="conv", desc="regenerate", disable=not progress or not todo)
        with open(out_path, "a", encoding="utf-8") as f:
            for batch in _batches(todo, batch_size):
                results = generate_batch(
                    target,
                    [ids for _, _, ids in batch],
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    stop_ids=stop_ids,
                )
                lines = []
                for (conv, prompt, _), (resp, finished) in zip(batch, results, strict=True):
                    text = target.tokenizer.decode(resp, skip_special_tokens=True)
                    lines.append(
                        json.dumps(
                            {
                                "id": conv.id,
                                "messages": [*prompt, {"role": "assistant", "content": text}],
                                "response_token_ids": resp,
                                "finished": finished,
                                "generation": settings,
                            },
                            ensure_ascii=False,
                        )
                        + "\n"
                    )
                    stats.generated += 1
                    stats.finished += int(finished)
                    stats.new_tokens += len(resp)
                f.write("".join(lines))
                f.flush()
                os.fsync(f.fileno())
                stats.seconds = time.perf_counter() - start
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{stats.tokens_per_s:.1f}")
        bar.close()
        stats.seconds = time.perf_counter() - start
        return stats
