"""Speculative generation with a DFlash drafter: chain and DDTree verification, AR baseline, sampling.

One round (batch 1):
  1. draft:  block = [bonus, MASK × (bs−1)] at positions start…start+bs−1; one drafter pass appends the new
             context K/V (features of the tokens committed last round) to the drafter cache and reads the block;
             slot k predicts the token *at* start+k (slot 0 is discarded). The block is always full, also in the
             last round: attention inside it is bidirectional and the drafter was trained on full blocks, so a
             shorter block would change its drafts (the DDTree reference and z-lab's original loop do the same).
  2. verify: the target runs the block (chain) or the flattened DDTree (tree mask, positions start+depth), cut to
             what `max_new_tokens` leaves room for: the first `room` drafts (chain), a tree of depth ≤ room.
  3. commit: longest accepted prefix + the target's own next token (the new bonus); the target cache is cropped
             (chain) or compacted to the accepted path (tree). Hybrid targets (Gated DeltaNet layers): chain
             verification restores their recurrent states and re-runs only the accepted tokens; tree verification
             gives every node the recurrent state of its own path and commits the accepted node's (hybrid_tree.py).
The drafter's head (`dflashkit.drafter.heads`) makes a round's drafts: DFlash's argmax (or samples) of slots
1…bs−1; DSpark's every slot, left to right through its Markov head, optionally cut where its confidence head's
predicted prefix acceptance falls below `confidence_min`; and it says how a DDTree node ranks its children.
The acceptance length L = accepted + 1 counts the bonus token. `method="ar"` (or no drafter) runs plain
autoregressive decoding through the same loop: verify one token, commit it.
Decoding policy (block size, tree budget, sampling) is a `DecodeSettings` argument, never model state.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dflashkit.cpu_products import route_linears, stock_products
from dflashkit.decode.hybrid_tree import resolve_mode, verify_tree
from dflashkit.decode.tree import build_tree, follow_tree, tree_attention_bias
from dflashkit.drafter.heads import DraftRound
from dflashkit.drafter.model import DFlashDrafter, DrafterCache
from dflashkit.errors import DFlashError
from dflashkit.sampling import (
    GREEDY,
    SamplingParams,
    accept_argmax_drafts,
    accept_sampled_drafts,
    probs,
    sample,
    target_tokens,
)
from dflashkit.target import cache as tc
from dflashkit.target.devices import synchronize
from dflashkit.target.model import Target, check_drafter_fits

METHODS = ("ar", "chain", "tree")


class GenerationError(DFlashError, ValueError):
    """Bad generation arguments (unknown method, prompt too long for the context window, …): one-line CLI error."""


@dataclass
class GenerationResult:
    prompt_len: int
    tokens: list[int]  # generated tokens (prompt excluded)
    acceptance_lengths: list[int] = field(default_factory=list)  # L per round, bonus included
    drafted: list[int] = field(default_factory=list)  # draft tokens the target verified per round (tree: its nodes)
    timings: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # seconds per stage
    stop_reason: str = "max_new_tokens"

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Committed tokens per round (the first token, from prefill, is not a round)."""
        return sum(self.acceptance_lengths) / max(1, self.rounds)


def _clock(device: torch.device, timings: dict[str, float]):
    """`with clock("verify"):` adds the block's wall time to timings["verify"] (synchronising CUDA first)."""

    @contextmanager
    def stage(name: str) -> Iterator[None]:
        synchronize(device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            synchronize(device)
            timings[name] += time.perf_counter() - t0

    return stage


def _pick(logits: Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    return int(logits.argmax(-1)) if params.greedy else int(sample(probs(logits, params), gen))


@dataclass(frozen=True)
class DecodeSettings:
    """How `generate` decodes — the decoding policy, never model state.

    method: "ar" | "chain" | "tree" (DDTree with `tree_budget` nodes over the top `tree_top_k` tokens per depth;
    `tree_top_k` None or 0 = the budget, the DDTree reference: exactly the `tree_budget` most probable prefixes).
    block_size: None = the drafter's own. force_spine: DDTree always keeps the chain of top-1 drafts.
    draft_sampling: at temperature > 0, sample drafts from the drafter (min(1, p/q) rule) instead of argmax
    drafts (sample-and-match). Both are exactly lossless.
    hybrid_tree: how tree verification follows Gated DeltaNet states on hybrid targets, all exact (hybrid_tree.py):
    "scan" (one pass; the recurrence scans every root-to-leaf path), "levels" (one pass; stepped depth by depth),
    "paths" (root-to-leaf paths as batch rows; any recurrent layer), "auto" (scan where the layers allow it).
    confidence_min: DSpark only — draft only while the confidence head's predicted prefix acceptance is ≥ this.
    check_invariants: assert the caches' lengths after every round (tests).
    """

    method: str = "chain"
    max_new_tokens: int = 128
    block_size: int | None = None
    tree_budget: int = 16
    tree_top_k: int | None = None
    force_spine: bool = False
    sampling: SamplingParams = GREEDY
    draft_sampling: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    hybrid_tree: str = "auto"
    check_invariants: bool = False
    confidence_min: float | None = None


@torch.no_grad()
def generate(
    target: Target,
    prompt_ids: Tensor | list[int],
    *,
    drafter: DFlashDrafter | None = None,
    settings: DecodeSettings = DecodeSettings(),
) -> GenerationResult:
    """Generate up to `settings.max_new_tokens` after `prompt_ids` (batch 1) as `settings` says (`DecodeSettings`).
    See the module docstring for the loop."""
    s = settings
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(1, -1)
    prompt_len = ids.shape[1]
    bs = _checked_block_size(
        target,
        drafter,
        method=s.method,
        prompt_len=prompt_len,
        max_new_tokens=s.max_new_tokens,
        block_size=s.block_size,
        tree_budget=s.tree_budget,
        sampling=s.sampling,
        confidence_min=s.confidence_min,
    )
    use_drafter = bs > 1
    if use_drafter:  # a round's few rows: the measured products (a no-op for a drafter decoded before)
        route_linears(drafter.layers)
    head = drafter.head if use_drafter else None
    slots = head.drafts_per_round(bs) if use_drafter else 0  # drafts a round can propose
    tree_mode = resolve_mode(target, s.hybrid_tree) if s.method == "tree" and target.is_hybrid else None
    layer_ids = drafter.config.target_layer_ids if use_drafter else []
    gen = torch.Generator(device=target.device).manual_seed(s.seed) if s.seed is not None else None
    result = GenerationResult(prompt_len=prompt_len, tokens=[])
    clock = _clock(target.device, result.timings)
    stops = set(int(t) for t in s.stop_token_ids)

    cache = target.new_cache()
    # The prompt's width is a one-off: stock products, never a measured choice (whose timing would land here)
    with clock("prefill"), stock_products():
        out = target.forward(
            ids,
            layer_ids=layer_ids,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
            feature_device=drafter.device if use_drafter else None,
        )
    bonus = _pick(out.logits[0, -1], s.sampling, gen)
    result.tokens.append(bonus)
    dcache = DrafterCache()
    new_ctx, new_pos = (out.features, torch.arange(prompt_len)[None]) if use_drafter else (None, None)
    if bonus in stops:
        result.stop_reason = "stop_token"
        return result

    while len(result.tokens) < s.max_new_tokens:
        start = prompt_len + len(result.tokens) - 1  # position of the bonus token
        room = s.max_new_tokens - len(result.tokens)  # tokens we may still add after the bonus
        n_verify = min(slots, room) if use_drafter else 0  # drafts that can still be committed
        drafts = draft_q = draft_logits = draft_hidden = None
        if n_verify > 0:
            one_off = stock_products() if dcache.length == 0 else nullcontext()  # first round: the prompt's width
            with clock("draft"), one_off:  # always the full block (see the module docstring); only n_verify are used
                r = DraftRound(
                    target, drafter, dcache, bonus, new_ctx, new_pos, start, bs, n_verify,
                    s.sampling, s.draft_sampling, gen, s.confidence_min,
                    result.tokens[-2] if len(result.tokens) > 1 else int(ids[0, -1]),
                )  # fmt: skip
                drafts, draft_q, draft_logits, draft_hidden = head.draft_round(r)
        if s.method == "tree" and drafts is not None:
            committed, next_token, feats, nodes = _verify_tree(
                target,
                cache,
                bonus,
                (draft_logits, draft_hidden),
                drafter,
                start,
                layer_ids,
                s.tree_budget,
                s.tree_top_k,
                s.force_spine,
                tree_mode,
                clock,
                lambda logits: target_tokens(logits, s.sampling, gen),
            )
            result.drafted.append(nodes)
        else:
            block = torch.tensor([[bonus] + ([] if drafts is None else drafts.tolist())])  # (1, bl)
            committed, next_token, feats = _verify_chain(
                target, cache, block, start, layer_ids, s.sampling, draft_q, gen, clock, drafter
            )
            result.drafted.append(block.shape[1] - 1)
        with clock("commit"):
            stopped = _commit(result, committed, next_token, stops, s.max_new_tokens)
            if use_drafter:
                new_ctx, new_pos = feats, torch.arange(start, start + len(committed))[None]
            bonus = next_token
            if s.check_invariants:
                _check(
                    len(committed),
                    tc.kv_length(cache),
                    start,
                    dcache.length if drafts is not None else None,
                    slots + 1,
                    s.tree_budget if s.method == "tree" else None,
                )
        if stopped:
            result.stop_reason = "stop_token"
            break
    return result


def _checked_block_size(
    target: Target,
    drafter: DFlashDrafter | None,
    *,
    method: str,
    prompt_len: int,
    max_new_tokens: int,
    block_size: int | None,
    tree_budget: int,
    sampling: SamplingParams,
    confidence_min: float | None = None,
) -> int:
    """Refuse impossible arguments before any work (never replace one silently); the block size a round drafts
    (1 = no drafting: plain AR)."""
    if method not in METHODS:
        raise GenerationError(f"unknown method {method!r}; valid methods: {list(METHODS)}")
    if prompt_len == 0:
        raise GenerationError("empty prompt")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens = {max_new_tokens!r}: expected an integer ≥ 1")
    if block_size is not None and (not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2):
        raise GenerationError(
            f"block_size = {block_size!r}: expected an integer ≥ 2 (the given token and at least one draft); "
            f"method='ar' decodes without a drafter"
        )
    if method == "tree" and (not isinstance(tree_budget, int) or isinstance(tree_budget, bool) or tree_budget < 1):
        raise GenerationError(f"tree_budget = {tree_budget!r}: expected an integer ≥ 1 (DDTree's draft nodes)")
    max_pos = getattr(target.text_config, "max_position_embeddings", None)
    if max_pos is not None and prompt_len + max_new_tokens > max_pos:
        raise GenerationError(
            f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} exceeds the target's "
            f"context window of {max_pos} tokens"
        )
    if method != "ar" and drafter is None:
        raise GenerationError(f"method {method!r} needs a drafter")
    if confidence_min is not None and not (drafter is not None and drafter.head.confidence_gate and method == "chain"):
        raise GenerationError("confidence_min needs a drafter with a confidence head (DSpark) and method 'chain'")
    if confidence_min is not None and not 0.0 <= confidence_min <= 1.0:
        raise GenerationError(f"confidence_min = {confidence_min!r}: expected a probability from 0 to 1")
    if method == "ar":
        return 1
    if confidence_min is not None and getattr(drafter, "confidence_head", None) is None:
        raise GenerationError("confidence_min: this DSpark drafter has no confidence head (enable_confidence_head)")
    check_drafter_fits(drafter.config, target)
    bs = block_size or drafter.config.block_size
    return bs if bs >= 2 else 1


def _commit(
    result: GenerationResult, committed: list[int], next_token: int, stops: set[int], max_new_tokens: int
) -> bool:
    """Record a round: the new tokens (accepted drafts + the target's own next token, cut at a stop token and at
    max_new_tokens) and its acceptance length L = how many of them the output keeps. The cut matters in the last
    round only: a draft accepted past a stop token or past max_new_tokens is not output, so it is not counted
    (simulate counts the same way). Returns whether a stop token ended the generation."""
    new_tokens = [*committed[1:], next_token]
    stop_at = next((i for i, t in enumerate(new_tokens) if t in stops), None)
    if stop_at is not None:
        new_tokens = new_tokens[: stop_at + 1]
    new_tokens = new_tokens[: max_new_tokens - len(result.tokens)]
    result.tokens.extend(new_tokens)
    result.acceptance_lengths.append(len(new_tokens))
    return stop_at is not None


def _verify_chain(
    target: Target,
    cache: object,
    block: Tensor,
    start: int,
    layer_ids: list[int],
    sampling: SamplingParams,
    draft_q: Tensor | None,
    gen: torch.Generator | None,
    clock: Any,
    drafter: DFlashDrafter | None,
) -> tuple[list[int], int, Tensor | None]:
    """Verify a chain block (1, bl) at positions start…; returns (committed block tokens, next token, features)."""
    bl = block.shape[1]
    recurrent = tc.has_recurrent_state(cache)
    with clock("verify"):
        snap = tc.snapshot(cache) if recurrent and bl > 1 else None
        out = target.forward(
            block,
            layer_ids=layer_ids,
            cache=cache,
            use_cache=True,
            position_ids=torch.arange(start, start + bl)[None],
            logits=not sampling.greedy,
            feature_device=drafter.device if drafter is not None and layer_ids else None,
        )
        if sampling.greedy:
            accepted, next_token = _greedy_accept_lazy(target, out.final_hidden[0], block[0, 1:])
    if not sampling.greedy:
        logits = out.logits[0].float()  # (bl, V)
        drafts = block[0, 1:].to(logits.device)
        if draft_q is not None:
            accepted, next_token = accept_sampled_drafts(drafts, probs(logits, sampling), draft_q, gen)
        else:
            accepted, next_token = accept_argmax_drafts(drafts, probs(logits, sampling), gen)
    keep = accepted + 1
    with clock("commit"):
        if keep < bl:
            if snap is not None:  # rejected tokens must leave no trace in recurrent states: rewind, re-run accepted
                tc.restore(cache, snap)
                target.forward(
                    block[:, :keep],
                    cache=cache,
                    use_cache=True,
                    logits=False,
                    position_ids=torch.arange(start, start + keep)[None],
                )
            else:
                tc.crop(cache, start + keep)
    feats = out.features[:, :keep] if out.features is not None else None
    return block[0, :keep].tolist(), next_token, feats


def _greedy_accept_lazy(target: Target, final_hidden: Tensor, drafts: Tensor) -> tuple[int, int]:
    """Greedy acceptance with a lazy verifier head: final_hidden (bl, H) of the verified block, drafts (bl − 1,).

    The LM head is the largest matmul of a small target's verify pass, and an undertrained drafter's first draft
    is rejected in most rounds: row 0's logits decide that alone (one row, the AR step's shape), and the other
    rows' logits are computed only when the first draft is accepted. A row's logits do not depend on the other
    rows (in float the one-row product may differ in the last bits from a many-row one, as between any two batch
    shapes; an AR step computes its row the same way)."""
    first = int(target.verifier_logits(final_hidden[None, :1])[0, 0].float().argmax())
    if drafts.numel() == 0 or int(drafts[0]) != first:
        return 0, first
    rest = target.verifier_logits(final_hidden[None, 1:])[0].float().argmax(-1)  # (bl − 1,)
    posterior = torch.cat([torch.tensor([first], device=rest.device), rest])  # (bl,)
    accepted = int((drafts.to(rest.device) == posterior[:-1]).long().cumprod(0).sum())
    return accepted, int(posterior[accepted])


def _verify_tree(
    target: Target,
    cache: object,
    bonus: int,
    draft: tuple[Tensor, Tensor],
    drafter: DFlashDrafter,
    start: int,
    layer_ids: list[int],
    budget: int,
    top_k: int | None,
    force_spine: bool,
    hybrid_mode: str | None,
    clock: Any,
    node_tokens: Callable[[Tensor], Tensor],
) -> tuple[list[int], int, Tensor, int]:
    """DDTree: build the tree from the drafter's marginals, verify it in one pass, follow the target's token at each
    node (`node_tokens`: argmax, or one sample per node at T > 0 — exact, sampling.py), compact the cache. Returns
    (committed tokens, the target's next token, their features, the tree's draft nodes).
    Hybrid targets (`hybrid_mode` set) go through hybrid_tree.verify_tree, which also commits recurrent states."""
    draft_logits, draft_hidden = draft  # (D, V'), (D, H)
    with clock("tree_build"):
        logp = torch.log_softmax(draft_logits, dim=-1)  # (D, V')
        conditional = drafter.head.tree_conditional(drafter, draft_logits, draft_hidden, target.embed_weight)
        tree = build_tree(logp, bonus, budget=budget, top_k=top_k, force_spine=force_spine, conditional=conditional)
        if drafter.config.draft_vocab_size is not None:
            tree.tokens[1:] = drafter.to_target_ids(tree.tokens[1:])
    if hybrid_mode is not None:
        v = verify_tree(
            target,
            cache,
            tree,
            start,
            layer_ids=layer_ids,
            feature_device=drafter.device,
            mode=hybrid_mode,
            clock=clock,
            node_tokens=node_tokens,
        )
        return tree.tokens[torch.tensor(v.path)].tolist(), v.next_token, v.features, tree.size - 1
    with clock("tree_build"):
        additive = tree_attention_bias(tree.parents, start, dtype=target.dtype, device=target.device)  # (1,1,N,s+N)
    with clock("verify"):
        out = target.forward(
            tree.tokens[None],
            layer_ids=layer_ids,
            cache=cache,
            use_cache=True,
            position_ids=(start + tree.depths)[None],
            attention_mask=additive,
            feature_device=drafter.device,
        )
    tokens = node_tokens(out.logits[0])  # (N,)
    path = follow_tree(tree, tokens)
    with clock("commit"):
        rows = torch.tensor(path)
        tc.keep_positions(cache, start, rows)
    return tree.tokens[rows].tolist(), int(tokens[path[-1]]), out.features[:, rows], tree.size - 1


def _check(L: int, kv_len: int, start: int, drafter_len: int | None, bs: int, budget: int | None) -> None:
    """Per-round invariants (`bs`: 1 + the drafts a round proposes): 1 ≤ L ≤ 1 + min(B, bs − 1); the target cache
    holds exactly the committed tokens (everything up to and including the accepted drafts; the new bonus is not in
    it yet); the drafter cache holds context strictly before the block."""
    upper = 1 + min(budget, bs - 1) if budget is not None else bs
    if not 1 <= L <= upper:
        raise AssertionError(f"acceptance length {L} outside [1, {upper}]")
    if kv_len != start + L:
        raise AssertionError(f"target cache holds {kv_len} tokens, expected {start + L}")
    if drafter_len is not None and drafter_len != start:
        raise AssertionError(f"drafter cache holds {drafter_len} context tokens, expected {start}")
