"""The DFlash drafter network (z-lab `DFlashDraftModel` compatible) — the network only, no I/O.

    context feature  = hidden_norm(fc(concat of K target layers))          computed once per forward
    layers.N         = Qwen3-style decoder layer whose keys/values are concat(context K/V, block K/V),
                       context first; k_norm over both; RoPE over [context positions | block positions];
                       queries come from the block only; the context never passes a layer's MLP or input norm
    norm             = final RMSNorm; logits come from the target's frozen LM head

Inference (`DrafterCache`): each forward appends the *new* context K/V to the cache and reads the block; block
K/V are never cached. Training: many blocks at once with `cache=None` and an explicit attention mask over
[context keys | block keys] (built by the training code). Decoding policy (block size, tree budget) is always
an argument of the caller, never state here.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflashkit.cpu_products import linear_product
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads import head_of
from dflashkit.drafter.qwen3_blocks import DefaultRope, GatedMLP, RMSNorm, rotate_half
from dflashkit.drafter.tiled_attention import TiledMask, tiled_attention

# A mask is one tensor (bool or additive) or flex-attention BlockMask for every layer, or one per layer type
# ("full_attention" / "sliding_attention").
AttentionMask = Any


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (B, heads, T, hd); cos/sin: (B, T, hd)
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def to_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean (True = may attend) → additive float mask. Float masks pass through (cast to `dtype`).

    Always converting explicitly means no attention path can silently misread a boolean mask.
    """
    if mask.dtype == torch.bool:
        out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return out.masked_fill(~mask, torch.finfo(dtype).min)
    return mask.to(dtype)


def positional_mask(q_pos: Tensor, k_pos: Tensor, *, causal: bool, window: int | None) -> Tensor | None:
    """Inference mask by position: causal → key pos ≤ query pos; window → |query − key| < window.

    q_pos: (B, Tq), k_pos: (B, Tk) → bool (B, 1, Tq, Tk), or None when everything is visible.
    """
    if not causal and window is None:
        return None
    diff = q_pos[:, :, None] - k_pos[:, None, :]  # (B, Tq, Tk)
    visible = torch.ones_like(diff, dtype=torch.bool)
    if causal:
        visible &= diff >= 0
    if window is not None:
        visible &= diff < window
        if not causal:
            visible &= -diff < window
    return visible[:, None]


_FLEX: Any = None


def _flex_attention() -> Any:
    """flex_attention, compiled once on CUDA (eager flex is a slow reference path there)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=True) if torch.cuda.is_available() else flex_attention
    return _FLEX


@dataclass
class DrafterCache:
    """Context-only K/V per layer (after k_norm and RoPE) plus the context positions they were rotated at."""

    keys: list[Tensor | None] = field(default_factory=list)  # each (B, kv_heads, Tc, hd)
    values: list[Tensor | None] = field(default_factory=list)  # each (B, kv_heads, Tc, hd)
    positions: Tensor | None = None  # (B, Tc)

    @property
    def length(self) -> int:
        return 0 if self.positions is None else int(self.positions.shape[1])

    def crop(self, length: int) -> None:
        """Keep the first `length` context entries."""
        if length > self.length or length < 0:
            raise ValueError(f"cannot crop a drafter cache of length {self.length} to {length}")
        self.keys = [k[:, :, :length] if k is not None else None for k in self.keys]
        self.values = [v[:, :, :length] if v is not None else None for v in self.values]
        self.positions = self.positions[:, :length] if self.positions is not None else None


class DFlashAttention(nn.Module):
    """Block queries over [context K/V | block K/V]; names match z-lab's checkpoint keys."""

    def __init__(self, cfg: DrafterConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.causal = cfg.layer_is_causal(layer_idx)
        self.window = cfg.layer_window(layer_idx)
        self.layer_type = cfg.layer_types[layer_idx]
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def _kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _rope(k, cos, sin), v  # (B, kvh, T, hd) each

    def forward(
        self,
        block: Tensor,
        context: Tensor,
        *,
        block_rope: tuple[Tensor, Tensor],
        context_rope: tuple[Tensor, Tensor],
        mask: Tensor | None,
        cache: DrafterCache | None,
    ) -> Tensor:
        # block: (B, Tq, H) after input_layernorm; context: (B, Tc, H) fused context feature (new context only)
        b, tq, _ = block.shape
        q = self.q_norm(self.q_proj(block).view(b, tq, self.num_heads, self.head_dim)).transpose(1, 2)
        q = _rope(q, *block_rope)  # (B, nh, Tq, hd)
        k_ctx, v_ctx = self._kv(context, *context_rope)  # (B, kvh, Tc, hd)
        if cache is not None:
            if len(cache.keys) <= self.layer_idx:
                cache.keys.append(None)
                cache.values.append(None)
            old_k, old_v = cache.keys[self.layer_idx], cache.values[self.layer_idx]
            if old_k is not None:
                k_ctx = torch.cat([old_k, k_ctx], dim=2)
                v_ctx = torch.cat([old_v, v_ctx], dim=2)
            cache.keys[self.layer_idx], cache.values[self.layer_idx] = k_ctx, v_ctx
        k_blk, v_blk = self._kv(block, *block_rope)  # (B, kvh, Tq, hd)
        k = torch.cat([k_ctx, k_blk], dim=2)  # (B, kvh, Tc_all + Tq, hd)
        v = torch.cat([v_ctx, v_blk], dim=2)
        scale, gqa = self.head_dim**-0.5, self.num_heads != self.num_kv_heads
        if isinstance(mask, TiledMask):  # a training mask on CPU: only the keys each query tile can see
            out = tiled_attention(q, k, v, mask, scale=scale, enable_gqa=gqa)
        elif mask is not None and not isinstance(mask, Tensor):  # a flex-attention BlockMask (CUDA training)
            out = _flex_attention()(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None if mask is None else to_additive(mask, q.dtype),
                scale=scale,
                enable_gqa=gqa,
            )
        return self.o_proj(out.transpose(1, 2).reshape(b, tq, self.num_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(cfg, layer_idx)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        # a head may wrap each sublayer (DFlash2's convolutions): `around(sublayer, x, block_len)`, within blocks
        self.attention_conv: nn.Module | None = None
        self.mlp_conv: nn.Module | None = None

    def forward(self, hidden: Tensor, context: Tensor, block_len: int, **attn_kwargs) -> Tensor:
        attn = lambda x: self.self_attn(x, context, **attn_kwargs)  # noqa: E731
        hidden = hidden + _wrapped(self.attention_conv, attn, self.input_layernorm(hidden), block_len)
        return hidden + _wrapped(self.mlp_conv, self.mlp, self.post_attention_layernorm(hidden), block_len)


def _wrapped(wrapper: nn.Module | None, sublayer: Any, x: Tensor, block_len: int) -> Tensor:
    return sublayer(x) if wrapper is None else wrapper.around(sublayer, x, block_len)


class DFlashDrafter(nn.Module):
    """The drafter. Holds no embedding table and no LM head: those are the target's, passed in frozen."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(config.num_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = DefaultRope(config.head_dim or h // config.num_attention_heads, config.rope_theta)
        if config.learned_mask_embedding:
            # Trained vector for block slots 1..bs-1 (targets without a spare embedding row, e.g. SmolLM2).
            self.mask_embedding = nn.Parameter(torch.empty(h))
        if config.draft_vocab_size is not None:
            # Reduced draft vocabulary: draft id i ↔ target id draft_to_target[i]. A buffer so it is saved.
            self.register_buffer("draft_to_target", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        head_of(config).add_modules(self)  # the head's own parameters (DSpark: Markov and confidence heads)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        if self.config.learned_mask_embedding:
            nn.init.normal_(self.mask_embedding, std=std)
        head_of(self.config).reset(self, std)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    # ------------------------------------------------------------------ inputs and outputs
    def block_embeddings(self, first_tokens: Tensor, embed_weight: Tensor, block_len: int) -> Tensor:
        """Blocks [token, MASK × (block_len−1)] embedded with the target's table.

        first_tokens: (B, Nb) → (B, Nb·block_len, H). Slot 0 of each block is the clean token's embedding; the
        other slots are the mask token's row, or the learned mask embedding when the target has no spare row.
        """
        b, nb = first_tokens.shape
        first = F.embedding(first_tokens.to(embed_weight.device), embed_weight).to(self.device, self.dtype)
        if self.config.learned_mask_embedding:
            mask_vec = self.mask_embedding.to(first.dtype)
        else:
            mask_vec = embed_weight[self.config.mask_token_id].to(self.device, self.dtype)
        out = mask_vec.expand(b, nb, block_len, -1).clone()  # (B, Nb, bl, H)
        out[:, :, 0] = first
        out = self.head.scale_embeddings(self.config, out)
        return out.reshape(b, nb * block_len, -1)

    def logits(self, hidden: Tensor, lm_head_weight: Tensor) -> Tensor:
        """Draft logits from the target's LM head: (…, H) → (…, V), or (…, draft_vocab) with a reduced vocab."""
        weight = lm_head_weight
        if self.config.draft_vocab_size is not None:
            weight = self.reduced_head_weight(lm_head_weight)  # (V', H)
        weight = weight.to(hidden.device) if weight.device != hidden.device else weight
        out = linear_product(hidden.to(weight.dtype), weight)  # a round's few rows: the measured product
        return self.head.unary_logits(self.config, out)

    def reduced_head_weight(self, lm_head_weight: Tensor) -> Tensor:
        """The target's LM head rows of the draft vocabulary (V', H): gathered once per head tensor (and its in-place
        version) and map, then reused every round — in eval and train mode alike (gathering the rows is a copy of
        megabytes, a large part of a draft, and a drafter used without `.eval()` would pay it every round). Gathered
        afresh only when gradients must reach the head through it."""
        rows = self.draft_to_target.to(lm_head_weight.device)
        if lm_head_weight.requires_grad and torch.is_grad_enabled():
            return lm_head_weight.index_select(0, rows)
        cached = getattr(self, "_reduced_head", None)
        key = (lm_head_weight._version, self.draft_to_target._version, lm_head_weight.device)
        if cached is None or cached[0]() is not lm_head_weight or cached[1] != key:
            with torch.inference_mode(False), torch.no_grad():  # a normal tensor: usable in and out of inference mode
                reduced = lm_head_weight.detach().index_select(0, rows)
            cached = (weakref.ref(lm_head_weight), key, reduced)  # a weak reference: the target's head is not kept
            self._reduced_head = cached
        return cached[2]

    @property
    def head(self) -> Any:
        """The drafter's head (`dflashkit.drafter.heads`): what the stages ask about its kind."""
        return head_of(self.config)

    def first_draft_slot(self) -> int:
        """The block slot of the first draft: 0 when every slot drafts (DSpark), 1 when slot 0 holds the given
        token (DFlash)."""
        return self.head.first_draft_slot

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Map draft-vocabulary ids back to target ids (identity without a reduced vocabulary)."""
        if self.config.draft_vocab_size is None:
            return draft_ids
        return self.draft_to_target.to(draft_ids.device)[draft_ids]

    # ------------------------------------------------------------------ forward
    def fuse_context(self, features: Tensor) -> Tensor:
        """(B, Tc, K·H) concatenated target features → (B, Tc, H) context feature."""
        expected = self.fc.in_features
        if features.shape[-1] != expected:
            raise ValueError(
                f"context features have width {features.shape[-1]}; the drafter's fc reads "
                f"{self.config.num_features} target layers × hidden {self.config.hidden_size} = {expected}"
            )
        return self.hidden_norm(self.fc(features.to(self.device, self.dtype)))

    def forward(
        self,
        context_features: Tensor,
        block_embeds: Tensor,
        *,
        context_positions: Tensor,
        block_positions: Tensor,
        cache: DrafterCache | None = None,
        attention_mask: AttentionMask = None,
        block_len: int | None = None,
    ) -> Tensor:
        """One drafter pass; returns the final-normed block hidden states (B, Tq, H).

        context_features: (B, Tc, K·H) — the *new* context (with a cache) or the whole context (training).
        block_embeds:     (B, Tq, H) from `block_embeddings`.
        context_positions (B, Tc), block_positions (B, Tq): absolute positions for RoPE.
        attention_mask: over [all context keys | block keys], (B or 1, 1, Tq, Tc_all + Tq), bool (True = visible)
            or additive; or a dict by layer type. None → derived from positions (inference: full layers see
            everything, sliding layers are causal within their window).
        block_len: slots per block when Tq holds several blocks side by side (training); None: one block.
        """
        device = self.device
        context_positions = context_positions.to(device)
        block_positions = block_positions.to(device)
        ctx = self.fuse_context(context_features)  # (B, Tc, H)
        hidden = block_embeds.to(device, self.dtype)  # (B, Tq, H)
        ctx_rope = self.rotary_emb(hidden, context_positions)  # cos/sin (B, Tc, hd)
        blk_rope = self.rotary_emb(hidden, block_positions)  # cos/sin (B, Tq, hd)
        key_positions = context_positions
        if cache is not None:
            if cache.positions is not None:
                key_positions = torch.cat([cache.positions, context_positions], dim=1)
            cache.positions = key_positions
        key_positions = torch.cat([key_positions, block_positions], dim=1)  # (B, Tc_all + Tq)
        for layer in self.layers:
            attn = layer.self_attn
            if isinstance(attention_mask, dict):
                mask = attention_mask[attn.layer_type]
            elif attention_mask is not None:
                mask = attention_mask
            else:
                mask = positional_mask(block_positions, key_positions, causal=attn.causal, window=attn.window)
            hidden = layer(
                hidden,
                ctx,
                block_len or hidden.shape[1],
                block_rope=blk_rope,
                context_rope=ctx_rope,
                mask=mask,
                cache=cache,
            )
        return self.norm(hidden)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
