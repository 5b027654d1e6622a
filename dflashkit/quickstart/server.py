"""The quickstart's regeneration through llama.cpp's `llama-server` (`--regen-server auto|off`), when
scripts/build_llamacpp.sh has built it.

    by_slots = server_rates(target, prompts)       # {slots: tokens/s} of short runs through fresh llama-servers
    with regen_pool(rates) as pool:                # a ServerPool of a running server, or None (in process)
        regenerate_until(target, conversations, path, deadline, done, batch=16, pool=pool, slots=8, ...)

The server runs the target's F32 GGUF (`llama-quantize` of the shipped Q4_1 file, made once: the same weights as the
fp32 HF target dflashkit de-quantises from that file) on the threads torch uses, with as many parallel slots as
measured fastest on this machine (SLOT_CHOICES). At the start of the run (`stage_rates`) both routes do the same job —
the same prompts, at most RATE_TOKENS new tokens each, stop tokens honoured, prefill and the wait for the last reply
included (`server_rate`, `in_process_rate`) — and the quickstart takes the server only when it is clearly faster
(`BATCH_GAIN`), recording the choice (route and slots) so a resumed run keeps it (a regeneration file never mixes
the two generators). (The in-process decoding rate that picks the batch size leaves prefill and finished rows out:
it reads well above what real regeneration runs at, so compared with the server's rate it would keep the quickstart
off a server that regenerates clearly faster.)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

SLOT_CHOICES = (8, 16)  # llama-server --parallel values timed at the start (bench/regen_throughput.py --server-slots)
SERVER_SLOTS = 8  # the slots of a run whose quickstart.json predates the measured choice
SERVER_CHUNK = 8  # conversations per regenerate() call through the server, in slots: few chunk ends, where the
# slots drain while the chunk waits for its slowest reply (docs/studies.md, "One stream against chunks")
RATE_TOKENS = 32  # new tokens per calibration request
MAX_CONTEXT = 1024  # --regen-turns all: a later turn whose context reaches this (the sample length) ends the chat


def server_built() -> bool:
    from dflashkit.export.llamacpp import built

    return built()


@contextlib.contextmanager
def _server(slots: int) -> Iterator[Any]:
    from dflashkit.export.llama_server import LlamaServer
    from dflashkit.export.llamacpp import f32_target_gguf

    with LlamaServer(
        f32_target_gguf(), slots=slots, threads=torch.get_num_threads(), ctx_per_slot=MAX_CONTEXT + 512
    ) as srv:
        yield srv


def server_rates(target: Any, prompts: list[list[int]]) -> dict[int, float]:
    """{slots: new tokens per second of llama-server answering `prompts`} for each of SLOT_CHOICES."""
    return {n: server_rate(target, prompts, n) for n in SLOT_CHOICES}


def server_rate(target: Any, prompts: list[list[int]], slots: int = SERVER_SLOTS) -> float:
    """New tokens per second of llama-server answering `prompts` (`slots` parallel slots and requests in flight,
    RATE_TOKENS each; the prompts' prefill included, server start not)."""
    from dflashkit.data.conversations import default_stop_token_ids
    from dflashkit.data.server_client import ServerPool

    stops = default_stop_token_ids(target)
    with _server(slots) as srv:
        pool = ServerPool([srv.url])
        pool.connect(target.tokenizer)

        def one(p: list[int]) -> int:
            c = pool.complete(p, max_tokens=RATE_TOKENS, temperature=0.0, top_p=1.0, seed=0, stop_ids=stops)
            return _content_tokens(c.token_ids or [], stops)

        one(prompts[0])  # warm-up
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=slots) as ex:
            tokens = sum(ex.map(one, prompts))
        return tokens / (time.perf_counter() - t0)


def in_process_rate(target: Any, prompts: list[list[int]], batch: int) -> float:
    """New tokens per second of in-process `generate` doing `server_rate`'s job: `prompts` longest first in batches of
    `batch` (as `regenerate` batches them), at most RATE_TOKENS new tokens each, stopping at the stop tokens; prefill
    and the rows that finished early included."""
    from dflashkit.data.conversations import default_stop_token_ids
    from dflashkit.data.regenerate import generate_longest_first

    stops = default_stop_token_ids(target)
    t0 = time.perf_counter()
    replies = generate_longest_first(target, prompts, batch_size=batch, max_new_tokens=RATE_TOKENS)
    return sum(_content_tokens(ids, stops) for ids in replies) / (time.perf_counter() - t0)


def _content_tokens(ids: list[int], stops: Iterable[int]) -> int:
    """Reply tokens without a closing stop token (one route returns it, the other may not)."""
    return len(ids) - (1 if ids and ids[-1] in set(stops) else 0)


def regenerate_until(
    target: Any,
    conversations: Iterable[Any],
    regen: Path,
    deadline: float,
    done: set[str],
    *,
    batch: int,
    pool: Any,
    max_new_tokens: int,
    say: Callable[[str], None],
    turns: str = "first",
    slots: int = SERVER_SLOTS,
) -> tuple[int, float, float | None]:
    """Regenerate `conversations` into `regen` chunk by chunk — in process (2 batches a chunk) or through `pool`
    (SERVER_CHUNK × `slots`, `slots` in flight) — until `deadline`: nothing starts after it, what is under
    way finishes; the first batch / wave always runs, so training never starts from nothing. Adds the ids written to
    `done`. Returns (new tokens, seconds, the first chunk's tokens/s: the yardstick of the run's notes)."""
    from dflashkit.data.regenerate import RegenSettings, read_regenerated, regenerate

    chunk: list[Any] = []
    first, new_tokens, seconds, first_rate = True, 0, 0.0, None
    size = SERVER_CHUNK * slots if pool else 2 * batch
    for c in conversations:
        chunk.append(c)
        if len(chunk) < size:
            continue
        if not first and time.monotonic() >= deadline:
            break
        stats = regenerate(
            target,
            chunk,
            regen,
            progress=False,
            servers=pool,
            stop_at=deadline,
            settings=RegenSettings(
                max_new_tokens=max_new_tokens,
                batch_size=batch,
                concurrency=slots,
                turns=turns,
                max_prompt_length=MAX_CONTEXT if turns == "all" else None,
            ),
        )
        new_tokens, seconds = new_tokens + stats.new_tokens, seconds + stats.seconds
        first_rate = first_rate if first_rate is not None else stats.tokens_per_s
        done |= {str(r["id"]) for r in read_regenerated(regen)}
        chunk, first = [], False
        say(f"prepare: {len(done)} responses")
        if stats.not_started:
            break
    return new_tokens, seconds, first_rate


@contextlib.contextmanager
def regen_pool(rates: dict[str, Any]) -> Iterator[Any]:
    """A ServerPool of a running llama-server (`rates["regen_server_slots"]` slots) when the run chose the server
    route (`rates["regen_route"]`), else None; the server stops when the block ends."""
    if rates.get("regen_route") != "llama-server":
        yield None
        return
    from dflashkit.data.server_client import ServerPool

    with _server(server_slots(rates)) as srv:
        yield ServerPool([srv.url])


def server_slots(rates: dict[str, Any]) -> int:
    """The parallel slots the run measured fastest (SERVER_SLOTS for a run recorded before they were measured)."""
    return int(rates.get("regen_server_slots", SERVER_SLOTS))


__all__ = [
    "SERVER_SLOTS",
    "SLOT_CHOICES",
    "in_process_rate",
    "regen_pool",
    "regenerate_until",
    "server_built",
    "server_rate",
    "server_rates",
    "server_slots",
]
