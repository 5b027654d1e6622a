"""Products that read the same input, computed as one: a decoder layer multiplies the same rows by its q, k and v
matrices (and by gate and up), and one product over their stacked weights streams them faster than three.

    siblings = Siblings(linears)                  # for one pass group that may fuse (a target's decoder layers)
    siblings.observe(weight, x)                   # each product of a pass, until the first pass was seen whole;
    siblings.done, siblings.sets                  #   then each run of consecutive products of one input is fused
    sibling_product(fn, x, weight, bias)          # at a set's first member: fn over the whole set, sliced; at the
                                                  # others (same input tensor): their slice, computed once

Siblings are found by watching a pass, not by module names: a product is a sibling of the one before it when it
reads the very same input tensor (same object, not modified since). A member gets its slice only as the very next
product call after its elder siblings, on that same unchanged input (an inference tensor has no version counter:
there the call order alone guards it); otherwise it computes its own product. Fusing stacks the members' weights into
one buffer (rows in member order) and makes each member's weight a view of its rows — no second copy, values unchanged,
so every other path (F.linear, few_rows, a one-off pass) computes the same values as unfused. Only frozen float
weights on CPU of one dtype, with all or none of the members biased, are fused; the drafter's layers (trained, saved
with safetensors, which refuses tensors sharing storage) never are (`route_linears(..., fuse=False)`).

Whether fusing pays depends on the CPU, the BLAS and the row count: oneDNN over the stacked weights can save part of
a step at a few rows and nothing at more, and F.linear over them can be slower than unfused — so the fused product is
one more candidate of the measured choice (`products.py`), timed in real steps, never a rule (docs/studies.md,
"Verification cost and product selection").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

_LINK = "_dflashkit_sibling"  # attribute of a fused member's weight: (its FusedSet, its index in the set)
_CALLS = [0]  # sibling_product calls so far: a member's slice is served only right after its elder siblings


def _version(x: Tensor) -> int:
    """The tensor's in-place change counter (an inference tensor has none: its slices rely on the call order)."""
    return -1 if x.is_inference() else x._version


class FusedSet:
    """The members' weights (and biases) stacked in one buffer, each member's weight a view of its rows."""

    def __init__(self, members: list[nn.Linear]) -> None:
        self.members = members
        self.sizes = [m.out_features for m in members]
        with torch.no_grad(), torch.inference_mode(False):  # a normal tensor even when fused during regeneration
            self.weight = torch.cat([m.weight for m in members])  # (ΣO, H)
            self.bias = torch.cat([m.bias for m in members]) if members[0].bias is not None else None  # (ΣO,)
            start = 0
            for i, m in enumerate(members):
                m.weight.data = self.weight[start : start + m.out_features]  # (O_i, H) view: no second copy
                if self.bias is not None:
                    m.bias.data = self.bias[start : start + m.out_features]
                setattr(m.weight, _LINK, (self, i))
                start += m.out_features
        self._views = [m.weight.data_ptr() for m in members]  # where each member's rows lie in the buffer
        self._held: Tensor | None = None  # the input of the last whole-set product …
        self._version = -1  # … its version counter then (an in-place change since makes its slices stale)
        self._call = -1  # … the sibling_product call that computed it
        self._parts: list[Tensor | None] = []  # … and the slices not handed out yet

    def intact(self) -> bool:
        """Whether every member still views the stacked buffer (a move to another device replaces their data)."""
        return [m.weight.data_ptr() for m in self.members] == self._views

    def product(
        self, fn: Callable[[Tensor, Tensor, Tensor | None], Tensor], x: Tensor, index: int, call: int
    ) -> Tensor | None:
        """Member `index`'s product of x (..., H), or None when it must be computed alone: a later member gets its
        slice only as the `index`-th product call after the first member's, on the very same, unchanged x."""
        if index > 0:
            fresh = x is self._held and _version(x) == self._version and call == self._call + index
            if not fresh or self._parts[index] is None:
                return None
            part, self._parts[index] = self._parts[index], None  # each slice handed out once
            return part
        if not self.intact():
            return None
        rows = x.numel() // x.shape[-1]
        out = fn(x.reshape(rows, x.shape[-1]), self.weight, self.bias)  # (M, ΣO)
        lead = x.shape[:-1]
        # own row-major copies: a member's caller may change its output in place without touching its siblings'
        self._parts = [p.contiguous().reshape(*lead, p.shape[1]) for p in out.split(self.sizes, dim=1)]
        self._held, self._version, self._call = x, _version(x), call
        first, self._parts[0] = self._parts[0], None
        return first


def sibling_product(
    fn: Callable[[Tensor, Tensor, Tensor | None], Tensor], x: Tensor, weight: Tensor, bias: Tensor | None
) -> Tensor:
    """x (..., H) @ weight (O, H)ᵀ (+ bias) → (..., O) with `fn`, over the weight's whole fused set when it is the
    set's first member (its siblings then read their slices); alone when the weight belongs to no set."""
    _CALLS[0] += 1
    link = getattr(weight, _LINK, None)
    if link is not None:
        out = link[0].product(fn, x, link[1], _CALLS[0])
        if out is not None:
            return out
    rows = x.numel() // x.shape[-1]
    return fn(x.reshape(rows, x.shape[-1]), weight, bias).reshape(*x.shape[:-1], weight.shape[0])  # (..., O)


def _fusable(members: list[nn.Linear]) -> bool:
    first = members[0].weight
    return len({id(m) for m in members}) == len(members) and all(
        m.weight.device.type == "cpu"
        and m.weight.dtype == first.dtype
        and m.weight.is_floating_point()
        and m.weight.is_contiguous()
        and not m.weight.requires_grad
        and m.in_features == members[0].in_features
        and (m.bias is None) == (members[0].bias is None)
        and (m.bias is None or not m.bias.requires_grad)
        and getattr(m.weight, _LINK, None) is None
        for m in members
    )


class Siblings:
    """Watches one pass of a group's products and fuses the runs of consecutive products of one input."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.linears = linears
        self.index = {id(m.weight): i for i, m in enumerate(linears)}
        # (linear, its input, the input's version) in call order; inputs held, so no address is reused meanwhile
        self.calls: list[tuple[int, Tensor, int]] = []
        self.done = False
        self.sets: list[FusedSet] = []

    def observe(self, weight: Tensor, x: Tensor) -> None:
        """One product of a pass. When the group's first product comes again, the pass before was seen whole."""
        i = self.index.get(id(weight))
        if i is None:
            return
        if i == 0 and self.calls:
            self._fuse()
            return
        self.calls.append((i, x, _version(x)))

    def _fuse(self) -> None:
        runs: list[list[int]] = []
        previous: tuple[Tensor, int] | None = None
        for i, x, version in self.calls:
            if runs and previous is not None and x is previous[0] and version == previous[1]:
                runs[-1].append(i)  # the very input of the product before, unchanged: a sibling
            else:
                runs.append([i])
            previous = (x, version)
        self.calls = []
        self.done = True
        for run in runs:
            members = [self.linears[i] for i in run]
            if len(members) > 1 and _fusable(members):
                self.sets.append(FusedSet(members))


__all__ = ["FusedSet", "Siblings", "sibling_product"]
