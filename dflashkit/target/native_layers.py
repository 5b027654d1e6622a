"""A decoding pass of a Llama-family target through compiled whole layers: the `native_layers` candidate.

    plan = LayerPlan.of(target)                 # None where the layers are not of a kind the kernel computes
    if plan is not None and plan.takes(ids, mask, cache):
        captured, final_hidden = plan.run(ids, positions, mask, cache, wanted_layers)

A one-token step of a small target spends as long around its matrix products as in them: ~20 tensor operations a
layer (norms, rotary, the cache append, attention, residual adds), each a dispatch, an allocation and a pass over
memory (docs/cpu-performance.md). `kernels/decoder_layer.cpp` computes a whole layer in one call — the products with
native_rows' tiles, everything between them in the same parallel region — writing the new keys and values into the
cache's own buffers (`GrowingLayer.reserve`). It is one more candidate of the layers' pass group (products.py),
timed in real decoding steps against the others and taken only where it is faster; `Target.forward` opens the pass
(`open_pass`) and runs it here when the candidate is chosen, else through transformers' layers as before.

What it takes, checked once per target (`LayerPlan.of`): float32 CPU weights; every layer a Llama, Mistral, Qwen2 or
Qwen3 decoder layer of full attention (no sliding window), RMSNorm, SiLU-gated MLP, biases anywhere or none, Qwen3's
per-head q/k norms; the rotary factors come from the model's own rotary module, so its scaling variant is honoured.
What it takes per pass (`takes`): one sequence of 1 … MAX_ROWS new tokens, no mask or an additive float mask over
the cache and the new tokens (a tree's), and a cache of `GrowingLayer`s. Anything else runs transformers' layers.
The arithmetic is the operator-by-operator pass's in float32, summed in another order (tests/target/
test_native_layers.py holds it to a float64 reference as tightly as transformers' own pass).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dflashkit.cpu_products import native_rows
from dflashkit.cpu_products.products import MAX_ROWS
from dflashkit.target.kv_buffer import GrowingLayer

LAYER_CLASSES = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
NORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")  # w · x / sqrt(mean(x²) + eps)
MAX_HEAD_DIM = 1024  # the kernel's rotary scratch
_P = ctypes.c_void_p
_LONGS = "n hidden heads kv_heads head_dim inter past capacity"  # the C struct's fields, in its order
_FLOATS = "eps qk_eps scaling"
_WEIGHTS = "norm1 norm2 wq wk wv bq bk bv q_norm k_norm wo bo wg wu wd bg bu bd "
_PER_PASS = "cos sin mask k_cache v_cache x scratch"


class _Args(ctypes.Structure):
    """kernels/decoder_layer.cpp's `dfk_layer_args`, field for field."""

    _fields_ = [
        *((name, ctypes.c_long) for name in _LONGS.split()),
        *((name, ctypes.c_float) for name in _FLOATS.split()),
        *((name, _P) for name in (_WEIGHTS + _PER_PASS).split()),
        ("threads", ctypes.c_int),
    ]


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _why_not_layer(layer: nn.Module) -> str | None:
    """None when the kernel computes this layer exactly as transformers does, else why not."""
    name = type(layer).__name__
    if name not in LAYER_CLASSES:
        return f"{name} is not one of {', '.join(LAYER_CLASSES)}"
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
    norms += [getattr(attn, a) for a in ("q_norm", "k_norm") if getattr(attn, a, None) is not None]
    if any(type(m).__name__ not in NORM_CLASSES for m in norms):
        return "a norm of another kind than RMSNorm"
    linears = [getattr(attn, a, None) for a in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(mlp, a, None) for a in ("gate_proj", "up_proj", "down_proj")]
    if any(type(m) is not nn.Linear for m in linears):
        return "projections other than plain nn.Linear"
    if getattr(attn, "sliding_window", None) is not None:
        return "a sliding-window layer"
    act = getattr(mlp, "act_fn", None)
    if type(act).__name__ != "SiLUActivation" and not isinstance(act, nn.SiLU):
        return f"an MLP activation other than SiLU ({type(act).__name__})"
    head_dim = int(getattr(attn, "head_dim", 0))
    if not 0 < head_dim <= MAX_HEAD_DIM or head_dim % 2:
        return f"head size {head_dim}"
    tensors = [p for p in layer.parameters()]
    if any(p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_contiguous() for p in tensors):
        return "weights that are not contiguous float32 CPU tensors"
    return None


def _layer_args(layer: nn.Module) -> _Args:
    """The call's constant part for one layer: shapes and weight addresses."""
    attn, mlp = layer.self_attn, layer.mlp
    a = _Args()
    hd = int(attn.head_dim)
    a.hidden = attn.q_proj.in_features
    a.heads, a.kv_heads, a.head_dim = attn.q_proj.out_features // hd, attn.k_proj.out_features // hd, hd
    a.inter = mlp.gate_proj.out_features
    a.eps = float(layer.input_layernorm.variance_epsilon)
    a.scaling = float(attn.scaling)
    a.norm1, a.norm2 = _ptr(layer.input_layernorm.weight), _ptr(layer.post_attention_layernorm.weight)
    for field, lin in (("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj), ("o", attn.o_proj)):
        setattr(a, f"w{field}", _ptr(lin.weight))
        setattr(a, f"b{field}", _ptr(lin.bias))
    for field, lin in (("g", mlp.gate_proj), ("u", mlp.up_proj), ("d", mlp.down_proj)):
        setattr(a, f"w{field}", _ptr(lin.weight))
        setattr(a, f"b{field}", _ptr(lin.bias))
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if q_norm is not None and k_norm is not None:
        a.q_norm, a.k_norm, a.qk_eps = _ptr(q_norm.weight), _ptr(k_norm.weight), float(q_norm.variance_epsilon)
    return a


@dataclass
class LayerPlan:
    """A target's layers as the kernel computes them: one argument record per layer, its weights by address. Each
    pass first checks that every parameter is still where the records point (`_current`): a weight's storage can be
    swapped under the same Parameter (siblings.py stacks q/k/v into one tensor after a pass), and a stale address is
    freed memory."""

    text_model: nn.Module
    args: list[_Args]
    params: list[Tensor]
    addresses: tuple[int, ...]

    @staticmethod
    def why_not(text_model: nn.Module) -> str | None:
        """None when every layer of `text_model` can run compiled, else the first reason it cannot."""
        if not native_rows.enabled():
            return "no C++ compiler here (or DFLASHKIT_CHOICES=native=off)"
        if getattr(text_model, "rotary_emb", None) is None or getattr(text_model, "embed_tokens", None) is None:
            return "no rotary module or embeddings on the text model"
        for i, layer in enumerate(text_model.layers):
            reason = _why_not_layer(layer)
            if reason:
                return f"layer {i}: {reason}"
        return None

    @classmethod
    def of(cls, text_model: nn.Module) -> LayerPlan | None:
        """The plan for a text model whose layers the kernel computes, else None."""
        if cls.why_not(text_model) is not None:
            return None
        layers = list(text_model.layers)
        params = [p for m in layers for p in m.parameters()]
        return cls(text_model, [_layer_args(layer) for layer in layers], params, tuple(p.data_ptr() for p in params))

    def _current(self) -> None:
        """Re-read the weights' addresses when any parameter's storage moved since they were taken."""
        addresses = tuple(p.data_ptr() for p in self.params)
        if addresses != self.addresses:
            why = LayerPlan.why_not(self.text_model)
            if why is not None:  # a swap into another dtype or layout
                raise RuntimeError(f"the target's layers changed: {why}")
            self.args = [_layer_args(layer) for layer in self.text_model.layers]
            self.addresses = addresses

    def takes(self, input_ids: Tensor, attention_mask: Tensor | None, cache: Any) -> bool:
        """Whether this pass can run compiled: one sequence of a few new tokens on CPU, no mask or an additive float
        mask (1, 1, n, held + n), and a cache whose layers are all `GrowingLayer`s."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or not 1 <= input_ids.shape[1] <= MAX_ROWS:
            return False
        layers = getattr(cache, "layers", None)
        if not layers or len(layers) != len(self.args) or not all(type(c) is GrowingLayer for c in layers):
            return False
        if attention_mask is None:
            return True
        n = input_ids.shape[1]
        held = layers[0].get_seq_length()
        return (
            attention_mask.dim() == 4
            and tuple(attention_mask.shape) == (1, 1, n, held + n)
            and attention_mask.dtype == torch.float32
            and attention_mask.device.type == "cpu"
        )

    def run(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None,
        attention_mask: Tensor | None,
        cache: Any,
        wanted: set[int],
    ) -> tuple[dict[int, Tensor], Tensor]:
        """One pass over input_ids (1, n): ({layer index: its output (1, n, H)} for `wanted`, the last layer's
        output (1, n, H)); the cache holds the n new tokens afterwards."""
        layer_fn, scratch_fn = native_rows.layer_kernel()
        self._current()
        n = int(input_ids.shape[1])
        held = cache.layers[0].get_seq_length()
        if position_ids is None:
            position_ids = torch.arange(held, held + n)[None]  # (1, n)
        x = self.text_model.embed_tokens(input_ids).reshape(n, -1).contiguous()  # (n, H), the residual stream
        cos, sin = self.text_model.rotary_emb(x[None], position_ids)  # (1, n, hd) each
        cos, sin = cos[0].float().contiguous(), sin[0].float().contiguous()  # (n, hd)
        mask = None if attention_mask is None else attention_mask[0, 0].contiguous()  # (n, held + n)
        threads = torch.get_num_threads()
        first = self.args[0]
        first.n, first.past, first.threads = n, held, threads
        scratch = torch.empty(int(scratch_fn(ctypes.byref(first))), dtype=torch.float32)
        like = torch.empty(1, first.kv_heads, 0, first.head_dim)  # (B, kvh, ·, hd): the cache buffers' shape
        captured: dict[int, Tensor] = {}
        for i, (a, layer_cache) in enumerate(zip(self.args, cache.layers, strict=True)):
            k_buf, v_buf, past = layer_cache.reserve(like, n)  # (1, kvh, capacity, hd) each
            if past != held:  # the scratch's score rows are sized for `held` keys
                raise RuntimeError(f"the target cache's layers disagree on length: layer {i} holds {past}, not {held}")
            a.n, a.past, a.capacity, a.threads = n, past, k_buf.shape[2], threads
            a.cos, a.sin, a.mask = cos.data_ptr(), sin.data_ptr(), _ptr(mask)
            a.k_cache, a.v_cache, a.x, a.scratch = k_buf.data_ptr(), v_buf.data_ptr(), x.data_ptr(), scratch.data_ptr()
            layer_fn(ctypes.byref(a))
            layer_cache.advance(n)
            if i in wanted:
                captured[i] = x.clone()[None]  # (1, n, H)
        return captured, x[None]


__all__ = ["LAYER_CLASSES", "NORM_CLASSES", "LayerPlan"]
