"""Drafter configuration: the drafter's own geometry, its coupling to the target, and the z-lab config.json format.

`DrafterConfig` is a plain dataclass. It round-trips through z-lab's `config.json` (Qwen3 fields plus
`architectures: ["DFlashDraftModel"]`, `block_size`, `num_target_layers`, `layer_types`, `sliding_window` and
`dflash_config: {mask_token_id, target_layer_ids}`), reading `dflash_config` first, then top-level fields.
A DSpark drafter (`kind: dspark`: the same backbone + a Markov head and a confidence head) is written as DeepSpec
and llama.cpp read it: `architectures: ["Qwen3DSparkModel"]`, top-level `markov_rank`, `markov_head_type: vanilla`,
`enable_confidence_head`, `confidence_head_with_markov: true` and `sample_from_anchor: true` (every slot drafts).

Only `hidden_size` and `vocab_size` couple to the target; heads, kv heads, head_dim and intermediate size are the
drafter's own and are derived from the hidden size (`default_geometry`), never copied from the target's
attention config (a known bug: a drafter with the target's head_dim 256 / 24 heads).

Run `python -m dflashkit.drafter.config` to print the default drafter config for a few hidden sizes.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field

from dflashkit.drafter.config_fields import check_zlab_field_types
from dflashkit.drafter.heads import DRAFTER_SETTINGS, FLAT_DRAFTER_SETTINGS, KINDS, head_of, kind_fields, kind_of_config
from dflashkit.errors import ConfigError
from dflashkit.target.layer_ids import layer_ids_problem
from dflashkit.validation import (
    FLATTENS,
    BlockSize,
    Bool,
    Expect,
    LayerIds,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Where,
    check_fields,
    choice,
    fail,
    field_types,
    flat_keywords,
    memory_available,
    optional,
    problem,
    show,
)

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


_SOURCE: contextvars.ContextVar[str] = contextvars.ContextVar("drafter_config_source", default="drafter config")


def _default_where(_name: str) -> str:
    """Where a config's values came from when validate() is not told: a file being read, else "drafter config"."""
    return _SOURCE.get()


def parameter_count(cfg: DrafterConfig) -> int:
    """The drafter's parameters (+ its draft→target map, counted in float32 units), from the config alone."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    bias = (q + 2 * kv + h) if cfg.attention_bias else 0
    layer = h * q + 2 * h * kv + q * h + bias + 2 * hd + 3 * h * cfg.intermediate_size + 2 * h
    extra = h if cfg.learned_mask_embedding else 0
    extra += 2 * (cfg.draft_vocab_size or 0)
    extra += head_of(cfg).extra_parameters(cfg)
    return len(cfg.target_layer_ids) * h * h + 2 * h + cfg.num_hidden_layers * layer + extra


def check_memory(
    cfg: DrafterConfig, where: str | Where, *, bytes_per_parameter: int = 4, what: str = "its weights"
) -> None:
    """Refuse a drafter whose float32 weights (or `bytes_per_parameter` per parameter) cannot fit this machine, naming
    the field whose size costs the most (`where(field)`: where it came from; a string: the same for every field)."""
    need = parameter_count(cfg) * bytes_per_parameter
    if need > 256 << 20 and need > memory_available():  # small drafters never need the probe
        name = _costliest_field(cfg)
        at = where(name) if callable(where) else where
        raise ConfigError(
            f"{at}: {name} = {cfg.to_dict()[name]}: this drafter ({cfg.num_hidden_layers} layers, hidden_size "
            f"{cfg.hidden_size}, {len(cfg.target_layer_ids)} target features) needs {need / 1e9:,.1f} GB for {what}, "
            f"more than the {memory_available() / 1e9:,.1f} GB this machine can allocate; {name} is the size that "
            f"costs the most"
        )


def _costliest_field(cfg: DrafterConfig) -> str:
    """The integer field whose value, were it 1, would cut the parameter count the most (the one to make smaller)."""
    import copy

    total, best, name = parameter_count(cfg), -1, "hidden_size"
    own = cfg.head_fields()
    for candidate, value in {**own, **_backbone_fields(cfg)}.items():  # the head's first: it wins a tie
        if candidate in _NOT_SIZES or not isinstance(value, int) or isinstance(value, bool) or value <= 1:
            continue
        smaller = copy.copy(cfg)  # no validation: this size alone changes
        if candidate in own:
            object.__setattr__(smaller, "head_settings", dataclasses.replace(cfg.head_settings, **{candidate: 1}))
        else:
            object.__setattr__(smaller, candidate, 1)
        try:
            saved = total - parameter_count(smaller)
        except (TypeError, ValueError, ZeroDivisionError):
            continue
        if saved > best:
            best, name = saved, candidate
    return name


_NOT_SIZES = ("mask_token_id", "max_position_embeddings", "sliding_window", "num_target_layers")


def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> list[int]:
    """z-lab's rule: K layers spread over 1 … L−3; `[L // 2]` when K = 1. Qwen3-8B (36 layers): [1, 9, 17, 25, 33]."""
    if num_target_layers < 1:
        raise ConfigError(f"num_target_layers must be ≥ 1, got {num_target_layers}")
    if num_features < 1:
        raise ConfigError(f"the number of target features must be ≥ 1, got {num_features}")
    if num_features == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        # Too shallow for the 1 … L−3 spread: use evenly spaced distinct layers over the whole stack.
        if num_features > num_target_layers:
            raise ConfigError(f"cannot pick {num_features} distinct layers from a {num_target_layers}-layer target")
        return sorted({round(j * (num_target_layers - 1) / (num_features - 1)) for j in range(num_features)})
    ids = [round(1 + j * (num_target_layers - 4) / (num_features - 1)) for j in range(num_features)]
    if len(set(ids)) != len(ids):
        raise ConfigError(
            f"cannot pick {num_features} distinct layers in 1..{num_target_layers - 3} "
            f"of a {num_target_layers}-layer target"
        )
    return ids


def stores_target_layer_ids(raw: dict[str, Any]) -> bool:
    """Whether a z-lab config.json dict names its target layers. When it does not, `DrafterConfig.from_zlab_dict`
    derives them as z-lab does: `default_target_layer_ids(num_target_layers, num_hidden_layers)` (K = the drafter's
    layer count, z-lab's `build_target_layer_ids(config.num_target_layers, config.num_hidden_layers)`)."""
    dflash = raw.get("dflash_config") or {}
    return dflash.get("target_layer_ids", raw.get("target_layer_ids")) is not None


def default_geometry(hidden_size: int, target_intermediate_size: int | None = None) -> dict[str, int]:
    """The drafter's own attention/MLP geometry, derived from the hidden size (and, for large targets, the
    target's MLP width).

    Large targets (hidden ≥ 2048) get z-lab's Qwen3-style 32 heads × 128 with 8 kv heads and the target's MLP width
    when known (z-lab's drafters: 12288 for Qwen3-8B, 17408 for Qwen3.6-27B); mid-size ones 16 × 128 with 4 kv
    heads; small ones (SmolLM2's 576) 8 × 64 with 4 kv heads. Otherwise the MLP is 3× hidden rounded up to 128.
    """
    if hidden_size >= 2048:
        heads, kv_heads, head_dim = 32, 8, 128
    elif hidden_size >= 1024:
        heads, kv_heads, head_dim = 16, 4, 128
    else:
        head_dim = 64 if hidden_size >= 256 else max(8, 2 ** int(math.log2(max(hidden_size // 4, 8))))
        heads = max(2, min(8, hidden_size // head_dim))
        kv_heads = max(1, heads // 2)
    intermediate = int(math.ceil(3 * hidden_size / 128) * 128)
    if hidden_size >= 2048 and target_intermediate_size:
        intermediate = int(target_intermediate_size)
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
    }


_ACT = Annotated[str, AfterValidator(lambda v: _check_activation(v)), Expect("an activation name (silu, gelu, …)")]
_LayerTypes = Annotated[list[choice(*LAYER_TYPES)], Expect(f"a list of {' or '.join(LAYER_TYPES)}")]
_Eps = Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False), Expect("a number > 0 and < 1")]


def _check_activation(name: str) -> str:
    if name == "silu":  # every Qwen3 drafter's: known without importing transformers' activations (a second)
        return name
    from transformers.activations import ACT2FN

    if name not in ACT2FN:
        raise ValueError(f"expected an activation transformers knows ({', '.join(sorted(ACT2FN)[:8])}, …)")
    return name


# Fields that follow the target (the drafter reads its features and shares its embeddings and LM head), never set.
TARGET_COUPLED = {
    "hidden_size": "its hidden size",
    "vocab_size": "its vocabulary",
    "num_target_layers": "its decoder layers",
}
# Fields that only one kind of drafter reads (its head's): given to another kind they would be dropped without a word.
KIND_FIELDS = kind_fields()
HEAD_DEFAULTS = {f.name: f.default for settings in DRAFTER_SETTINGS for f in fields(settings)}
NESTED = "head_settings"  # the field holding the head's own fields


def foreign_field_problem(name: str, value: Any, kind: str, prefix: str = "") -> str | None:
    """Why head field `name` (flat, as `prefix` + name at its door) cannot be `value` on a kind=`kind` drafter — it
    is another kind's and not at its default (kept, it would be ignored without a word) — or None."""
    owner = KIND_FIELDS.get(name)
    if owner is None or owner == kind or value == HEAD_DEFAULTS[name]:
        return None
    return (
        f"{prefix}{name} belongs to kind={owner} drafters; this one is kind={kind} "
        f"(add {prefix}kind={owner}, or drop {prefix}{name})"
    )


def _nest_head_fields(values: dict[str, Any]) -> dict[str, Any]:
    """`DrafterConfig`'s keywords with the head's flat fields (`markov_rank=128`) folded into `head_settings`: the
    kind's settings — a given instance of its class with those fields changed, else its defaults with them (a kind
    changed by `replace` starts from the new kind's defaults) — or None for a kind without any. A field of another
    kind is dropped at its default (a door lets a saved config repeat it) and refused, by name, otherwise: kept, it
    would be ignored without a word."""
    flat = {name: values.pop(name) for name in list(values) if name in KIND_FIELDS}
    kind = values.get("kind", "dflash")
    if kind not in KINDS:
        return values  # `validate` names the kind
    for name, value in flat.items():
        why = foreign_field_problem(name, value, kind)
        if why:
            check_fields(DrafterConfig, {name: value}, _default_where)  # a bad value is named as such first
            raise ConfigError(f"{_default_where(name)}: {why}")
    settings, given = head_of(kind).settings, values.get(NESTED)
    own = {name: value for name, value in flat.items() if KIND_FIELDS[name] == kind}
    if settings is None:
        values[NESTED] = None
    elif isinstance(given, settings):
        values[NESTED] = dataclasses.replace(given, **own)  # a copy: configs never share their settings
    else:
        values[NESTED] = settings(**own)
    return values


def _backbone_fields(cfg: DrafterConfig) -> dict[str, Any]:
    """The backbone's fields (every one but the nested head settings), in their declared order."""
    return {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name != NESTED}


@flat_keywords(_nest_head_fields)
@dataclass
class DrafterConfig:
    """Everything that defines a DFlash drafter network and its coupling to a target. Every field's type is its
    check (`dflashkit.validation`); `validate()` runs them and the rules between fields. The fields a head alone
    reads (DSpark's `markov_rank`, DFlash2's `selector_rank`, …) are its settings' (`Head.settings`), held nested in
    `head_settings`; every door names them flat — this constructor (`DrafterConfig(kind="dspark", markov_rank=128)`),
    `for_target`, `replace`, `to_dict`, config.json and the command line."""

    # The kind's own fields: an instance of its head's settings (`head_of(kind).settings`; None for a kind without
    # any, DFlash's), read as `cfg.head_settings.markov_rank`. Declared first: the doors check (and `field_types`
    # lists, `FLATTENS`) a head's fields before the backbone's.
    head_settings: Any = field(default=None, kw_only=True, metadata={FLATTENS: FLAT_DRAFTER_SETTINGS})
    hidden_size: PositiveInt
    vocab_size: PositiveInt
    num_target_layers: PositiveInt
    target_layer_ids: LayerIds
    num_hidden_layers: PositiveInt = 5
    num_attention_heads: PositiveInt = 32
    num_key_value_heads: PositiveInt = 8
    head_dim: PositiveInt = 128
    intermediate_size: PositiveInt = 12288
    block_size: BlockSize = 16
    # Id placed in block slots 1..bs-1. With `learned_mask_embedding` the slots use the drafter's own trained
    # vector instead of this row of the target's table (targets like SmolLM2 have no spare row).
    mask_token_id: NonNegativeInt = 0
    learned_mask_embedding: Bool = False
    layer_types: _LayerTypes = field(default_factory=list)
    sliding_window: optional(PositiveInt, "no sliding-window layers") = None
    # None: full-attention layers bidirectional in the block, sliding layers causal (z-lab's `is_causal`).
    is_causal: optional(Bool, "by layer type") = None
    rms_norm_eps: _Eps = 1e-6
    rope_theta: PositiveFloat = 1_000_000.0
    max_position_embeddings: PositiveInt = 40960
    hidden_act: _ACT = "silu"
    attention_bias: Bool = False
    # Optional reduced draft vocabulary (ids into the target vocabulary); stored in the checkpoint when set.
    draft_vocab_size: optional(PositiveInt, "the target's whole vocabulary") = None
    # Fields of the target's chat setup recorded at training time (checked by doctor at evaluation).
    extra: Annotated[dict[str, Any], Expect("a mapping")] = field(default_factory=dict)
    # the drafter's head (`dflashkit.drafter.heads`): "dflash" (slot 0 holds the given token, slots 1..bs−1 draft),
    # "dspark" (DeepSpec's DSpark), "dflash2" (z-lab's DFlash2), …; a head's own fields are in `head_settings`
    kind: choice(*KINDS) = "dflash"

    def __post_init__(self) -> None:
        check_fields(DrafterConfig, {"num_hidden_layers": self.num_hidden_layers}, _default_where)
        if not self.layer_types:
            self.layer_types = [FULL_ATTENTION] * self.num_hidden_layers
        self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_target(
        cls,
        *,
        hidden_size: int,
        vocab_size: int,
        num_target_layers: int,
        num_features: int = 5,
        target_layer_ids: list[int] | None = None,
        mask_token_id: int | None = None,
        target_intermediate_size: int | None = None,
        **overrides: Any,
    ) -> DrafterConfig:
        """Default drafter for a target: own geometry from the hidden size (and the target's MLP width: large
        targets), z-lab layer ids, mask token choice.

        `mask_token_id=None` means the target has no spare embedding row: a learned mask embedding is used.
        """
        geometry = default_geometry(hidden_size, target_intermediate_size)
        geometry.update({k: v for k, v in overrides.items() if k in geometry})
        rest = {k: v for k, v in overrides.items() if k not in geometry}
        ids = (
            list(target_layer_ids)
            if target_layer_ids is not None
            else default_target_layer_ids(num_target_layers, num_features)
        )
        learned = mask_token_id is None
        return cls(
            hidden_size=hidden_size,
            vocab_size=vocab_size,
            num_target_layers=num_target_layers,
            target_layer_ids=ids,
            mask_token_id=0 if learned else int(mask_token_id),
            learned_mask_embedding=learned,
            **geometry,
            **rest,
        )

    # ------------------------------------------------------------------ checks
    def validate(self, where: Where | None = None) -> None:
        """Raise ConfigError naming the field, its value and what was expected (`where(field)`: its source)."""
        where = where or _default_where
        check_fields(DrafterConfig, {**self.head_fields(), **_backbone_fields(self)}, where)
        settings = head_of(self).settings
        if not (isinstance(self.head_settings, settings) if settings is not None else self.head_settings is None):
            raise fail(
                where("kind"),
                "kind",
                self.kind,
                f"head_settings of its kind ({settings.__name__ if settings else 'None'}), not "
                f"{type(self.head_settings).__name__}",
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise fail(
                where("num_attention_heads"),
                "num_attention_heads",
                self.num_attention_heads,
                f"a multiple of num_key_value_heads ({self.num_key_value_heads})",
            )
        if self.head_dim % 2:
            raise fail(where("head_dim"), "head_dim", self.head_dim, "an even number (RoPE rotates pairs)")
        problem = layer_ids_problem(self.target_layer_ids, self.num_target_layers)
        if problem:
            raise ConfigError(f"{where('target_layer_ids')}: {problem}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise fail(
                where("layer_types"),
                "layer_types",
                self.layer_types,
                f"one entry per layer: num_hidden_layers = {self.num_hidden_layers}",
            )
        if SLIDING_ATTENTION in self.layer_types and self.sliding_window is None:
            raise fail(where("sliding_window"), "sliding_window", None, "an integer ≥ 1: a layer is sliding_attention")
        if not self.mask_token_id < self.vocab_size:
            raise fail(
                where("mask_token_id"),
                "mask_token_id",
                self.mask_token_id,
                f"a row of the embedding table: 0 ≤ id < vocab_size {self.vocab_size}",
            )
        if self.draft_vocab_size is not None and self.draft_vocab_size > self.vocab_size:
            raise fail(
                where("draft_vocab_size"),
                "draft_vocab_size",
                self.draft_vocab_size,
                f"at most the target's vocabulary (vocab_size {self.vocab_size})",
            )
        head_of(self).check_config(self, where)
        check_memory(self, where)

    def check_layer_ids(self, num_target_layers: int) -> None:
        """target_layer_ids must be distinct 0-based decoder-layer indices of the target."""
        problem = layer_ids_problem(self.target_layer_ids, num_target_layers)
        if problem:
            raise ConfigError(problem)

    def head_fields(self) -> dict[str, Any]:
        """The kind's own fields under their flat names (`{"markov_rank": 256, …}`; empty for a kind without any)."""
        return asdict(self.head_settings) if self.head_settings is not None else {}

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    def layer_is_causal(self, layer_idx: int) -> bool:
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[layer_idx] == SLIDING_ATTENTION

    def layer_window(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING_ATTENTION else None

    # ------------------------------------------------------------------ z-lab config.json
    def to_zlab_dict(self) -> dict[str, Any]:
        dflash: dict[str, Any] = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "block_size": self.block_size,
        }
        if self.learned_mask_embedding:
            dflash["mask_embedding"] = True
        if self.draft_vocab_size is not None:
            dflash["draft_vocab_size"] = self.draft_vocab_size
        if self.extra:
            dflash["dflashkit"] = self.extra
        head = head_of(self)
        dflash.update(head.format.zlab_dflash_fields(self))
        return {
            "architectures": list(head.format.architectures),
            **head.format.zlab_fields(self),
            "model_type": "qwen3",
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "block_size": self.block_size,
            "dflash_config": dflash,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            **({"is_causal": self.is_causal} if self.is_causal is not None else {}),
            "layer_types": list(self.layer_types),
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "rope_theta": self.rope_theta,
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "use_cache": True,
            "use_sliding_window": SLIDING_ATTENTION in self.layer_types,
            "vocab_size": self.vocab_size,
        }

    @classmethod
    def from_zlab_dict(cls, raw: dict[str, Any], source: str = "config.json") -> DrafterConfig:
        """Parse a z-lab style config (dflash_config first, then top-level fields)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        check_zlab_field_types(raw, source)  # names the field and the expected type before any int()/float()
        dflash = raw.get("dflash_config") or {}
        check_declared_values(raw, dflash, source)  # and each value against its declared type, before any arithmetic

        def pick(name: str, default: Any = ConfigError) -> Any:
            if name in dflash:
                return dflash[name]
            if name in raw:
                return raw[name]
            if default is ConfigError:
                raise ConfigError(f"{source}: required field '{name}' is missing")
            return default

        rope = raw.get("rope_parameters") or {}
        num_layers = int(pick("num_hidden_layers"))
        kind = kind_of_config(raw)
        # 16.0 as 16, as int(pick(…)) does
        head_fields = integral_ints(head_of(kind).format.fields_from_zlab(raw, source))
        target_layer_ids = pick("target_layer_ids", None)
        if target_layer_ids is None:  # z-lab's fallback: build_target_layer_ids(num_target_layers, num_hidden_layers)
            if pick("num_target_layers", None) is None:
                raise ConfigError(
                    f"{source}: neither 'target_layer_ids' nor 'num_target_layers' is given; the layer "
                    f"ids cannot be derived (add dflash_config.target_layer_ids)"
                )
            try:
                target_layer_ids = default_target_layer_ids(int(pick("num_target_layers")), num_layers)
            except ConfigError as e:
                raise ConfigError(
                    f"{source}: no target_layer_ids stored, and z-lab's default rule fails: {e}"
                ) from None
        sliding_window = raw.get("sliding_window")
        layer_types = pick("layer_types", None) or [FULL_ATTENTION] * num_layers
        if raw.get("use_sliding_window") is False and "layer_types" not in raw:
            sliding_window = None
        token = _SOURCE.set(source)
        try:
            return cls(
                hidden_size=int(pick("hidden_size")),
                vocab_size=int(pick("vocab_size")),
                num_target_layers=int(pick("num_target_layers", max(target_layer_ids) + 4)),
                target_layer_ids=list(target_layer_ids),
                num_hidden_layers=num_layers,
                num_attention_heads=int(pick("num_attention_heads")),
                num_key_value_heads=int(pick("num_key_value_heads", pick("num_attention_heads"))),
                head_dim=int(pick("head_dim", int(pick("hidden_size")) // int(pick("num_attention_heads")))),
                intermediate_size=int(pick("intermediate_size")),
                block_size=int(pick("block_size", 16)),
                mask_token_id=int(pick("mask_token_id", 0)),
                learned_mask_embedding=bool(dflash.get("mask_embedding", False)),
                layer_types=list(layer_types),
                sliding_window=sliding_window,
                is_causal=raw.get("is_causal"),
                rms_norm_eps=float(pick("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0))),
                max_position_embeddings=int(pick("max_position_embeddings", 40960)),
                hidden_act=str(pick("hidden_act", "silu")),
                attention_bias=bool(pick("attention_bias", False)),
                draft_vocab_size=dflash.get("draft_vocab_size"),
                extra=dict(dflash.get("dflashkit") or {}),
                kind=kind,
                **head_fields,
            )
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{source}: malformed field value ({e})") from None
        finally:
            _SOURCE.reset(token)

    def save(self, path: str | Path) -> None:
        from dflashkit.io_utils import atomic_write_text

        atomic_write_text(Path(path), json.dumps(self.to_zlab_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> DrafterConfig:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: file not found (expected a drafter config.json)")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{path}: not valid UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                f"expected a JSON drafter config.json"
            ) from None
        return cls.from_zlab_dict(raw, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        """Every field under its flat name: the backbone's first, then every head's (`FLAT_DRAFTER_SETTINGS`' order)
        — this kind's values, another kind's defaults: one layout for every kind, which the identities hashed from it
        (evaluate's `drafter_fingerprint`) keep."""
        out = asdict(self)
        del out[NESTED]
        for settings in FLAT_DRAFTER_SETTINGS:
            out.update(asdict(self.head_settings if isinstance(self.head_settings, settings) else settings()))
        return out

    def replace(self, **changes: Any) -> DrafterConfig:
        """A new config with `changes` (flat names; a changed kind's own fields start from its defaults)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return DrafterConfig(**values)


_BUILT_FIELDS = ("layer_types", "extra", "kind", "target_layer_ids", "markov_rank")


def check_declared_values(raw: dict[str, Any], dflash: dict[str, Any], source: str) -> None:
    """Every field of a config read from disk that is also a `DrafterConfig` field goes through the field's declared
    type — the door command-line values go through — before any value is used (a head count of 0 must not reach a
    division): `ckpt/config.json: field 'num_attention_heads' = 0: expected an integer ≥ 1`."""
    types = field_types(DrafterConfig)
    for prefix, values in (("dflash_config.", dflash), ("", raw)):
        for name, value in values.items():
            if name not in types or value is None or name in _BUILT_FIELDS:
                continue  # None: the field's default; the rest are checked when the config is built
            if isinstance(value, float) and value.is_integer():
                value = int(value)  # JSON writers may store 4096 as 4096.0
            why = problem(types[name], value)
            if why:
                raise ConfigError(f"{source}: field '{prefix}{name}' = {show(value)}: {why}")


def integral_ints(values: dict[str, Any]) -> dict[str, Any]:
    """`values` (DrafterConfig field → value read from a JSON config) with an integral float stored where the field
    is an integer (`16.0`: JSON writers may store 16 so) made that integer, as the backbone's fields are read with
    int(); any other value is left for the field's type to judge."""
    types = field_types(DrafterConfig)
    out = dict(values)
    for name, value in values.items():
        integral = name in types and isinstance(value, float) and value.is_integer()
        if integral and problem(types[name], value) and not problem(types[name], int(value)):
            out[name] = int(value)
    return out


if __name__ == "__main__":
    for h, layers in ((576, 30), (4096, 36), (5120, 64)):
        cfg = DrafterConfig.for_target(hidden_size=h, vocab_size=1000, num_target_layers=layers, mask_token_id=1)
        print(h, layers, cfg.target_layer_ids, default_geometry(h))
