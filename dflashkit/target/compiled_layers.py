"""The target's decoder layers through `torch.compile`: the same `Target.forward` (a capture's forwards, an
evaluation's decoding) or HF `generate` (in-process regeneration), its layers' `forward` swapped for compiled ones
while the block lasts.

    with compiled_layers(target):
        out = target.forward(ids, layer_ids=ids_of_layers, logits=True)   # (B, T, K·H) features, (B, T, V) logits

Each layer's `forward` is compiled once per target (`dynamic=True`: lengths vary from pass to pass) and kept; the
layers of one architecture share their code, so without a cache the first compiles and the others reuse its graph.
Inside a compiled layer every product is `F.linear` (`stock_products`): the measured product choice is Python keyed
by the exact row count, which would make dynamo specialise each graph to one width and recompile at every new one,
and its C++ candidates cannot be traced; inductor chooses its own products. For the same reason a decoding pass in
the block never opens the C++ layers (`native_layers`): `Target.layers_compiled` says the block is on. A pass over a
KV cache indexes the cache by the layer's own index, which torch.compile holds constant, so each layer gets graphs of
its own: inside the block the recompile limit covers `GRAPHS_PER_LAYER` a layer (torch's default, 8 for all layers
together, would leave every layer past the eighth eager), and reaching it raises — a compiled pass that would
silently run eagerly fails instead, and the callers' choice runs it again eagerly and records why. Only `forward` is
swapped, so the hooks that capture a layer's output run around it as before; everything outside the layers
(embeddings, final norm, the LM head that forms the labels) runs eagerly. Whether a job runs through it is measured
(features.capture_compile, data.regenerate_compile, evaluate.decode_compile).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from dflashkit.cpu_products import stock_products

GRAPHS_PER_LAYER = 6  # a layer's graphs over a cache: an empty and a filled one, without and with a tree's mask, …


@contextmanager
def compiled_layers(target: Any) -> Iterator[None]:
    """Run `target`'s decoder layers compiled inside the block (compiled at their first call, then kept)."""
    layers = list(target.text_model.layers)
    compiled = getattr(target, "_compiled_layer_forwards", None)
    if compiled is None or len(compiled) != len(layers):
        compiled = [_with_stock_products(torch.compile(layer.forward, dynamic=True)) for layer in layers]
        target._compiled_layer_forwards = compiled
    before = [layer.__dict__.get("forward") for layer in layers]  # a forward some wrapper set on the instance
    for layer, forward in zip(layers, compiled, strict=True):
        layer.forward = forward  # an instance attribute: nn.Module.__call__ calls it, hooks still around it
    config = torch._dynamo.config
    limit = max(config.recompile_limit, GRAPHS_PER_LAYER * len(layers))
    was_on, target.layers_compiled = getattr(target, "layers_compiled", False), True
    try:
        with config.patch(
            recompile_limit=limit,
            accumulated_recompile_limit=max(config.accumulated_recompile_limit, 2 * limit),
            fail_on_recompile_limit_hit=True,
        ):
            yield
    finally:
        target.layers_compiled = was_on
        for layer, old in zip(layers, before, strict=True):
            if old is None:
                layer.__dict__.pop("forward", None)  # the class's own forward again
            else:
                layer.forward = old


def _with_stock_products(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` with every product inside it `F.linear` (see the module's docstring)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with stock_products():
            return forward(*args, **kwargs)

    return run


__all__ = ["GRAPHS_PER_LAYER", "compiled_layers"]
