"""Exact DDTree verification on hybrid targets (Qwen3.5 / Qwen3.6: Gated DeltaNet layers + full attention).

An attention layer verifies a flattened tree in one pass with the ancestor-only mask. A Gated DeltaNet layer is a
recurrence: the state a node needs is the one reached along *its own* root path, and so is the input window of the
short causal convolution in front of it. `verify_tree` verifies the whole tree exactly and commits the cache, in
one of three modes (N = 1 + budget nodes, D = depth, R = root-to-leaf paths):

  one-pass modes, "scan" (the default) and "levels": ONE target pass over the N nodes. The stock model runs as it
      is (embeddings, rotary positions start + depth, the tree mask in every attention layer, MLPs, norms, feature
      hooks); for the duration of the pass only, each Gated DeltaNet token mixer is replaced by
      `_gated_deltanet_tree`, which calls the module's own projections and norm, transformers'
      `causal_conv1d_update` (batch = the N nodes, each with the conv window of its own path) and
      `torch_recurrent_gated_delta_rule` — the torch fallback on CPU, the flash-linear-attention / causal-conv1d
      kernels when installed. The recurrence is run
        "scan":   as ONE call over the R root-to-leaf paths (batch = paths, each from the committed state; padding
                  steps have g = β = 0, which leave a delta-rule state as it is); the accepted path is replayed
                  (one call of L steps) from the committed state at commit. Nothing per node is kept.
        "levels": one call per depth (batch = the nodes of that depth, initial states gathered from their
                  parents'); every node's state is kept for the commit (replayed instead above
                  KEEP_STATES_MAX_BYTES).
      The pass reads the committed recurrent/conv states and never writes them; it appends N attention K/V. At
      commit the K/V are compacted to the accepted path and every recurrent layer gets the conv window and the
      recurrent state *of the accepted node* (never a rejected branch): the cache is exactly that of feeding
      the accepted tokens.
  "paths" (any recurrent layer type, e.g. Qwen3-Next's fused projections): the whole target runs on the R paths
      as batch rows (right-padded) over a batched copy of the committed cache; attention layers see plain causal
      rows, recurrent layers start from copies of the committed states. The committed cache is untouched; the
      accepted tokens are then fed to it (a second pass, as chain verification on hybrids does after a rejection).

Costs per round: the one-pass modes read the weights once for N tokens, like a dense tree. "scan" adds R × (D + 1)
recurrent steps in one call per layer and R copies of the committed state (plus the commit replay); "levels" adds
D + 1 calls per layer and moves 2N states per layer (N gathered parent states, N node states kept until commit).
"paths" runs ≈ R × (D + 1) tokens, copies the attention K/V R times and needs a second pass. Measured in
bench/hybrid_tree.py; docs/hybrid-ddtree.md has the numbers and the GPU estimate.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflashkit.decode.tree import DraftTree, follow_tree, tree_attention_bias
from dflashkit.errors import DFlashError
from dflashkit.target.cache import keep_positions
from dflashkit.target.model import LINEAR_ATTENTION, Target

MODES = ("auto", "levels", "scan", "paths")
# The Gated DeltaNet pieces the one-pass modes call (transformers' Qwen3.5/3.6 layout; Qwen3-Next fuses them).
_GDN_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj")


class HybridTreeError(DFlashError, ValueError):
    """Tree verification cannot run on this hybrid target as asked (unknown mode, unsupported recurrent layers)."""


NodeTokens = Callable[[Tensor], Tensor]  # (N, V) logits at the tree's nodes → (N,) the target's token at each


def _argmax(logits: Tensor) -> Tensor:
    return logits.argmax(-1)


@dataclass
class TreeVerdict:
    """The outcome of one tree verification, after the cache has been committed to the accepted path."""

    path: list[int]  # accepted node indices, root (0) first
    next_token: int  # the target's token after the last accepted node (the new bonus)
    features: Tensor | None  # (1, len(path), K·H) target features of the accepted tokens


def _recurrent_cache_layers(cache: Any) -> list[Any]:
    return [
        layer
        for layer in getattr(cache, "layers", [])
        if isinstance(getattr(layer, "recurrent_states", {}).get(0), Tensor)
    ]


def _recurrent_mixers(target: Target) -> list[nn.Module]:
    return [
        getattr(layer, "linear_attn", None)
        for layer, kind in zip(target.layers, target.layer_types, strict=True)
        if kind == LINEAR_ATTENTION
    ]


def supports_one_pass(target: Target) -> bool:
    """True when every recurrent layer is a Gated DeltaNet with the Qwen3.5/3.6 module layout."""
    mixers = _recurrent_mixers(target)
    return bool(mixers) and all(m is not None and all(hasattr(m, p) for p in _GDN_PARTS) for m in mixers)


def resolve_mode(target: Target, mode: str) -> str:
    if mode not in MODES:
        raise HybridTreeError(f"unknown hybrid tree mode {mode!r}; valid modes: {list(MODES)}")
    if mode == "auto":
        return "scan" if supports_one_pass(target) else "paths"
    if mode in ("levels", "scan") and not supports_one_pass(target):
        raise HybridTreeError(
            f"hybrid tree mode {mode!r} needs Gated DeltaNet layers laid out as in Qwen3.5/3.6 "
            f"({', '.join(_GDN_PARTS)}); {target.architecture} has other recurrent layers: use "
            f"mode 'paths'"
        )
    return mode


# ---------------------------------------------------------------------------------------------- the schedule
@dataclass
class TreeSchedule:
    """How recurrent layers walk a draft tree: depth by depth ("levels"), path by path ("scan"), and each node's
    conv window along its path. Built once per round on the target's device."""

    parents: Tensor  # (N,) long, −1 at the root
    depths: Tensor  # (N,) long
    levels: list[Tensor]  # levels[d]: (n_d,) the nodes at depth d, in tree order
    parent_rows: list[Tensor]  # parent_rows[d]: (n_d,) row of each node's parent in levels[d − 1] (0 at the root)
    rows: Tensor  # (N,) row of each node within its level
    paths: Tensor  # (R, D + 1) root-to-leaf paths, right-padded with N (an appended all-zero step)
    hits: Tensor  # (N,) flat index r·(D + 1) + depth of the first path through each node
    _windows: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, tree: DraftTree, device: torch.device | str) -> TreeSchedule:
        parents, depths = tree.parents.to(device), tree.depths.to(device)
        rows = torch.zeros_like(depths)
        levels, parent_rows = [], []
        for d in range(int(depths.max()) + 1):
            nodes = (depths == d).nonzero().flatten()  # (n_d,) ascending = tree order
            rows[nodes] = torch.arange(nodes.numel(), device=device)
            levels.append(nodes)
            parent_rows.append(rows[parents[nodes]] if d else torch.zeros(1, dtype=torch.long, device=device))
        paths, n = root_paths(tree), tree.size
        width = len(levels)
        hits = [0] * n
        for r, path in reversed(list(enumerate(paths))):  # reversed: the first path through a node wins
            for c, node in enumerate(path):
                hits[node] = r * width + c
        padded = torch.tensor([p + [n] * (width - len(p)) for p in paths], device=device)  # (R, D + 1)
        return cls(parents, depths, levels, parent_rows, rows, padded, torch.tensor(hits, device=device))

    def conv_windows(self, kernel: int) -> tuple[Tensor, Tensor]:
        """(before, after), each (N, K): columns of [committed conv window (K) | tree nodes (N)] holding the K conv
        inputs on a node's path, oldest first — `after` ends with the node itself (its conv state once fed),
        `before` with its parent (the window it is convolved with; the committed window for the root)."""
        if kernel in self._windows:
            return self._windows[kernel]
        n = self.parents.shape[0]
        after = torch.empty(n, kernel, dtype=torch.long, device=self.parents.device)  # (N, K)
        anc = torch.arange(n, device=self.parents.device)  # (N,) ancestor at distance m
        for m in range(kernel):
            # on the path: node column K + anc; past the root: committed column K − m + depth (K − 1 = newest)
            after[:, kernel - 1 - m] = torch.where(m <= self.depths, anc + kernel, kernel - m + self.depths)
            anc = self.parents[anc.clamp(min=0)]
        committed = torch.arange(kernel, device=after.device)[None]  # (1, K)
        before = torch.cat([committed, after])[self.parents + 1]  # (N, K): parent −1 → the committed window
        self._windows[kernel] = before, after
        return before, after


# Node states are kept until commit while all of them (N × every Gated DeltaNet layer's state) fit in this many
# bytes; a bigger tree keeps only each depth's states while stepping and replays the accepted path at commit.
KEEP_STATES_MAX_BYTES = 2 << 30


@dataclass
class _TreePass:
    """One tree pass: the schedule, how Gated DeltaNet layers step their recurrence, and what they record."""

    schedule: TreeSchedule
    scan: bool  # True: one recurrent call over every root-to-leaf path; False: one per depth
    keep_states: bool  # depth stepping only: keep every node's state for commit (else replay the path)
    records: dict[int, _LayerRecord] = field(default_factory=dict)


@dataclass
class _LayerRecord:
    """What one Gated DeltaNet layer computed for the tree, kept until the accepted node is known."""

    conv_inputs: Tensor  # (C, K + N): committed conv window, then every node's pre-conv projection
    steps: tuple[Tensor, ...]  # q, k (N, 1, Hk, dk), v (N, 1, Hv, dv), g, beta (N, 1, Hv): recurrent inputs
    states: list[Tensor] | None  # states[d]: (n_d, Hv, dk, dv) state after each node of depth d, if kept


def _gated_deltanet_tree(
    mod: nn.Module,
    tp: _TreePass,
    hidden_states: Tensor,
    cache: Any = None,
    attention_mask: Tensor | None = None,
    **_: Any,
) -> Tensor:
    """A Qwen3.5 GatedDeltaNet forward over the flattened tree (1, N, H): every node sees the conv window and the
    recurrent state of its own path; the cache's committed states are read, never written."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update

    li, kernel, schedule = mod.layer_idx, mod.conv_kernel_size, tp.schedule
    conv_state = cache.get_conv_state(li) if cache is not None else None  # (1, C, ≥K)
    recurrent = cache.get_recurrent_state(li) if cache is not None else None  # (1, Hv, dk, dv)
    if conv_state is None or recurrent is None:
        raise HybridTreeError("tree verification on a hybrid target needs a prefilled cache")
    x = hidden_states[0]  # (N, H)
    n = x.shape[0]
    mixed = mod.in_proj_qkv(x)  # (N, C)
    z = mod.in_proj_z(x).reshape(n, -1, mod.head_v_dim)  # (N, Hv, dv)
    b, a = mod.in_proj_b(x), mod.in_proj_a(x)  # (N, Hv) each
    inputs = torch.cat([conv_state[0, :, -kernel:], mixed.T.to(conv_state.dtype)], dim=1)  # (C, K + N)
    before, _ = schedule.conv_windows(kernel)
    windows = inputs[:, before].permute(1, 0, 2).contiguous()  # (N, C, K)
    qkv = causal_conv1d_update(
        mixed[:, :, None], windows, mod.conv1d.weight.squeeze(1), mod.conv1d.bias, mod.activation
    )[:, :, 0]  # (N, C)
    q, k, v = torch.split(qkv, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
    q = q.reshape(n, 1, -1, mod.head_k_dim)  # (N, 1, Hk, dk): batch = nodes
    k = k.reshape(n, 1, -1, mod.head_k_dim)
    v = v.reshape(n, 1, -1, mod.head_v_dim)  # (N, 1, Hv, dv)
    beta = b.sigmoid()[:, None]  # (N, 1, Hv)
    g = (-mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias))[:, None]  # (N, 1, Hv)
    steps = (q, k, v, g, beta)
    if tp.scan:
        out, states = _scan_paths(schedule, steps, recurrent), None
    else:
        out, states = _step_depths(schedule, steps, recurrent, tp.keep_states)
    tp.records[li] = _LayerRecord(inputs, steps, states)
    core = mod.norm(out.reshape(-1, mod.head_v_dim), z.reshape(-1, mod.head_v_dim))  # (N·Hv, dv)
    return mod.out_proj(core.reshape(1, n, -1))  # (1, N, H)


def _step_depths(
    schedule: TreeSchedule, steps: tuple[Tensor, ...], recurrent: Tensor, keep: bool
) -> tuple[Tensor, list[Tensor] | None]:
    """One recurrent step per depth, batch = the nodes of that depth, each from its parent's state.
    Returns the outputs (N, 1, Hv, dv) and, if `keep`, the states after every node (per depth)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    q, k, v, g, beta = steps
    out = v.new_empty(v.shape)  # (N, 1, Hv, dv)
    states, prev = [], recurrent  # prev: (n_{d−1}, Hv, dk, dv)
    for nodes, parent_rows in zip(schedule.levels, schedule.parent_rows, strict=True):
        o, prev = torch_recurrent_gated_delta_rule(
            q[nodes],
            k[nodes],
            v[nodes],
            g=g[nodes],
            beta=beta[nodes],
            initial_state=prev[parent_rows],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # (n_d, 1, Hv, dv), (n_d, Hv, dk, dv)
        out[nodes] = o.to(out.dtype)
        if keep:
            states.append(prev)
    return out, states if keep else None


def _scan_paths(schedule: TreeSchedule, steps: tuple[Tensor, ...], recurrent: Tensor) -> Tensor:
    """One recurrent call over every root-to-leaf path (batch = paths, each from the committed state). Padding
    steps have g = β = 0 (and q = k = v = 0): the delta rule leaves the state as it is. Returns (N, 1, Hv, dv)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    rows, width = schedule.paths.shape
    flat = schedule.paths.flatten()  # (R·(D + 1),)

    def lay(t: Tensor) -> Tensor:  # (N, 1, …) → (R, D + 1, …) along the paths
        padded = torch.cat([t[:, 0], t.new_zeros(1, *t.shape[2:])])  # (N + 1, …)
        return padded[flat].reshape(rows, width, *t.shape[2:])

    q, k, v, g, beta = (lay(t) for t in steps)
    initial = recurrent.expand(rows, *recurrent.shape[1:]).contiguous()  # (R, Hv, dk, dv)
    o, _ = torch_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=initial, output_final_state=False, use_qk_l2norm_in_kernel=True
    )  # (R, D+1, Hv, dv)
    return o.flatten(0, 1)[schedule.hits][:, None]  # (N, 1, Hv, dv)


@contextmanager
def _tree_mixers(target: Target, tp: _TreePass) -> Iterator[None]:
    """For one pass, every Gated DeltaNet token mixer runs `_gated_deltanet_tree`; put back however it ends."""
    saved = []
    for mod in _recurrent_mixers(target):
        saved.append((mod, mod.__dict__.get("forward")))
        mod.forward = functools.partial(_gated_deltanet_tree, mod, tp)
    try:
        yield
    finally:
        for mod, old in saved:
            if old is None:
                del mod.forward
            else:
                mod.forward = old


def select_states(cache: Any, records: dict[int, _LayerRecord], schedule: TreeSchedule, path: list[int]) -> None:
    """Commit every recurrent layer's conv window and recurrent state to those reached at the accepted path's last
    node: its kept state, or (states not kept) the path's recurrent steps replayed from the committed state."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    node = path[-1]
    depth, row = int(schedule.depths[node]), int(schedule.rows[node])
    idx = torch.tensor(path, device=schedule.parents.device)
    for li, rec in records.items():
        layer = cache.layers[li]
        kernel = rec.conv_inputs.shape[1] - schedule.parents.shape[0]
        _, after = schedule.conv_windows(kernel)
        window = rec.conv_inputs[:, after[node]][None]  # (1, C, K)
        if rec.states is not None:
            state = rec.states[depth][row : row + 1]  # (1, Hv, dk, dv)
        else:  # (1, L, heads, dim) each: the accepted path as one sequence from the committed state
            q, k, v, g, beta = (t[idx].transpose(0, 1) for t in rec.steps)
            _, state = torch_recurrent_gated_delta_rule(
                q,
                k,
                v,
                g=g,
                beta=beta,
                initial_state=layer.recurrent_states[0],
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
        for attr, new in (("conv_states", window), ("recurrent_states", state)):
            old = getattr(layer, attr)[0]
            if old.shape == new.shape:
                old.copy_(new)  # in place: keeps the static address transformers marks for CUDA graphs
            else:
                getattr(layer, attr)[0] = new.clone()


def _verify_one_pass(
    target: Target,
    cache: Any,
    tree: DraftTree,
    start: int,
    layer_ids: list[int],
    feature_device: Any,
    clock: Callable[[str], AbstractContextManager],
    scan: bool,
    node_tokens: NodeTokens,
) -> TreeVerdict:
    """ "scan"/"levels": one stock target pass over the flattened tree with the tree-aware Gated DeltaNet mixers,
    follow the target's tokens, compact the K/V and commit the accepted node's recurrent/conv states."""
    with clock("tree_build"):
        schedule = TreeSchedule.of(tree, target.device)
        bias = tree_attention_bias(tree.parents, start, dtype=target.dtype, device=target.device)  # (1,1,N,s+N)
    state_bytes = sum(
        layer.recurrent_states[0].numel() * layer.recurrent_states[0].element_size()
        for layer in _recurrent_cache_layers(cache)
    )
    tp = _TreePass(schedule, scan=scan, keep_states=not scan and tree.size * state_bytes <= KEEP_STATES_MAX_BYTES)
    with clock("verify"), _tree_mixers(target, tp):
        out = target.forward(
            tree.tokens[None],
            layer_ids=layer_ids,
            cache=cache,
            use_cache=True,
            position_ids=(start + tree.depths)[None],
            attention_mask=bias,
            feature_device=feature_device,
        )
    target_tokens = node_tokens(out.logits[0])  # (N,)
    path = follow_tree(tree, target_tokens)
    with clock("commit"):
        keep_positions(cache, start, torch.tensor(path))
        select_states(cache, tp.records, schedule, path)
    feats = out.features[:, path] if out.features is not None else None
    return TreeVerdict(path, int(target_tokens[path[-1]]), feats)


# ---------------------------------------------------------------------------------------------- path batching
def batched_copy(cache: Any, rows: int) -> Any:
    """A copy of a batch-1 cache with `rows` identical rows; the original is never written by passes on the copy
    (K/V are broadcast views that the next update replaces; recurrent/conv states, updated in place, are copied)."""
    out = copy.copy(cache)
    out.layers = []
    for layer in cache.layers:
        new = copy.copy(layer)
        if isinstance(getattr(layer, "keys", None), Tensor):
            new.keys = layer.keys.expand(rows, *layer.keys.shape[1:])  # (R, kv_heads, T, hd)
            new.values = layer.values.expand(rows, *layer.values.shape[1:])
        for attr in ("conv_states", "recurrent_states"):
            if isinstance(getattr(layer, attr, None), dict):
                setattr(
                    new,
                    attr,
                    {
                        i: t.repeat(rows, *[1] * (t.dim() - 1)) if isinstance(t, Tensor) else t
                        for i, t in getattr(layer, attr).items()
                    },
                )
        for attr in ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state"):
            if isinstance(getattr(layer, attr, None), dict):
                setattr(new, attr, dict(getattr(layer, attr)))
        out.layers.append(new)
    return out


def root_paths(tree: DraftTree) -> list[list[int]]:
    """Every root-to-leaf path of the tree (node indices, root first), leaves in tree order."""
    table, parents = tree.child_table(), tree.parents.tolist()
    paths = []
    for leaf in (i for i in range(tree.size) if not table[i]):
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths


def _verify_paths(
    target: Target,
    cache: Any,
    tree: DraftTree,
    start: int,
    layer_ids: list[int],
    feature_device: Any,
    clock: Callable[[str], AbstractContextManager],
    node_tokens: NodeTokens,
) -> TreeVerdict:
    """ "paths": the stock target on every root-to-leaf path (a batch row each) over a batched copy of the cache;
    then the accepted tokens are fed to the committed cache, which the batched pass never touched."""
    paths = root_paths(tree)
    width = max(len(p) for p in paths)
    padded = torch.tensor([p + [p[-1]] * (width - len(p)) for p in paths])  # (R, D + 1) node ids, right-padded
    with clock("verify"):
        batch = batched_copy(cache, len(paths))
        out = target.forward(
            tree.tokens.cpu()[padded],
            cache=batch,
            use_cache=True,
            logits=False,
            position_ids=start + torch.arange(width).expand(len(paths), width),
        )
        del batch
        where = {node: (r, c) for r, p in enumerate(paths) for c, node in enumerate(p)}  # node → (row, depth)
        r, c = zip(*(where[i] for i in range(tree.size)), strict=True)
        hidden = out.final_hidden[list(r), list(c)]  # (N, H): each node once
        target_tokens = node_tokens(target.verifier_logits(hidden))  # (N,)
    path = follow_tree(tree, target_tokens)
    with clock("commit"):  # the committed cache was not touched: feed it the accepted tokens
        fed = target.forward(
            tree.tokens[path][None],
            layer_ids=layer_ids,
            cache=cache,
            use_cache=True,
            logits=False,
            position_ids=torch.arange(start, start + len(path))[None],
            feature_device=feature_device,
        )
    return TreeVerdict(path, int(target_tokens[path[-1]]), fed.features)


def verify_tree(
    target: Target,
    cache: Any,
    tree: DraftTree,
    start: int,
    *,
    layer_ids: Sequence[int] = (),
    feature_device: torch.device | str | None = None,
    mode: str = "auto",
    clock: Callable[[str], AbstractContextManager] | None = None,
    node_tokens: NodeTokens = _argmax,
) -> TreeVerdict:
    """Verify `tree` (root = the bonus token at position `start`, the cache holding exactly the `start` tokens
    before it) on a hybrid target and commit the cache to the accepted path; see the module docstring for the
    modes. `clock(stage)` is a context manager timing the "tree_build", "verify" and "commit" stages; `node_tokens`
    turns the nodes' (N, V) logits into the target's token at each node (argmax, or one sample per node at T > 0:
    sampling.target_tokens)."""
    clock = clock or (lambda _stage: nullcontext())
    mode = resolve_mode(target, mode)
    if mode == "paths":
        return _verify_paths(target, cache, tree, start, list(layer_ids), feature_device, clock, node_tokens)
    return _verify_one_pass(
        target, cache, tree, start, list(layer_ids), feature_device, clock, scan=mode == "scan", node_tokens=node_tokens
    )
