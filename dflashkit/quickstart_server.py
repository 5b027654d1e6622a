"""The quickstart's regeneration through llama.cpp's `llama-server` (`--regen-server auto|off`), when
scripts/build_llamacpp.sh has built it.

    rate = server_rate(target, prompts)            # tokens/s of a short run through a fresh llama-server
    with regen_pool(rates) as pool:                # a ServerPool of a running server, or None (in process)
        regenerate_until(target, conversations, path, deadline, done, batch=16, pool=pool, ...)

The server runs the target's F32 GGUF (`llama-quantize` of the shipped Q4_1 file, made once: the same weights as the
fp32 HF target dflashkit de-quantises from that file), with SERVER_SLOTS parallel slots on the threads torch uses.
The quickstart measures it next to in-process batched `generate` at the start of the run (`stage_rates`) and takes
the server only when it is clearly faster on this machine (`BATCH_GAIN`), recording the choice so a resumed run
keeps it (a regeneration file never mixes the two generators).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

SERVER_SLOTS = 8  # llama-server --parallel: requests decoded together (bench/regen_throughput.py --server-slots)
RATE_TOKENS = 32  # new tokens per calibration request
MAX_CONTEXT = 1024  # --regen-turns all: a later turn whose context reaches this (the sample length) ends the chat


def server_built() -> bool:
    from dflashkit.export.llamacpp import built

    return built()


@contextlib.contextmanager
def _server() -> Iterator[Any]:
    from dflashkit.export.llama_server import LlamaServer
    from dflashkit.export.llamacpp import f32_target_gguf

    with LlamaServer(
        f32_target_gguf(), slots=SERVER_SLOTS, threads=torch.get_num_threads(), ctx_per_slot=MAX_CONTEXT + 512
    ) as srv:
        yield srv


def server_rate(target: Any, prompts: list[list[int]]) -> float:
    """New tokens per second of llama-server answering `prompts` (SERVER_SLOTS in flight, RATE_TOKENS each; the
    prompts' prefill included, server start not)."""
    from dflashkit.data.conversations import default_stop_token_ids
    from dflashkit.data.server_client import ServerPool

    stops = default_stop_token_ids(target)
    with _server() as srv:
        pool = ServerPool([srv.url])
        pool.connect(target.tokenizer)

        def one(p: list[int]) -> int:
            c = pool.complete(p, max_tokens=RATE_TOKENS, temperature=0.0, top_p=1.0, seed=0, stop_ids=stops)
            return len(c.token_ids or [])

        one(prompts[0])  # warm-up
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=SERVER_SLOTS) as ex:
            tokens = sum(ex.map(one, prompts))
        return tokens / (time.perf_counter() - t0)


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
) -> tuple[int, float, float | None]:
    """Regenerate `conversations` into `regen` chunk by chunk — in process (2 batches a chunk) or through `pool`
    (2 × SERVER_SLOTS) — until `deadline`; at least one chunk, so training never starts from nothing. Adds the ids
    done to `done`. Returns (new tokens, seconds, the first chunk's tokens/s: the yardstick of the run's notes)."""
    from dflashkit.data.regenerate import regenerate

    chunk: list[Any] = []
    first, new_tokens, seconds, first_rate = True, 0, 0.0, None
    for c in conversations:
        chunk.append(c)
        if len(chunk) < 2 * (SERVER_SLOTS if pool else batch):
            continue
        if not first and time.monotonic() >= deadline:
            break
        stats = regenerate(
            target, chunk, regen, max_new_tokens=max_new_tokens, batch_size=batch, progress=False, servers=pool,
            concurrency=SERVER_SLOTS, turns=turns, max_prompt_length=MAX_CONTEXT if turns == "all" else None,
        )  # fmt: skip
        new_tokens, seconds = new_tokens + stats.new_tokens, seconds + stats.seconds
        first_rate = first_rate if first_rate is not None else stats.tokens_per_s
        done |= {c.id for c in chunk}
        chunk, first = [], False
        say(f"prepare: {len(done)} responses")
    return new_tokens, seconds, first_rate


@contextlib.contextmanager
def regen_pool(rates: dict[str, Any]) -> Iterator[Any]:
    """A ServerPool of a running llama-server when the run chose the server route (`rates["regen_route"]`), else
    None; the server stops when the block ends."""
    if rates.get("regen_route") != "llama-server":
        yield None
        return
    from dflashkit.data.server_client import ServerPool

    with _server() as srv:
        yield ServerPool([srv.url])


__all__ = ["SERVER_SLOTS", "regen_pool", "regenerate_until", "server_built", "server_rate"]
