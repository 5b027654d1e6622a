"""DDTree: draft trees built from a DFlash drafter's per-position marginals, and their verification helpers.
(DSpark drafters, whose depth-d distribution depends on the token before it, pass `conditional`: see build_tree.)

A DFlash drafter proposes, in one pass, log-distributions q_1 … q_D over the vocabulary for the D positions that
follow the root (the bonus token, already committed). `build_tree` turns them into a draft tree holding the B
prefixes u_1 … u_d (1 ≤ d ≤ D, tokens restricted to the top-K per depth) with the highest Π q_i(u_i). By default
K = min(B, V), as in the DDTree reference: a prefix whose token at some depth is outside that depth's top B has at
least B sibling prefixes that are as probable, so it is never among the B best (ties aside), and the tree is then
the B most probable prefixes over the whole vocabulary. A smaller K caps the branching. It runs a best-first search
over the sorted top-K lists: popping a node pushes its next sibling (same parent, next rank)
and its first child (rank 0 at the next depth). Since q_i(u) ≤ 1 and siblings are sorted, the popped set is
exactly the top-B prefixes, and it is prefix-closed. `force_spine=True` always includes the top-1 chain first.

The target verifies the flattened tree in one forward pass: nodes in the order they were added (parents before
children, root at index 0), an ancestor-only attention mask (`tree_attention_mask`) and position ids
start + depth (`tree_position_ids`). `follow_tree` then walks from the root along the target's tokens and returns
the accepted path; the target's token at its last node is the next bonus token.

Pure tensor/Python code: no model code, and every output lives on the device of its input.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class DraftTree:
    """A flattened draft tree. Node 0 is the root (the bonus token); parents always precede their children."""

    tokens: Tensor  # (N,) long — token of each node; tokens[0] = root token
    parents: Tensor  # (N,) long — parent index; −1 for the root
    depths: Tensor  # (N,) long — 0 for the root, parent depth + 1 otherwise
    log_probs: Tensor  # (N,) float32 — cumulative draft log prob of the node's prefix; 0 for the root
    ranks: Tensor | None = None  # (N,) long — rank among the top-K at the node's depth (−1 root); None if unknown
    _children: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def size(self) -> int:
        """N = 1 + number of draft nodes."""
        return int(self.tokens.shape[0])

    def child_table(self) -> list[list[int]]:
        """children[i] = indices of node i's children, in insertion order (computed once, on the host)."""
        if self._children is None:
            table: list[list[int]] = [[] for _ in range(self.size)]
            for i, p in enumerate(self.parents.tolist()):
                if p >= 0:
                    table[p].append(i)
            self._children = table
        return self._children

    def children(self, i: int) -> list[int]:
        return self.child_table()[i]


def _make_tree(
    tokens: list[int],
    parents: list[int],
    depths: list[int],
    log_probs: list[float],
    ranks: list[int] | None,
    device: torch.device,
) -> DraftTree:
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return DraftTree(
        tokens=as_long(tokens),
        parents=as_long(parents),
        depths=as_long(depths),
        log_probs=torch.tensor(log_probs, dtype=torch.float32, device=device),
        ranks=None if ranks is None else as_long(ranks),
    )


def resolve_top_k(top_k: int | None, budget: int) -> int:
    """The tokens per depth DDTree considers: `top_k`, or the budget when `top_k` is None or 0 (the reference)."""
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be ≥ 1 (or None/0 for = budget), got {top_k}")
    return int(top_k) if top_k else max(1, int(budget))


def build_tree(
    draft_log_probs: Tensor,
    root_token: int,
    *,
    budget: int,
    top_k: int | None = None,
    force_spine: bool = False,
    conditional: Callable[[int, int, int, int], Tensor] | None = None,
) -> DraftTree:
    """Build the DDTree over `draft_log_probs` (D, V) (log-softmax per depth) below `root_token`.

    Takes the `budget` most probable prefixes over the top-`top_k` tokens per depth (all of them if fewer exist);
    `top_k` None or 0 means min(budget, V), the DDTree reference's choice (the `budget` most probable prefixes
    of all); the tree has 1 + min(budget, #prefixes) nodes. With `force_spine`, the top-1 chain (min(budget, D)
    nodes) is taken first and the rest of the budget is filled best-first. Ties go to the entry pushed first.

    conditional: for drafters whose distribution at depth d depends on the tokens before it (DSpark's Markov head,
    DFlash2's selector, Domino's GRU over the path): `conditional(d, parent_node, parent_token, its_parent)` → (V,)
    log-probs of the children of that node (−inf: not a child; parent_token as stored in the tree: the root token for
    node 0, an id of `draft_log_probs`' vocabulary below; its_parent: −1 for the root, else a node already passed to
    `conditional`, so a state can be carried along the path). Each node then
    ranks its own children; the search is the same (a prefix's probability is the product of its conditionals,
    each ≤ 1, so the popped set is still the top-B prefixes and prefix-closed). `draft_log_probs` gives D and V.
    """
    if draft_log_probs.dim() != 2:
        raise ValueError(f"draft_log_probs must be (D, V), got shape {tuple(draft_log_probs.shape)}")
    if budget < 0:
        raise ValueError(f"budget must be ≥ 0, got {budget}")
    depth_count, vocab = draft_log_probs.shape
    device = draft_log_probs.device
    k = min(resolve_top_k(top_k, budget), vocab)

    tokens, parents, depths, log_probs, ranks = [int(root_token)], [-1], [0], [0.0], [-1]
    if depth_count == 0 or budget == 0 or vocab == 0:
        return _make_tree(tokens, parents, depths, log_probs, ranks, device)

    shared: tuple[list[list[float]], list[list[int]]] | None = None
    if conditional is None:
        values, indices = torch.topk(draft_log_probs, k, dim=-1)  # (D, K) each, sorted descending
        shared = (values.double().tolist(), indices.tolist())  # one host transfer; float64 sums on the host
    own: dict[int, tuple[list[float], list[int]]] = {}

    def ranked(d: int, parent: int) -> tuple[list[float], list[int]]:
        """The sorted top-K (log-probs, tokens) of the children at depth index d of node `parent`."""
        if shared is not None:
            return shared[0][d], shared[1][d]
        if parent not in own:
            v, i = torch.topk(conditional(d, parent, tokens[parent], parents[parent]).reshape(-1), k)
            vals = v.double().tolist()
            live = sum(x > float("-inf") for x in vals)  # a child of probability 0 (outside a candidate set) is none
            own[parent] = (vals[:live], i.tolist()[:live])
        return own[parent]

    # Heap entry: (−cumulative log prob, tie-break counter, depth index d (0-based), rank, parent node index).
    heap: list[tuple[float, int, int, int, int]] = []
    counter = 0

    def push(d: int, rank: int, parent: int) -> None:
        nonlocal counter
        vals = ranked(d, parent)[0]
        if rank >= len(vals):
            return
        heapq.heappush(heap, (-(log_probs[parent] + vals[rank]), counter, d, rank, parent))
        counter += 1

    def add(d: int, rank: int, parent: int) -> int:
        vals, toks = ranked(d, parent)
        tokens.append(toks[rank])
        parents.append(parent)
        depths.append(d + 1)
        log_probs.append(log_probs[parent] + vals[rank])
        ranks.append(rank)
        return len(tokens) - 1

    if force_spine:
        parent = 0
        for d in range(min(budget, depth_count)):
            if k > 1:
                push(d, 1, parent)  # the spine node's next sibling; its first child is the next spine node
            parent = add(d, 0, parent)
        # A full spine has no child to push (d = D); a budget-cut spine leaves no budget.
    else:
        push(0, 0, 0)

    while heap and len(tokens) - 1 < budget:
        _, _, d, rank, parent = heapq.heappop(heap)
        node = add(d, rank, parent)
        if rank + 1 < k:
            push(d, rank + 1, parent)
        if d + 1 < depth_count:
            push(d + 1, 0, node)
    return _make_tree(tokens, parents, depths, log_probs, ranks, device)


def tree_attention_mask(parents: Tensor) -> Tensor:
    """(N, N) bool: mask[i, j] is True iff j is i or an ancestor of i (the root included).

    Vectorised walk up the parent pointers: one step per tree level (≤ D + 1 iterations).
    """
    if parents.dim() != 1:
        raise ValueError(f"parents must be (N,), got shape {tuple(parents.shape)}")
    n = parents.shape[0]
    rows = torch.arange(n, device=parents.device)  # (N,)
    mask = torch.zeros(n, n, dtype=torch.bool, device=parents.device)  # (N, N)
    mask[rows, rows] = True
    cur = rows.clone()  # (N,) current ancestor of each node, −1 once past the root
    for _ in range(n):
        cur = torch.where(cur >= 0, parents[cur.clamp(min=0)], cur)  # (N,)
        valid = cur >= 0  # (N,)
        if not bool(valid.any()):
            break
        mask[rows[valid], cur[valid]] = True
    return mask


def tree_attention_bias(parents: Tensor, start: int, *, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """(1, 1, N, start + N) additive mask for verifying the flattened tree after `start` cached tokens: 0 where a
    node may attend (every cached token, itself, its ancestors), the dtype's minimum elsewhere."""
    n = parents.shape[0]
    allowed = torch.ones(n, start + n, dtype=torch.bool, device=parents.device)  # (N, start + N)
    allowed[:, start:] = tree_attention_mask(parents)
    bias = torch.zeros(1, 1, n, start + n, dtype=dtype, device=device)
    return bias.masked_fill_(~allowed.to(device)[None, None], torch.finfo(dtype).min)


def tree_position_ids(depths: Tensor, start: int) -> Tensor:
    """(N,) position ids = start + depth; `start` is the root's position in the sequence."""
    return depths.to(torch.long) + int(start)


def follow_tree(tree: DraftTree, target_tokens: Tensor) -> list[int]:
    """Walk the tree along the target's tokens; return the accepted node indices, starting with the root (0).

    target_tokens (N,): the target's token (argmax or sample) at each node. At the current node, if a child holds
    the target's token there, move to it; otherwise stop. target_tokens[path[-1]] is the new bonus token.
    """
    if target_tokens.shape != (tree.size,):
        raise ValueError(f"target_tokens must be ({tree.size},), got shape {tuple(target_tokens.shape)}")
    targets: list[int] = target_tokens.tolist()
    node_tokens: list[int] = tree.tokens.tolist()
    table = tree.child_table()
    path = [0]
    cur = 0
    while True:
        want = targets[cur]
        nxt = next((c for c in table[cur] if node_tokens[c] == want), None)
        if nxt is None:
            return path
        path.append(nxt)
        cur = nxt


def chain_tree(root_token: int, draft_tokens: Tensor) -> DraftTree:
    """A chain-shaped tree: root, then draft_tokens (D,) each the child of the previous node (log probs 0)."""
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must be (D,), got shape {tuple(draft_tokens.shape)}")
    n = draft_tokens.shape[0] + 1
    device = draft_tokens.device
    root = torch.tensor([int(root_token)], dtype=torch.long, device=device)
    return DraftTree(
        tokens=torch.cat([root, draft_tokens.to(torch.long)]),  # (N,)
        parents=torch.arange(-1, n - 1, dtype=torch.long, device=device),  # (N,)
        depths=torch.arange(n, dtype=torch.long, device=device),  # (N,)
        log_probs=torch.zeros(n, dtype=torch.float32, device=device),  # (N,)
        ranks=None,
    )
