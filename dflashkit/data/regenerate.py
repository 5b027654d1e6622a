"""Regenerate responses with the target: the target writes the assistant turns of every conversation.

DFlash drafters learn the target's own distribution, so training responses are the target's (paper §4.2).
`regenerate` renders each prompt with the chat template and `add_generation_prompt=True` (which turns:
`dflashkit.data.turns` — the first assistant turn, or every one with the target's earlier replies as context) and
generates the reply, greedy when temperature == 0, else sampling with temperature/top_p and no top-k, stopping at the
tokenizer's eos / end-of-turn tokens:
  in process       HF `generate` on left-padded batches of conversations sorted by prompt length;
  through servers  OpenAI-compatible servers (vLLM, SGLang, llama-server: `dflashkit.data.server_client`), the prompt
                   sent as token ids, `concurrency` conversations in flight over all servers.
Output, one JSON line per conversation, each made durable (fsync) before the next is taken:

    {"id": ..., "messages": [...prompt..., {"role": "assistant", "content": response}],
     "response_token_ids": [...generated ids, the stop token included when finished...],   # --turns first
     "turn_token_ids": [[...], [...]],                                                       # --turns all
     "reasoning": ["...", ...],                                                              # --thinking on
     "finished": true|false,      # false: max_new_tokens reached before a stop token
     "generation": {"max_new_tokens", "temperature", "top_p", "chat_template_kwargs", "target",
                    ["turns", "thinking", "generator"]}}

Resumable: ids already in the output file are skipped; a last line cut by a kill (no newline / bad JSON) is
dropped. A line is written only when its conversation is complete, by one thread, so kills and restarts neither lose
nor duplicate one. Resuming with different generation settings (or another generator: in process vs a server's
model) is refused (the file would mix two distributions). In process, sampling is seeded once per call (`seed`), so
sampled text after a resume differs from an uninterrupted run; through servers each turn's seed is derived from
(`seed`, conversation id, turn), so a resumed sampled run asks for the same draws.
"""

from __future__ import annotations

import json
import os
import threading
import time
import zlib
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import Field
from tqdm import tqdm

from dflashkit.data.conversations import Conversation, end_of_turn_ids
from dflashkit.data.server_client import ServerError, ServerPool
from dflashkit.data.turns import TurnState
from dflashkit.errors import DataError, DFlashError
from dflashkit.output_dir import one_writer
from dflashkit.target.model import Target, TargetText
from dflashkit.validation import JsonFields, json_problem


@dataclass
class RegenStats:
    total: int = 0  # conversations asked for
    already_done: int = 0  # found in the output file (resume)
    generated: int = 0  # written by this call
    finished: int = 0  # of those, ended with a stop token
    skipped: dict[str, str] = field(default_factory=dict)  # id → reason (no user turn, prompt too long)
    not_started: int = 0  # left for a later call: `stop_at` came first
    turns: int = 0  # replies written (> generated with --turns all)
    new_tokens: int = 0
    seconds: float = 0.0
    retokenized: int = 0  # server replies that came as text only (re-tokenised here)
    retokenize_differs: int = 0  # server replies whose text re-tokenises to other ids than the server generated
    servers: list[dict[str, Any]] = field(default_factory=list)  # per server: url, protocol, model, requests …

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 2)}


class _Message(JsonFields):
    role: str
    content: str


class _Record(JsonFields):
    """The fields of a regeneration record that resuming and tokenising read."""

    id: str | int
    messages: list[_Message]
    response_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    turn_token_ids: list[list[Annotated[int, Field(ge=0)]]] | None = None
    finished: bool | None = None
    generation: dict[str, Any] | None = None


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
            why = json_problem(_Record, rec)
            if why:
                raise ValueError(why)
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
    target: Target | TargetText,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    chat_template_kwargs: dict[str, Any] | None,
    turns: str = "first",
    thinking: str | None = None,
    generator: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a regeneration file was written with; a resume must match it. Keys appear only when not the default,
    so files of earlier versions (first turns, no thinking mode, in process) stay resumable."""
    out: dict[str, Any] = {
        "max_new_tokens": int(max_new_tokens),
        "temperature": float(temperature),
        "top_p": float(top_p),
        "chat_template_kwargs": dict(chat_template_kwargs or {}),
        "target": target.source,
    }
    if turns != "first":
        out["turns"] = turns
    if thinking is not None:
        out["thinking"] = thinking
    if generator is not None:
        out["generator"] = generator
    return out


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
        input_ids=ids.to(target.device),
        attention_mask=mask.to(target.device),
        generation_config=cfg,
        cache=target.new_cache(),  # appends in place: DynamicCache copies the batch's whole cache a step
    )
    new = out[:, width:].tolist()  # (B, ≤ max_new_tokens)
    stops = set(stop_ids)
    results = []
    for row in new:
        end = next((j for j, t in enumerate(row) if t in stops), None)
        results.append((row[: end + 1], True) if end is not None else (row, False))
    return results


def generate_longest_first(
    target: Target, prompts: list[list[int]], *, batch_size: int, max_new_tokens: int
) -> list[list[int]]:
    """Greedy responses (stop token included) to `prompts`, generated longest first in batches of `batch_size` — the
    order `regenerate` batches in, so similar lengths share a batch — returned in the prompts' order."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    responses: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = generate_batch(target, [prompts[i] for i in idx], max_new_tokens=max_new_tokens)
        for i, (resp, _) in zip(idx, batch, strict=True):
            responses[i] = resp
    return responses


def _plan(
    target: Target | TargetText,
    conversations: list[Conversation],
    done: set[str],
    stats: RegenStats,
    *,
    turns: str,
    thinking: str | None,
    chat_template_kwargs: dict[str, Any] | None,
    max_prompt_length: int | None,
) -> list[tuple[TurnState, list[int]]]:
    """Conversations still to regenerate with their first prompt ids, longest prompt first."""
    todo: list[tuple[TurnState, list[int]]] = []
    ids_seen: set[str] = set()
    for conv in conversations:
        if conv.id in ids_seen:
            raise DataError(f"duplicate conversation id {conv.id!r} ({conv.source}): ids must be unique")
        ids_seen.add(conv.id)
        if conv.id in done:
            stats.already_done += 1
            continue
        state = TurnState(conv, turns=turns, thinking=thinking)
        if not state.segments:
            stats.skipped[conv.id] = "no user message before the first assistant turn"
            continue
        prompt = state.next_prompt(target.tokenizer, chat_template_kwargs, max_prompt_length)
        if prompt is None:
            stats.skipped[conv.id] = str(state.stopped)
            continue
        todo.append((state, prompt))
    todo.sort(key=lambda t: -len(t[1]))  # similar lengths share a batch; longest (largest memory) first
    return todo


def _write(f: Any, records: list[dict[str, Any]]) -> None:
    """Append whole lines and make them durable before anything else happens (resume trusts the file)."""
    f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    f.flush()
    os.fsync(f.fileno())


@dataclass(frozen=True)
class RegenSettings:
    """How `regenerate` asks the target for replies.

    max_new_tokens: reply length cap. temperature / top_p: 0 = greedy. batch_size: conversations per in-process
    `generate` batch; concurrency: conversations in flight through servers. chat_template_kwargs: passed to the chat
    template. max_prompt_length: prompts longer than this are skipped. turns: "first" (the first assistant turn) or
    "all" (every assistant turn, each prompted with the replies before it). thinking: "off" | "on" | "keep" for
    templates with `enable_thinking` (None: the template's own default). compile: whether in-process batches run the
    target's decoder layers through torch.compile — "auto" (where measured to pay: data.regenerate_compile), "on",
    "off".
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    batch_size: int = 8
    chat_template_kwargs: dict[str, Any] | None = None
    seed: int = 0
    max_prompt_length: int | None = None
    turns: str = "first"
    thinking: str | None = None
    concurrency: int = 8
    compile: str = "auto"


def regenerate(
    target: Target | TargetText,
    conversations: list[Conversation],
    out_path: str | Path,
    *,
    settings: RegenSettings = RegenSettings(),
    servers: ServerPool | None = None,
    progress: bool = True,
    stop_at: float | None = None,
) -> RegenStats:
    """Write the target's replies (`settings.turns`: the first assistant turn, or every one) to `out_path` (JSONL).

    In process (HF `generate`, `settings.batch_size` conversations a batch) or, with `servers`, through
    OpenAI-compatible servers (`settings.concurrency` conversations in flight, spread over the servers:
    dflashkit.data.server_client).
    `stop_at` (a `time.monotonic()` time): no batch, no conversation starts after it — the first batch or the first
    `settings.concurrency` conversations always do — and those under way finish and are written; the rest are counted in
    `not_started` (a later call with the same file takes them up, as a resume does).
    """
    rs = settings
    if target.tokenizer is None:
        raise DataError(f"target {target.source}: no tokenizer found (regeneration needs one with a chat template)")
    if servers is None and isinstance(target, TargetText):
        raise DataError(f"target {target.source}: regenerating in process needs the model (Target.load), not only text")
    if rs.max_new_tokens < 1 or rs.batch_size < 1 or rs.concurrency < 1:
        raise DataError(
            f"max_new_tokens={rs.max_new_tokens}, batch_size={rs.batch_size}, concurrency={rs.concurrency}: "
            f"expected positive integers"
        )
    out_path = Path(out_path)
    with one_writer(out_path.parent, "dflashkit prepare"):
        stats = RegenStats(total=len(conversations))
        generator = None
        if servers is not None:
            stats.servers = servers.connect(target.tokenizer)
            generator = {"kind": "server", "models": sorted({s["model"] for s in stats.servers if s["model"]})}
        recorded = _settings(
            target,
            rs.max_new_tokens,
            rs.temperature,
            rs.top_p,
            rs.chat_template_kwargs,
            rs.turns,
            rs.thinking,
            generator,
        )
        existing = read_regenerated(out_path, repair=True)
        for k, rec in enumerate(existing, start=1):
            if rec.get("generation") != recorded:
                raise DataError(
                    f"{out_path}:{k}: written with generation settings {rec.get('generation')}, but this run "
                    f"uses {recorded}; use another output directory or delete the file"
                )
        todo = _plan(
            target,
            conversations,
            {str(r["id"]) for r in existing},
            stats,
            turns=rs.turns,
            thinking=rs.thinking,
            chat_template_kwargs=rs.chat_template_kwargs,
            max_prompt_length=rs.max_prompt_length,
        )
        eos = target.eos_token_id if isinstance(target, TargetText) else target.model.generation_config.eos_token_id
        stop_ids = end_of_turn_ids(target.tokenizer, eos)
        job = _Job(target, recorded, stats, stop_ids, rs.chat_template_kwargs, rs.max_prompt_length, rs.seed, stop_at)
        start = time.perf_counter()
        bar = tqdm(total=len(todo), unit="conv", desc="regenerate", disable=not progress or not todo)
        with open(out_path, "a", encoding="utf-8") as f:
            if servers is None:
                _in_process(job, todo, f, bar, rs, start)
            else:
                _through_servers(job, todo, f, bar, servers, rs.concurrency, start)
        bar.close()
        stats.seconds = time.perf_counter() - start
        if servers is not None:
            stats.servers = servers.describe()
        return stats


@dataclass
class _Job:
    """What every batch / request of one regeneration run needs."""

    target: Target | TargetText
    settings: dict[str, Any]
    stats: RegenStats
    stop_ids: list[int]
    kwargs: dict[str, Any] | None
    max_prompt_length: int | None
    seed: int
    stop_at: float | None = None  # time.monotonic(): start nothing new after it (once `free` things have started)

    lock: threading.Lock = field(default_factory=threading.Lock)  # stats are counted from worker threads

    def reply(self, state: TurnState, ids: list[int], finished: bool) -> list[int] | None:
        """Take a reply; the next prompt of the conversation, or None when it is done."""
        text = self.target.tokenizer.decode(ids, skip_special_tokens=True)
        state.add_reply(ids, text, finished)
        with self.lock:
            self.stats.turns += 1
            self.stats.new_tokens += len(ids)
        return state.next_prompt(self.target.tokenizer, self.kwargs, self.max_prompt_length)

    def may_start(self, started: int, free: int, left: int) -> bool:
        """Whether another batch / conversation may start, `started` having started (the first `free` always may);
        when not, the `left` not started are counted."""
        if self.stop_at is None or started < free or time.monotonic() < self.stop_at:
            return True
        self.stats.not_started = left
        return False

    def finish(self, state: TurnState) -> dict[str, Any]:
        with self.lock:
            self.stats.generated += 1
            self.stats.finished += int(state.finished)
        return state.record(self.settings)


def _in_process(
    job: _Job, todo: list[tuple[TurnState, list[int]]], f: Any, bar: tqdm, rs: RegenSettings, start: float
) -> None:
    """HF `generate` on batches of conversations; every turn of a batch is generated before it is written. Each
    `generate` runs the target's layers compiled or not as the compile choice says (timed by it while it is open)."""
    from dflashkit.data.regenerate_compile import start_trial
    from dflashkit.target.compiled_layers import compiled_layers

    torch.manual_seed(job.seed)
    temperature, top_p, size = job.settings["temperature"], job.settings["top_p"], rs.batch_size
    done = {"conversations": 0, "replies": 0, "tokens": 0}

    def seconds_left(rate: float) -> float:
        """The conversations left × the new tokens of one (so far; before any, one reply of max_new_tokens) at `rate`
        seconds per 1,000, within the time budget."""
        if done["conversations"]:
            per_conversation = done["tokens"] / done["conversations"]
        elif done["replies"]:
            per_conversation = done["tokens"] / done["replies"]
        else:
            per_conversation = job.settings["max_new_tokens"]
        left = (len(todo) - done["conversations"]) * per_conversation / 1000 * rate
        return left if job.stop_at is None else max(0.0, min(left, job.stop_at - time.monotonic()))

    trial = start_trial(job.target, rs.compile, batch_size=size, seconds_left=seconds_left)

    def say(message: str) -> None:
        tqdm.write(f"regenerate: torch.compile: {message}")

    if trial.settled and rs.compile == "auto":
        say(trial.message)

    def generate(prompts: list[list[int]], compiled: bool) -> list[tuple[list[int], bool]]:
        with compiled_layers(job.target) if compiled else nullcontext():
            return generate_batch(
                job.target,
                prompts,
                max_new_tokens=job.settings["max_new_tokens"],
                temperature=temperature,
                top_p=top_p,
                stop_ids=job.stop_ids,
            )

    for k, batch in enumerate(_batches(todo, size)):
        if not job.may_start(k, 1, len(todo) - k * size):
            break
        active = list(batch)
        while active:
            prompts = [prompt for _, prompt in active]
            results = trial.run_step(
                lambda compiled, prompts=prompts: generate(prompts, compiled),
                work=lambda out: max(1, sum(len(ids) for ids, _ in out)) / 1000,
                say=say,
                keep=(DFlashError,),
            )
            done["tokens"] += sum(len(ids) for ids, _ in results)
            done["replies"] += len(results)
            nxt = [(state, job.reply(state, ids, fin)) for (state, _), (ids, fin) in zip(active, results, strict=True)]
            active = [(state, prompt) for state, prompt in nxt if prompt is not None]
        _write(f, [job.finish(state) for state, _ in batch])
        done["conversations"] += len(batch)
        job.stats.seconds = time.perf_counter() - start
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{job.stats.tokens_per_s:.1f}")


def _server_conversation(job: _Job, servers: ServerPool, state: TurnState, prompt: list[int] | None) -> dict:
    """Every turn of one conversation through the servers, in order (runs on a worker thread)."""
    tok = job.target.tokenizer
    turn = 0
    while prompt is not None:
        seed = (job.seed * 1_000_003 + zlib.crc32(f"{state.conv.id}/{turn}".encode())) % (1 << 31)
        c = servers.complete(
            prompt,
            max_tokens=job.settings["max_new_tokens"],
            temperature=job.settings["temperature"],
            top_p=job.settings["top_p"],
            seed=seed,
            stop_ids=job.stop_ids,
        )
        ids = c.token_ids
        again = list(tok(c.text, add_special_tokens=False)["input_ids"])
        if ids is None:  # text only: re-tokenise, and close the turn as the target would
            with job.lock:
                job.stats.retokenized += 1
            ids = again + ([job.stop_ids[0]] if c.finished else [])
        else:
            body = ids[:-1] if ids and ids[-1] in job.stop_ids else ids
            with job.lock:
                job.stats.retokenize_differs += int(again != body)
        if max(ids, default=0) >= len(tok) or min(ids, default=0) < 0:
            raise ServerError(f"a server returned token id {max(ids)} outside the target's vocabulary ({len(tok)})")
        prompt = job.reply(state, ids, c.finished)
        turn += 1
    return job.finish(state)


def _through_servers(
    job: _Job,
    todo: list[tuple[TurnState, list[int]]],
    f: Any,
    bar: tqdm,
    servers: ServerPool,
    concurrency: int,
    start: float,
) -> None:
    """`concurrency` conversations in flight; each line is written by this thread as its conversation completes.
    On an error (or Ctrl-C) the conversations in flight are abandoned, not waited for: they were not written, so
    a rerun regenerates them."""
    pending = iter(todo)
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="regen")
    running: set[Any] = set()
    clean, started = False, 0
    try:
        while True:
            while (
                len(running) < concurrency
                and job.may_start(started, concurrency, len(todo) - started)
                and (nxt := next(pending, None)) is not None
            ):
                running.add(pool.submit(_server_conversation, job, servers, *nxt))
                started += 1
            if not running:
                break
            finished, running = wait(running, return_when=FIRST_COMPLETED)
            ok = [fut for fut in finished if fut.exception() is None]
            _write(f, [fut.result() for fut in ok])  # what succeeded is kept even when a sibling failed
            for fut in finished:
                if fut.exception() is not None:
                    raise fut.exception()
            job.stats.seconds = time.perf_counter() - start
            bar.update(len(finished))
            bar.set_postfix(tok_s=f"{job.stats.tokens_per_s:.1f}")
        clean = True
    finally:
        pool.shutdown(wait=clean, cancel_futures=True)
