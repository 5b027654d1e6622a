"""Teacher-forced τ from cached target transcripts (`transcripts.py`): many drafters, chain and DDTree, no target
forward at all.

    cache = build_transcripts(target, prompts, "runs/transcripts", max_new_tokens=256, layer_ids=[1, 8, 14, 20, 27])
    results = simulate_many({"a": drafter_a, "b": drafter_b}, cache, tree_budgets=[4, 8, 16])

Greedy verification is a pure function of the target's greedy continuation: on the accepted path, the target's
argmax at each node *is* the next transcript token, and nodes off the path are never followed. So `simulate`
replays the real loop (decode/generate.py) exactly: bonus at position s, the drafter cache extended with the features of
the tokens committed last round (the prompt first), the full block [token[s], MASK × (bs−1)] at positions s…
(also in the last round), of which the first min(bs − 1, room) drafts are used; chain L = 1 + longest prefix of
those drafts equal to the transcript; DDTree-B builds the tree (depth ≤ room) from their marginals and follows the
transcript's tokens; s advances by L. At temperature 0 it gives the same acceptance lengths as
`generate(method="chain"/"tree")`, up to floating-point near-ties between the transcript's one-pass features and
the loop's incremental ones.

A round's L counts what the output keeps (the transcript ends at max_new_tokens or on a stop token, and the real
loop cuts its last round there too), so both give the same lengths in every round, the last one included.

Limits: greedy only. Hybrid
targets (Gated DeltaNet layers) are no exception: `decode.generate(method="tree")` verifies the whole tree exactly
there too (hybrid_tree.py), so the DDTree rows are what the real loop accepts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dflashkit.decode.tree import build_tree
from dflashkit.drafter.heads import BlockSlots
from dflashkit.drafter.model import DFlashDrafter, DrafterCache
from dflashkit.errors import DataError
from dflashkit.evaluate.groups import PromptGroups, with_groups
from dflashkit.evaluate.stats import (
    Method,
    acceptance_stats,
    context_notes,
    drafter_info,
    parse_method,
    parse_methods,
    verify_width,
)
from dflashkit.evaluate.transcripts import Transcript, TranscriptCache


# ---------------------------------------------------------------------------------------------- replay
def _tree_length(
    draft_logits: Tensor,
    draft_hidden: Tensor,
    root: int,
    truth: list[int],
    drafter: DFlashDrafter,
    embed_weight: Tensor,
    budget: int,
    top_k: int | None,
    force_spine: bool,
    block: BlockSlots,
) -> tuple[int, int]:
    """(acceptance length, the tree's draft nodes) of one DDTree round on the transcript."""
    conditional = drafter.head.tree_conditional(drafter, draft_logits, draft_hidden, embed_weight, block)
    tree = build_tree(
        torch.log_softmax(draft_logits, dim=-1),
        root,
        budget=budget,
        top_k=top_k,
        force_spine=force_spine,
        conditional=conditional,
    )
    if drafter.config.draft_vocab_size is not None:
        tree.tokens[1:] = drafter.to_target_ids(tree.tokens[1:])
    tokens, table = tree.tokens.tolist(), tree.child_table()
    cur = depth = 0
    while depth < len(truth):  # the target's token at a node on the true path is the next transcript token
        nxt = next((c for c in table[cur] if tokens[c] == truth[depth]), None)
        if nxt is None:
            break
        cur, depth = nxt, depth + 1
    return depth + 1, tree.size - 1


def replay(drafter: DFlashDrafter, transcript: Transcript, **settings: Any) -> list[int]:
    """Acceptance lengths (per round, bonus included) of one fixed greedy transcript: `replay_rounds` (same
    keyword settings) without the drafted counts."""
    return replay_rounds(drafter, transcript, **settings)[0]


@torch.no_grad()
def replay_rounds(
    drafter: DFlashDrafter,
    transcript: Transcript,
    *,
    embed_weight: Tensor,
    lm_head_weight: Tensor,
    max_new_tokens: int,
    method: Method,
    block_size: int | None = None,
    tree_top_k: int | None = None,
    force_spine: bool = False,
    reserve: int | None = 0,
) -> tuple[list[int], list[int]]:
    """(acceptance lengths, draft tokens verified) per round of `method` on one fixed greedy transcript.

    `reserve` is the engine's rule for a round's drafts when `room` tokens are left after its first one: at most
    room − reserve (0: dflashkit's loop; 1: llama-server, which keeps room for the round's own target token and
    drafts nothing when none is left); None: every round verifies all its slots and counts what they accept even
    past the end (vLLM counts before it cuts the output) — the transcript must then reach a block past the end."""
    ids, p_len = transcript.ids, transcript.prompt_len
    last = len(ids) - 1
    bs = block_size or drafter.config.block_size
    lengths: list[int] = []
    drafted: list[int] = []
    if method.kind == "ar" or bs < 2:  # one token per round, exactly as the loop without a drafter
        rounds = max(0, min(last, p_len + max_new_tokens - 1) - p_len)
        return [1] * rounds, [0] * rounds
    feats = transcript.features(drafter.config.target_layer_ids).to(drafter.device)  # (1, T, K·H)
    dcache = DrafterCache()
    new_ctx, new_pos = feats[:, :p_len], torch.arange(p_len)[None]
    s = p_len  # position of the bonus token
    first = drafter.first_draft_slot()  # DSpark: every slot drafts, through its Markov head (as decode/generate.py)
    while s - p_len + 1 < max_new_tokens and s < last:
        room = max_new_tokens - (s - p_len + 1)
        n_verify = bs - first if reserve is None else min(bs - first, room - reserve)  # (as decode/generate.py)
        if n_verify < 1:  # the engine makes the last token without a round
            break
        embeds = drafter.block_embeddings(torch.tensor([[ids[s]]]), embed_weight, bs)  # always the full block
        hidden = drafter(
            new_ctx, embeds, context_positions=new_pos, block_positions=torch.arange(s, s + bs)[None], cache=dcache
        )
        draft_hidden = hidden[0, first : first + n_verify]  # (nv, H)
        draft_logits = drafter.logits(draft_hidden, lm_head_weight).float()  # (nv, V')
        truth = ids[s + 1 : s + 1 + n_verify]  # the target's greedy tokens at the used draft slots
        block = BlockSlots(hidden[0], ids[s], ids[s - 1])  # s ≥ p_len ≥ 1
        if method.kind == "tree":
            L, nodes = _tree_length(
                draft_logits, draft_hidden, ids[s], truth, drafter, embed_weight, int(method.budget), tree_top_k,
                force_spine, block,
            )  # fmt: skip
        else:
            drafts = drafter.head.greedy_drafts(drafter, draft_logits, ids[s], draft_hidden, embed_weight, block)[0]
            acc = 0
            while acc < len(truth) and drafts[acc] == truth[acc]:
                acc += 1
            L, nodes = acc + 1, len(drafts)
        L = min(L, last - s)  # what the output keeps: the transcript ends at max_new_tokens or a stop token
        lengths.append(L)
        drafted.append(nodes)
        new_ctx, new_pos = feats[:, s : s + L], torch.arange(s, s + L)[None]
        s += L
    return lengths, drafted


def _sim_methods(tree_budgets: Sequence[int], chain: bool, methods: Sequence[str] | None) -> list[Method]:
    if methods is not None:
        out = [m for m in parse_methods(methods) if m.kind != "ar"]
    else:
        out = ([Method("chain", "chain")] if chain else []) + [parse_method(f"ddtree:{b}") for b in tree_budgets]
    if any(m.is_auto for m in out):
        raise DataError(
            "ddtree:auto is chosen from measured round times, which a simulation does not have: give budgets "
            "(e.g. ddtree:3,ddtree:8) or use `dflashkit eval`"
        )
    if not out:
        raise DataError("nothing to simulate: give chain and/or tree budgets")
    return out


def simulate_many(
    drafters: dict[str, DFlashDrafter],
    transcripts: str | Path | TranscriptCache,
    *,
    block_size: int | None = None,
    tree_budgets: Sequence[int] = (4, 8, 16),
    tree_top_k: int | None = None,
    chain: bool = True,
    methods: Sequence[str] | None = None,
    prompt_ids: Sequence[str] | None = None,
    force_spine: bool = False,
    progress: bool = True,
    categories: Mapping[str, str] | None = None,
    length_buckets: Sequence[int] | None = None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Teacher-forced acceptance statistics of every drafter × method on one transcript cache.

    Returns {drafter name: {method name: stats}}, stats as `stats.acceptance_stats` plus `per_prompt` (prompt id →
    list of L), `by_category` and, with `length_buckets`, `by_length` (groups.py). Methods: `methods` (names, `ar`
    ignored) or chain + ddtree:B for each budget. categories: prompt id → category (default: as the cache recorded
    each prompt's, else "all").
    """
    from tqdm import tqdm

    cache = transcripts if isinstance(transcripts, TranscriptCache) else TranscriptCache(transcripts)
    todo = _sim_methods(tree_budgets, chain, methods)
    for name, d in drafters.items():
        cache.check_drafter(d, source=f"drafter {name!r}")
    indices = list(range(len(cache)))
    if prompt_ids is not None:
        where = {e["id"]: i for i, e in enumerate(cache.entries)}
        missing = [p for p in prompt_ids if p not in where]
        if missing:
            raise DataError(f"{cache.path}: prompts {missing[:5]} are not in the transcript cache")
        indices = [where[p] for p in prompt_ids]
    embed, head = cache.head()
    per: dict[str, dict[str, dict[str, list[int]]]] = {n: {m.name: {} for m in todo} for n in drafters}
    drafted: dict[str, dict[str, dict[str, int]]] = {n: {m.name: {} for m in todo} for n in drafters}
    heads = {}
    for t_index in tqdm(indices, desc="simulate", unit="prompt", disable=not progress):
        tr = cache.load(t_index)
        for name, d in drafters.items():
            if d.device not in heads:
                heads[d.device] = (embed.to(d.device), head.to(d.device))
            e_w, h_w = heads[d.device]
            for m in todo:
                per[name][m.name][tr.id], rounds = replay_rounds(
                    d.eval(),
                    tr,
                    embed_weight=e_w,
                    lm_head_weight=h_w,
                    max_new_tokens=cache.max_new_tokens,
                    method=m,
                    block_size=block_size,
                    tree_top_k=tree_top_k,
                    force_spine=force_spine,
                )
                drafted[name][m.name][tr.id] = sum(rounds)
    chosen = [cache.entries[i] for i in indices]
    groups = PromptGroups.of(
        (
            (e["id"], (categories or {}).get(e["id"]) or e.get("category") or "all", int(e["prompt_len"]))
            for e in chosen
        ),
        length_buckets,
    )
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, d in drafters.items():
        bs = verify_width(d, block_size)
        out[name] = {}
        for m in todo:
            lengths, counts = per[name][m.name], drafted[name][m.name]
            st = {
                **acceptance_stats(list(lengths.values()), m.max_length(bs), [counts[p] for p in lengths]),
                "n_prompts": len(lengths),
                "per_prompt": lengths,
            }
            out[name][m.name] = with_groups(st, lengths, groups, m.max_length(bs), counts)
    return out


def simulate(
    drafter: DFlashDrafter,
    transcripts: str | Path | TranscriptCache,
    *,
    block_size: int | None = None,
    tree_budgets: Sequence[int] = (4, 8, 16),
    tree_top_k: int | None = None,
    chain: bool = True,
    progress: bool = False,
    **kw: Any,
) -> dict[str, dict[str, Any]]:
    """`simulate_many` for one drafter: {method name: stats}."""
    return simulate_many(
        {"drafter": drafter},
        transcripts,
        block_size=block_size,
        tree_budgets=tree_budgets,
        tree_top_k=tree_top_k,
        chain=chain,
        progress=progress,
        **kw,
    )["drafter"]


def simulation_results(
    cache: TranscriptCache,
    drafters: dict[str, DFlashDrafter],
    results: dict[str, Any],
    *,
    dataset: str = "",
    block_size: int | None = None,
    tree_top_k: int | None = None,
    drafter_sources: dict[str, str] | None = None,
    thinking: str | None = None,
    length_buckets: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The results.json document of a simulation (same schema as `evaluate`; `kind` = "simulate", no timings).
    thinking / length_buckets: recorded in its settings (the thinking mode the prompts were rendered in)."""
    m = cache.manifest
    notes = ["teacher-forced simulation on greedy target transcripts: τ only (no wall-clock timings)"]
    done = {p for per in results.values() for st in per.values() for p in st.get("per_prompt", {})}
    longest = max(
        (int(e["prompt_len"]) + int(e["num_tokens"]) for e in cache.entries if e["id"] in done), default=0
    )  # the prompts of this simulation, not every prompt the cache holds
    notes += context_notes(drafters, longest)
    return {
        "schema": "dflashkit.eval/1",
        "kind": "simulate",
        "target": m["target"],
        "dataset": {
            "name": str(dataset),
            "n_prompts": max((st["n_prompts"] for per in results.values() for st in per.values()), default=0),
            "transcripts": str(cache.path),
        },
        "settings": {
            "max_new_tokens": cache.max_new_tokens,
            "sampling": {"temperature": 0.0},
            "block_size": block_size,
            "tree_top_k": tree_top_k or None,
            "layers_stored": cache.layer_ids,
            "stop_token_ids": m.get("stop_token_ids", []),
            "thinking": thinking,
            "length_buckets": sorted(int(e) for e in length_buckets) if length_buckets else None,
        },
        "drafters": {
            n: drafter_info(d, source=(drafter_sources or {}).get(n), block_size=block_size)
            for n, d in drafters.items()
        },
        "ar": None,
        "results": results,
        "notes": notes,
    }
