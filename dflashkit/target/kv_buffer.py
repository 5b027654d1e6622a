"""Attention K/V of a decoding target kept in preallocated buffers: appending a step's tokens writes them in place.

transformers' `DynamicLayer` appends with `torch.cat`, copying the whole cache every step: for SmolLM2-135M over a
256-token context that is ~12 MB a step (30 layers × K and V), memory traffic on top of a step that is bound by memory
already; a regeneration batch of 32 copies 32× as much. `GrowingLayer` holds each of K and V in a buffer with room to
spare and hands attention a prefix view of it — the same values in the same order, so every pass computes bit-identical
logits (tests/target/test_kv_buffer.py) — and grows by copying only when the room runs out (by half the length, at least
`MIN_ROOM` tokens: a few copies over a whole generation).

    cache = growing_cache(model.config)   # a DynamicCache whose plain attention layers are GrowingLayers
    layer.keys                            # (B, kv_heads, T, hd): a view of the first T tokens of the buffer
    layer.keys = layer.keys[..., :n, :]   # a prefix of its own buffer: the length is set, nothing is copied
    layer.keys = other                    # any other tensor (an index_select, a broadcast view): adopted as is;
                                          # never written in place (the next append copies it into a new buffer)

Sliding-window and linear-attention (hybrid) layers keep transformers' own classes.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_ROOM = 256  # tokens of spare room a buffer gets when it is (re)allocated


class _Buffer:
    """One of K or V: a (B, kv_heads, capacity, hd) tensor, the length in use, and whether appends may write into
    it (False for an adopted tensor, which may be a view of another cache's memory)."""

    __slots__ = ("data", "length", "owned")

    def __init__(self, data: Tensor | None, length: int, owned: bool) -> None:
        self.data = data
        self.length = length
        self.owned = owned

    def view(self) -> Tensor | None:
        return None if self.data is None else self.data[:, :, : self.length]  # (B, kvh, T, hd)

    def assign(self, x: Tensor | None) -> None:
        """`layer.keys = x`: a prefix of the owned buffer sets the length; anything else is adopted, not owned."""
        d = self.data
        if (
            x is not None
            and d is not None
            and self.owned
            and x.dim() == 4
            and x.data_ptr() == d.data_ptr()
            and x.stride() == d.stride()
            and x.shape[:2] == d.shape[:2]
            and x.shape[3] == d.shape[3]
            and x.shape[2] <= d.shape[2]
        ):
            self.length = int(x.shape[2])
            return
        self.data, self.length, self.owned = x, (0 if x is None or x.dim() < 3 else int(x.shape[-2])), False

    def append(self, x: Tensor) -> Tensor:
        """Write x (B, kvh, t, hd) after the used length; a new buffer when there is no room or it is not owned."""
        n, t = self.length, int(x.shape[-2])
        self.make_room(x, t)
        self.data[:, :, n : n + t] = x
        self.length = n + t
        return self.data[:, :, : n + t]

    def make_room(self, x: Tensor, t: int) -> None:
        """An owned buffer shaped as x (B, kvh, ·, hd), of x's dtype and device, with room for t tokens after the
        used length (a new one, the used tokens copied, when there is none)."""
        n = self.length
        d = self.data
        fits = (
            d is not None
            and self.owned
            and n + t <= d.shape[2]
            and d.shape[:2] == x.shape[:2]
            and d.shape[3] == x.shape[3]
            and d.dtype == x.dtype
            and d.device == x.device
        )
        if not fits:
            room = max(MIN_ROOM, (n + t) // 2)
            new = x.new_empty(x.shape[0], x.shape[1], n + t + room, x.shape[3])  # (B, kvh, capacity, hd)
            if n:
                new[:, :, :n] = d[:, :, :n]
            self.data, self.owned = new, True


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose `keys` / `values` are prefix views of buffers with room to grow (module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        self._k = _Buffer(None, 0, False)
        self._v = _Buffer(None, 0, False)
        super().__init__(**kwargs)

    @property
    def keys(self) -> Tensor | None:  # (B, kv_heads, T, hd)
        return self._k.view()

    @keys.setter
    def keys(self, x: Tensor | None) -> None:
        _separate(self)
        self._k.assign(x)

    @property
    def values(self) -> Tensor | None:  # (B, kv_heads, T, hd)
        return self._v.view()

    @values.setter
    def values(self, x: Tensor | None) -> None:
        _separate(self)
        self._v.assign(x)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device = key_states.device
        self._k, self._v = _Buffer(None, 0, False), _Buffer(None, 0, False)
        self._owner = self
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Append this step's K/V (B, kv_heads, t, hd) and return all of them (B, kv_heads, T + t, hd)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        _separate(self)
        return self._k.append(key_states), self._v.append(value_states)

    def reserve(self, like: Tensor, t: int) -> tuple[Tensor, Tensor, int]:
        """Room for t more tokens, for a caller that writes them itself (target/native_layers.py): (K buffer, V
        buffer, tokens held), the buffers owned and shaped as `like` (B, kv_heads, ·, hd) with capacity ≥ held + t;
        the caller fills positions held … held + t − 1 of both, then calls `advance(t)`."""
        if not self.is_initialized:
            self.lazy_initialization(like, like)
        _separate(self)
        self._k.make_room(like, t)
        self._v.make_room(like, t)
        return self._k.data, self._v.data, self._k.length

    def advance(self, t: int) -> None:
        """The t tokens written after `reserve` are now part of the cache."""
        self._k.length += t
        self._v.length += t

    def get_seq_length(self) -> int:
        return self._k.length if self.is_initialized and self._k.data is not None else 0


def _separate(layer: GrowingLayer) -> None:
    """A layer copied with `copy.copy` shares its original's buffer records: before its first change the copy gets
    records of its own, not owned, so nothing it does writes into the original's memory (a deep copy owns its
    copied buffers: `_owner` is copied along with them)."""
    if getattr(layer, "_owner", None) is layer:
        return
    layer._owner = layer
    layer._k = _Buffer(layer._k.data, layer._k.length, False)
    layer._v = _Buffer(layer._v.data, layer._v.length, False)


def growing_cache(config: Any) -> DynamicCache:
    """A `DynamicCache` for `config` whose plain (full-attention) layers are `GrowingLayer`s."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def in_place_compact(layer: Any, base: int, rows: Tensor) -> bool:
    """Keep tokens [0, base) plus `rows` (tree indices counted from `base`) of a `GrowingLayer` by moving them inside
    its own buffers; False (nothing done) for any other layer or a buffer it does not own."""
    if not isinstance(layer, GrowingLayer) or getattr(layer, "_owner", None) is not layer:
        return False
    if not (layer._k.owned and layer._v.owned):
        return False
    idx = (base + rows).to(layer._k.data.device)  # (R,)
    n = base + int(rows.numel())
    for buf in (layer._k, layer._v):
        buf.data[:, :, base:n] = buf.data.index_select(2, idx)  # the right side is a copy: overlap is safe
        buf.length = n
    return True


__all__ = ["MIN_ROOM", "GrowingLayer", "growing_cache", "in_place_compact"]
