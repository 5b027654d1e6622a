"""Warm start: initialise a DFlash drafter from the target's own top decoder layers instead of random weights.

    from dflashkit.drafter.warm_start import warm_start, warm_start_overrides
    overrides = warm_start_overrides(target, {"num_hidden_layers": 2})   # + the target's layer geometry
    drafter = DFlashDrafter(default_drafter_config(target, **overrides))
    report = warm_start(drafter, target)                                 # also stored in config.extra["warm_start"]

    dflashkit init-drafter OUT --target T --warm-start [--warm-start-layers 28,29] [--warm-start-fc last|mean|random]

It is an option, not the default: the drafter's geometry is normally its own
(docs/troubleshooting.md#pitfall-geometry), and a warm-started drafter has to take the target's (heads, kv heads,
head_dim, MLP width, norm ε, RoPE θ, attention bias) so that the tensors can be copied. Whether it buys more accepted
drafts per training minute is measured (docs/studies.md).

What is copied, drafter layer i ← target decoder layer `source_layers[i]`:
- `self_attn.{q,k,v,o}_proj` (biases too: Qwen2 has q/k/v biases and none on o, which is set to zero),
  `mlp.{gate,up,down}_proj`, `input_layernorm`, `post_attention_layernorm`; the final `norm` ← the target's.
- `self_attn.{q,k}_norm`: copied from Qwen3-style targets; set to ones for targets without them (Llama, Qwen2).
  Ones is not the identity: a per-head RMSNorm scales every query and key to RMS 1, so the attention logit
  q·k/√d becomes cos(q, k)·√d — the target's preferences keep their order but not their sharpness (training
  adapts the norm gains).
- Default `source_layers`: the layers right after the deepest captured layer, max(target_layer_ids) + 1 …,
  moved down so they end at the top of the target (SmolLM2, ids [1, 8, 14, 20, 27], 2 drafter layers: [28, 29];
  5 drafter layers: [25 … 29]). These are the layers that read the residual stream the drafter is given.
- `fc`: "last" passes the deepest captured layer's feature through (identity block for it, zeros for the other
  K−1 layers); "mean" averages the K features (1/K identity blocks); "random" keeps the random init.
- `hidden_norm` ← the target's `input_layernorm` of the first source layer (fc "last" / "mean"; ones for
  "random"). With fc "last" and the default layers, hidden_norm(fc(features)) is then exactly what that layer's
  k/v projections read in the target, so drafter layer 0's context keys/values equal the target layer's own K/V
  at the same positions (the values on every target; the keys too on Qwen3, whose k_norm is copied).
- Untouched: the learned mask embedding (if any) and the reduced draft vocabulary map.

Refused with a ConfigError (nothing can be copied faithfully): linear-attention (hybrid) layers at the chosen
indices, gated attention (a q_proj with 2× outputs, Qwen3.5/3.6), fused or missing q/k/v/o or gate/up/down
projections, MoE MLPs, MLP biases, activations other than SiLU, norms that are not weight·x/rms(x) (zero-centred
1 + w norms), an attention scale other than head_dim^-0.5, and a drafter whose geometry is not the target's.
Reported as notes, not refused: RoPE scaling types other than "default", partial rotary, sliding-window layers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from dflashkit.errors import ConfigError

FC_MODES = ("last", "mean", "random")
REPORT_KEY = "warm_start"
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


# ---------------------------------------------------------------------------------------------- layer choice
def default_source_layers(target_layer_ids: list[int], num_hidden_layers: int, num_target_layers: int) -> list[int]:
    """max(target_layer_ids) + 1 … (num_hidden_layers of them), moved down to end at the top of the target."""
    if num_hidden_layers > num_target_layers:
        raise ConfigError(
            f"warm start: the drafter has {num_hidden_layers} layers but the target only "
            f"{num_target_layers}; give fewer drafter layers"
        )
    start = min(max(int(i) for i in target_layer_ids) + 1, num_target_layers - num_hidden_layers)
    return list(range(start, start + num_hidden_layers))


def _check_layers(layers: list[int], target: Any, n: int | None = None) -> list[int]:
    layers = [int(i) for i in layers]
    if n is not None and len(layers) != n:
        raise ConfigError(
            f"warm start: {len(layers)} source layers {layers} for a drafter with {n} layers; give "
            f"one target layer per drafter layer"
        )
    bad = [i for i in layers if not 0 <= i < target.num_layers]
    if not layers or bad:
        raise ConfigError(
            f"warm start: source layers {bad or layers} out of range: the target has "
            f"{target.num_layers} decoder layers (0 ≤ id < {target.num_layers})"
        )
    return layers


# ---------------------------------------------------------------------------------------------- checks
def _rms_form_ok(norm: nn.Module, size: int, eps: float) -> bool:
    """Whether `norm(x)` is weight·x/rms(x) (Llama / Qwen RMSNorm), tested on a fixed random input."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, Tensor) or tuple(weight.shape) != (size,):
        return False
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, size, generator=gen) * 3.0).to(weight.device, weight.dtype)
    with torch.no_grad():
        got = norm(x).float()
        xf = x.float()
        want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(weight.dtype).float() * weight.float()
    tol = 1e-4 if weight.dtype == torch.float32 else 3e-2
    return bool(torch.allclose(got, want, rtol=tol, atol=tol))


def _norm_eps(norm: nn.Module, default: float) -> float:
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return default


def _rope_theta(tc: Any) -> tuple[float | None, str]:
    """(rope θ, rope type) from a transformers 5.x `rope_parameters` (possibly per layer type) or 4.x fields."""
    rp = getattr(tc, "rope_parameters", None) or {}
    if isinstance(rp, dict) and "rope_theta" not in rp and isinstance(rp.get("full_attention"), dict):
        rp = rp["full_attention"]
    theta = rp.get("rope_theta") if isinstance(rp, dict) else None
    theta = theta if theta is not None else getattr(tc, "rope_theta", None)
    rtype = (rp.get("rope_type") if isinstance(rp, dict) else None) or "default"
    return (float(theta) if theta is not None else None), str(rtype)


def _layer_parts(target: Any, idx: int) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(layer, self_attn, mlp) of target layer `idx`, or a ConfigError saying why it cannot be copied."""
    where = f"warm start: target layer {idx} ({target.architecture})"
    kind = target.layer_types[idx] if idx < len(target.layer_types) else "full_attention"
    layer = target.layers[idx]
    if kind == "linear_attention" or hasattr(layer, "linear_attn"):
        raise ConfigError(
            f"{where} is a linear-attention (GatedDeltaNet) layer; only softmax-attention layers can "
            f"be copied into a drafter — choose full-attention layers with --warm-start-layers"
        )
    attn = getattr(layer, "self_attn", None)
    if attn is None:
        raise ConfigError(f"{where} has no self_attn module; cannot find its attention projections")
    missing = [n for n in _ATTN if not isinstance(getattr(attn, n, None), nn.Linear)]
    if missing:
        fused = [n for n in ("qkv_proj", "Wqkv", "c_attn") if hasattr(attn, n)]
        raise ConfigError(
            f"{where}: no {'/'.join(missing)} projections found in its attention"
            + (f" (it has a fused {fused[0]}, which is not supported)" if fused else "")
        )
    mlp = getattr(layer, "mlp", None)
    if mlp is None:
        raise ConfigError(f"{where} has no mlp module; cannot find its gate/up/down projections")
    if hasattr(mlp, "experts") or hasattr(mlp, "router"):
        raise ConfigError(f"{where} has a mixture-of-experts MLP; the drafter's dense SiLU MLP cannot hold it")
    missing = [n for n in _MLP if not isinstance(getattr(mlp, n, None), nn.Linear)]
    if missing:
        raise ConfigError(
            f"{where}: no {'/'.join(missing)} projections found in its MLP"
            + (" (a fused gate_up_proj is not supported)" if hasattr(mlp, "gate_up_proj") else "")
        )
    for name in ("input_layernorm", "post_attention_layernorm"):
        if not isinstance(getattr(layer, name, None), nn.Module):
            raise ConfigError(f"{where} has no {name}; only pre-norm decoder layers (Llama / Qwen) can be copied")
    return layer, attn, mlp


def target_geometry(target: Any, *, source_layers: list[int] | None = None) -> dict[str, Any]:
    """The DrafterConfig overrides that give the drafter the geometry of the target's decoder layers.

    `source_layers` (default: the top layer) are checked module by module; anything that cannot be copied
    faithfully raises a ConfigError naming the layer and the reason (module docstring).
    """
    tc = target.text_config
    layers = _check_layers(source_layers if source_layers is not None else [target.num_layers - 1], target)
    act = str(getattr(tc, "hidden_act", getattr(tc, "hidden_activation", "silu")) or "silu").lower()
    if act not in ("silu", "swish"):
        raise ConfigError(
            f"warm start: the target's MLP activation is {act!r}; the drafter's MLP is SiLU, so "
            f"its layers cannot be copied"
        )
    if getattr(tc, "mlp_bias", False):
        raise ConfigError(
            "warm start: the target's MLP projections have biases (mlp_bias); the drafter's MLP has "
            "none, so its layers cannot be copied"
        )
    heads = int(tc.num_attention_heads)
    kv_heads = int(getattr(tc, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(tc, "head_dim", None) or target.hidden_size // heads)
    eps_cfg = float(getattr(tc, "rms_norm_eps", 1e-6))
    hidden = target.hidden_size
    geometry: dict[str, Any] = {}
    for idx in layers:
        layer, attn, mlp = _layer_parts(target, idx)
        where = f"warm start: target layer {idx} ({target.architecture})"
        q, k, v, o = (getattr(attn, n) for n in _ATTN)
        if q.out_features == 2 * heads * head_dim:
            raise ConfigError(
                f"{where} has gated attention (q_proj gives {q.out_features} = 2 × {heads} heads × "
                f"{head_dim}: queries and an output gate); the drafter's attention has no gate"
            )
        shapes = {
            "q_proj": (q.out_features, heads * head_dim),
            "k_proj": (k.out_features, kv_heads * head_dim),
            "v_proj": (v.out_features, kv_heads * head_dim),
            "o_proj": (o.in_features, heads * head_dim),
        }
        wrong = {n: s for n, s in shapes.items() if s[0] != s[1]}
        if wrong or o.out_features != hidden or q.in_features != hidden:
            raise ConfigError(
                f"{where}: projection sizes {wrong or 'of o_proj/q_proj'} do not match {heads} heads × "
                f"{head_dim} with {kv_heads} kv heads and hidden {hidden}"
            )
        scaling = getattr(attn, "scaling", None)
        if isinstance(scaling, float) and not math.isclose(scaling, head_dim**-0.5, rel_tol=1e-6):
            raise ConfigError(
                f"{where} scales attention logits by {scaling:g}; the drafter uses head_dim^-0.5 = {head_dim**-0.5:g}"
            )
        gate, up, down = (getattr(mlp, n) for n in _MLP)
        if any(p.bias is not None for p in (gate, up, down)):
            raise ConfigError(f"{where}: the MLP projections have biases; the drafter's MLP has none")
        inter = gate.out_features
        if (up.out_features, down.in_features, down.out_features) != (inter, inter, hidden):
            raise ConfigError(
                f"{where}: MLP sizes gate {tuple(gate.weight.shape)}, up {tuple(up.weight.shape)}, "
                f"down {tuple(down.weight.shape)} are not a gated MLP of width {inter}"
            )
        act_fn = getattr(mlp, "act_fn", None)
        if act_fn is not None:
            x = torch.linspace(-4, 4, 9, device=gate.weight.device, dtype=gate.weight.dtype)
            if not torch.allclose(act_fn(x).float(), torch.nn.functional.silu(x).float(), atol=1e-2):
                raise ConfigError(f"{where}: the MLP activation {type(act_fn).__name__} is not SiLU")
        eps = _norm_eps(layer.input_layernorm, eps_cfg)
        norms = [
            ("input_layernorm", layer.input_layernorm, hidden),
            ("post_attention_layernorm", layer.post_attention_layernorm, hidden),
        ]
        norms += [(n, getattr(attn, n), head_dim) for n in ("q_norm", "k_norm") if getattr(attn, n, None) is not None]
        for name, norm, size in norms:
            if not _rms_form_ok(norm, size, _norm_eps(norm, eps)):
                raise ConfigError(
                    f"{where}: {name} ({type(norm).__name__}) is not an RMSNorm of the form "
                    f"weight·x/rms(x) over {size} (e.g. a zero-centred 1 + weight norm); it cannot "
                    f"be copied"
                )
        layer_geo = {
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "intermediate_size": inter,
            "rms_norm_eps": eps,
            "attention_bias": any(getattr(attn, n).bias is not None for n in _ATTN),
        }
        if geometry and layer_geo != geometry:
            raise ConfigError(
                f"warm start: target layers {layers} differ in geometry ({geometry} vs layer {idx}: "
                f"{layer_geo}); a drafter's layers share one geometry"
            )
        geometry = layer_geo
    if not _rms_form_ok(target.final_norm, hidden, _norm_eps(target.final_norm, eps_cfg)):
        raise ConfigError(
            f"warm start: the target's final norm ({type(target.final_norm).__name__}) is not an "
            f"RMSNorm of the form weight·x/rms(x); it cannot be copied"
        )
    theta, _ = _rope_theta(tc)
    if theta is not None:
        geometry["rope_theta"] = theta
    return geometry


def warm_start_overrides(
    target: Any, overrides: dict[str, Any] | None = None, *, source_layers: list[int] | None = None
) -> dict[str, Any]:
    """`overrides` plus `target_geometry(target)` for the layers a warm start will copy (for default_drafter_config).

    An override that contradicts the target's geometry (e.g. num_attention_heads=8) raises: it cannot be copied.
    """
    from dflashkit.drafter.defaults import default_drafter_config

    overrides = dict(overrides or {})
    base = default_drafter_config(target, **overrides)  # ids and layer count do not depend on the geometry
    layers = (
        source_layers
        if source_layers is not None
        else default_source_layers(base.target_layer_ids, base.num_hidden_layers, target.num_layers)
    )
    geometry = target_geometry(target, source_layers=_check_layers(layers, target, base.num_hidden_layers))
    clash = {k: (overrides[k], v) for k, v in geometry.items() if k in overrides and overrides[k] != v}
    if clash:
        raise ConfigError(
            "warm start copies the target's layers, so these drafter fields must be the target's: "
            + ", ".join(f"{k}={a!r} given, the target has {b!r}" for k, (a, b) in clash.items())
        )
    return {**overrides, **geometry}


# ---------------------------------------------------------------------------------------------- the copy
@torch.no_grad()
def _copy(dst: Tensor, src: Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ConfigError(
            f"warm start: {name} has shape {list(dst.shape)} in the drafter but {list(src.shape)} in the target"
        )
    dst.copy_(src.detach().to(dst.device, dst.dtype))


@torch.no_grad()
def warm_start(
    drafter: Any, target: Any, *, source_layers: list[int] | None = None, fc: str = "last"
) -> dict[str, Any]:
    """Copy target decoder layers into `drafter` in place (module docstring); returns what was done.

    The report is also stored as `drafter.config.extra["warm_start"]`, so a saved checkpoint records it.
    """
    if fc not in FC_MODES:
        raise ConfigError(f"warm start: fc={fc!r}; expected one of {list(FC_MODES)}")
    cfg = drafter.config
    if cfg.hidden_size != target.hidden_size or cfg.num_target_layers != target.num_layers:
        raise ConfigError(
            f"warm start: the drafter was built for hidden {cfg.hidden_size} / {cfg.num_target_layers} "
            f"layers, the target has {target.hidden_size} / {target.num_layers}"
        )
    layers = (
        source_layers
        if source_layers is not None
        else default_source_layers(cfg.target_layer_ids, cfg.num_hidden_layers, target.num_layers)
    )
    layers = _check_layers(layers, target, cfg.num_hidden_layers)
    _check_geometry(cfg, target_geometry(target, source_layers=layers))
    qk_copied = [_copy_layer(target.layers[idx], drafter.layers[i], i) for i, idx in enumerate(layers)]
    _copy(drafter.norm.weight, target.final_norm.weight, "norm.weight")
    ids = list(cfg.target_layer_ids)
    slot = ids.index(max(ids))  # the deepest captured layer (the last one in ascending order)
    _init_fc(drafter, target, fc, slot, layers[0])
    report: dict[str, Any] = {
        "source_layers": layers,
        "fc": fc,
        "target_architecture": target.architecture,
        "qk_norm": "copied" if all(qk_copied) else "ones",
        "hidden_norm": f"target layer {layers[0]} input_layernorm" if fc != "random" else "ones",
        "norm": "target final norm",
    }
    if fc == "last":
        report["fc_layer"] = ids[slot]
    notes = _notes(target, layers, ids, fc, all(qk_copied))
    if notes:
        report["notes"] = notes
    cfg.extra = {**cfg.extra, REPORT_KEY: report}
    return report


def _check_geometry(cfg: Any, geometry: dict[str, Any]) -> None:
    """The drafter must have been built with the target's layer geometry for its tensors to be copied."""
    mine = {k: getattr(cfg, k) for k in geometry}
    wrong = {
        k: (mine[k], v)
        for k, v in geometry.items()
        if not (math.isclose(mine[k], v, rel_tol=1e-6) if isinstance(v, float) else mine[k] == v)
    }
    if wrong:
        raise ConfigError(
            "warm start: the drafter's geometry does not match the target's layers ("
            + ", ".join(f"{k} {a!r} vs {b!r}" for k, (a, b) in wrong.items())
            + "); build it with warm_start_overrides(target, …) / target_geometry(target) "
            "(init-drafter --warm-start does)"
        )


@torch.no_grad()
def _copy_layer(src: nn.Module, dst: nn.Module, i: int) -> bool:
    """Target decoder layer `src` → drafter layer `i` (`dst`); returns whether q/k norms were copied (else ones)."""
    for name in _ATTN:
        s, d = getattr(src.self_attn, name), getattr(dst.self_attn, name)
        _copy(d.weight, s.weight, f"layers.{i}.self_attn.{name}.weight")
        if d.bias is not None:  # the drafter has biases on all four when the target has any (Qwen2: not on o)
            if s.bias is not None:
                _copy(d.bias, s.bias, f"layers.{i}.self_attn.{name}.bias")
            else:
                d.bias.zero_()
    for name in ("q_norm", "k_norm"):
        s = getattr(src.self_attn, name, None)
        if s is not None:
            _copy(getattr(dst.self_attn, name).weight, s.weight, f"layers.{i}.self_attn.{name}.weight")
        else:
            getattr(dst.self_attn, name).weight.fill_(1.0)
    for name in _MLP:
        _copy(getattr(dst.mlp, name).weight, getattr(src.mlp, name).weight, f"layers.{i}.mlp.{name}.weight")
    for name in ("input_layernorm", "post_attention_layernorm"):
        _copy(getattr(dst, name).weight, getattr(src, name).weight, f"layers.{i}.{name}.weight")
    return getattr(src.self_attn, "q_norm", None) is not None


@torch.no_grad()
def _init_fc(drafter: Any, target: Any, fc: str, slot: int, first_layer: int) -> None:
    """fc "last": pass feature `slot` through; "mean": average the K features; "random": keep the random init.
    hidden_norm takes the first source layer's input norm (ones for "random")."""
    if fc == "random":
        drafter.hidden_norm.weight.fill_(1.0)
        return
    h, k = drafter.config.hidden_size, drafter.config.num_features
    eye = torch.eye(h, device=drafter.fc.weight.device, dtype=drafter.fc.weight.dtype)
    w = drafter.fc.weight  # (H, K·H): output = Σ_j W[:, jH:(j+1)H] @ feature_j
    if fc == "last":
        w.zero_()
        w[:, slot * h : (slot + 1) * h] = eye
    else:
        w.copy_(torch.cat([eye / k] * k, dim=1))
    _copy(drafter.hidden_norm.weight, target.layers[first_layer].input_layernorm.weight, "hidden_norm.weight")


def _notes(target: Any, layers: list[int], ids: list[int], fc: str, qk_copied: bool) -> list[str]:
    """What the copy could not carry over exactly (reported, not refused)."""
    tc = target.text_config
    notes = []
    if not qk_copied:
        notes.append(
            "q_norm/k_norm set to ones (the target has none): per-head RMSNorm makes the attention logit "
            "cos(q, k)·√head_dim, unlike the target's q·k/√head_dim"
        )
    _, rtype = _rope_theta(tc)
    if rtype != "default":
        notes.append(f"the target's RoPE is {rtype!r}; the drafter uses default RoPE with the same θ")
    partial = getattr(tc, "partial_rotary_factor", None)
    if partial not in (None, 1, 1.0):
        notes.append(f"the target rotates {partial} of each head; the drafter rotates all of it")
    sliding = [i for i in layers if i < len(target.layer_types) and target.layer_types[i] == "sliding_attention"]
    if sliding:
        notes.append(f"target layers {sliding} are sliding-window; the drafter keeps its own layer types")
    if fc == "last" and layers[0] != max(ids) + 1:
        notes.append(
            f"hidden_norm is layer {layers[0]}'s input norm, but the fc passes layer {max(ids)}'s output "
            f"through (the layer that reads it is {max(ids) + 1})"
        )
    return notes


def describe(report: dict[str, Any] | None) -> str | None:
    """One line for `info` / `inspect`: 'target layers [28, 29] (LlamaForCausalLM), fc last (layer 27), …'."""
    if not isinstance(report, dict):
        return None
    fc = report.get("fc")
    through = report.get("fc_layer")
    fc_txt = f"fc {fc}" + (f" (passes layer {through} through)" if through is not None else "")
    return (
        f"from target layers {report.get('source_layers')} ({report.get('target_architecture')}), {fc_txt}, "
        f"q/k norms {report.get('qk_norm')}, hidden_norm {report.get('hidden_norm')}"
    )


__all__ = [
    "FC_MODES",
    "default_source_layers",
    "describe",
    "target_geometry",
    "warm_start",
    "warm_start_overrides",
]
