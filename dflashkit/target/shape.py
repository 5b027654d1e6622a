"""A target's shape from its config.json alone: sizes, layer kinds and exact parameter counts, no weights read.

    shape = read_target_shape("models/Qwen3-8B")   # a model directory, its config.json, or "default"
    shape.num_parameters, shape.layer_types        # 8_190_735_360, ("full_attention",) * 36

transformers builds the text model on the meta device (parameters with shapes and no storage: a 27 B config builds
in a tenth of a second once its modeling code is imported), so the counts are those of the text model: the decoder,
its embeddings and LM head (a tied head counted once). The plain dense decoders transformers defines (Llama, Mistral,
Qwen2, Qwen3) are counted in closed form instead (`decoder_counts`: the same numbers, without the two seconds of
importing modeling code). A VL wrapper's vision tower is not counted (families that
`Target.load` opens as image-text models keep it in memory too: Gemma 3, Qwen2.5-VL, Qwen3-VL). A MoE target runs
`experts_per_token` of its `num_experts` routed experts per token (the parameters under an `experts` module);
everything else runs for every token.

The config's fields are checked first — its sizes, and a MoE config's experts per token against its experts — a
bad one reported as one line naming the file and the field (`read_config_json`, which `files.check_model_dir` runs
before every load too). Nothing is downloaded, and a directory's own code (`auto_map`) runs only with
`trust_remote_code`.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from dflashkit.errors import TargetError
from dflashkit.target.decoder_counts import DecoderCounts, closed_form_counts
from dflashkit.validation import PositiveInt, problem, show

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedConfig

# The sizes a decoder config must have (inside `text_config` for VL wrappers), and some it may have.
REQUIRED = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")
OPTIONAL = ("intermediate_size", "num_key_value_heads", "head_dim", "max_position_embeddings")
# How MoE families name their routed experts' count and how many of them run per token.
EXPERT_COUNT = ("num_experts", "num_local_experts", "n_routed_experts")
EXPERTS_PER_TOKEN = ("num_experts_per_tok", "experts_per_token")
DEFAULT_SOURCE = "embedded default"


@dataclass(frozen=True)
class TargetShape:
    """What a target is, read from its config: sizes, the kind of each decoder layer, parameter counts."""

    source: str  # the config.json read ("embedded default" for the default target)
    architecture: str  # e.g. "Qwen3ForCausalLM" (architectures[0], or the model class built)
    model_type: str  # of the text config (e.g. "qwen3_5_text")
    hidden_size: int
    num_layers: int
    vocab_size: int
    intermediate_size: int | None  # dense MLP width; None when the config has none
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]  # per decoder layer: "full_attention", "linear_attention", "sliding_attention", …
    max_position_embeddings: int | None
    tie_word_embeddings: bool
    num_parameters: int  # the text model (decoder + embeddings + LM head), counted exactly on the meta device
    num_active_parameters: int  # per token: MoE counts experts_per_token of num_experts (dense: = num_parameters)
    embedding_parameters: int  # vocab × hidden (input table); the LM head is separate unless tied
    num_experts: int | None
    experts_per_token: int | None
    vision_language: bool  # the config nests the decoder in text_config (a VL wrapper such as Qwen3.6-27B)
    dtype: str | None  # the config's torch_dtype / dtype field, e.g. "bfloat16"


class _MetaModel(NamedTuple):
    module: nn.Module  # the whole text model: decoder, embeddings, LM head
    embeddings: nn.Module  # its input embedding table
    head: nn.Module  # its LM head
    name: str  # the class transformers built


def read_target_shape(target: str | Path, *, trust_remote_code: bool = False) -> TargetShape:
    """`target`: a model directory (its config.json), a config.json file, or "default" (the embedded
    SmolLM2-135M-Instruct). Bad input → `TargetError`, one line naming the file and the field."""
    from dflashkit.target.default import DEFAULT_ALIASES, default_config

    if str(target).lower() in DEFAULT_ALIASES:
        config = default_config()
        return _shape(config, config.to_dict(), DEFAULT_SOURCE, trust_remote_code=False)
    file = _config_file(Path(target).expanduser())
    raw = read_config_json(file)
    config = _transformers_config(raw, file, trust_remote_code=trust_remote_code)
    return _shape(config, raw, str(file), trust_remote_code=trust_remote_code)


def read_config_json(file: Path) -> dict[str, Any]:
    """A model's config.json, checked: a JSON object whose decoder sizes (inside `text_config` for VL wrappers) are
    positive integers — the REQUIRED ones present, the OPTIONAL ones where given."""
    try:
        raw = json.loads(file.read_bytes().decode("utf-8"))
    except OSError as e:
        raise TargetError(f"{file}: cannot read ({e.strerror or e}); expected a JSON model config") from None
    except UnicodeDecodeError as e:
        raise TargetError(f"{file}: not valid UTF-8 (byte offset {e.start}); expected a JSON model config") from None
    except json.JSONDecodeError as e:
        raise TargetError(f"{file}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not isinstance(raw, dict):
        raise TargetError(f"{file}: expected a JSON object (a model config), got {type(raw).__name__}")
    inner = raw.get("text_config")
    cfg, prefix = (inner, "text_config.") if isinstance(inner, dict) else (raw, "")
    for name in REQUIRED + OPTIONAL:
        if name not in cfg or (name in OPTIONAL and cfg[name] is None):
            if name in REQUIRED:
                raise TargetError(f"{file}: field '{prefix}{name}' is missing; expected a decoder model config")
            continue
        why = problem(PositiveInt, cfg[name])
        if why:
            raise TargetError(f"{file}: {prefix}{name} = {show(cfg[name])}: {why}")
    why = experts_problem(cfg, prefix)
    if why:
        raise TargetError(f"{file}: {why}")
    return raw


def experts_problem(cfg: Any, prefix: str = "") -> str | None:
    """Why a MoE config's expert counts are impossible — more experts per token than experts (more active than
    total parameters) — or None. `cfg`: a config dict or object; counts it does not set are not checked."""

    def first(names: tuple[str, ...]) -> tuple[str, Any]:
        for name in names:
            value = cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)
            if value is not None:
                return name, value
        return "", None

    (count_name, count), (per_name, per_token) = first(EXPERT_COUNT), first(EXPERTS_PER_TOKEN)
    counts = per_name and count_name and not problem(PositiveInt, count) and not problem(PositiveInt, per_token)
    if counts and per_token > count:
        return (
            f"{prefix}{per_name} = {per_token}: expected at most {prefix}{count_name} ({count}) experts per token (a "
            f"token cannot run more experts than the layer has)"
        )
    return None


def knows_architecture(raw: dict[str, Any]) -> bool:
    """Whether transformers itself knows the config's `model_type` (otherwise only the directory's own code can
    build the model)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = raw.get("model_type")
    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def _config_file(path: Path) -> Path:
    if not path.exists():
        raise TargetError(
            f"target path {path} does not exist (expected a model directory, its config.json, "
            f"or 'default' for the embedded SmolLM2-135M-Instruct)"
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TargetError(f"{path}: no config.json (expected a Hugging Face model directory)")
        return path / "config.json"
    if path.suffix != ".json":
        raise TargetError(f"target file {path} is not a config.json; pass a model directory or its config.json")
    return path


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def _transformers_config(raw: dict[str, Any], file: Path, *, trust_remote_code: bool) -> PreTrainedConfig:
    """The config object transformers makes of `raw` (with the directory's own config class when allowed)."""
    from transformers import AutoConfig, __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if model_type is None:
        raise TargetError(f"{file}: field 'model_type' is missing; expected a decoder model config")
    if not isinstance(model_type, str):
        raise TargetError(f"{file}: model_type = {show(model_type)}: expected the name of a model family")
    own_code = trust_remote_code and isinstance(raw.get("auto_map"), dict)
    if not own_code and not knows_architecture(raw):
        hint = (
            "; the config names its own code (auto_map): allow it with trust_remote_code (--trust-remote-code) "
            "if you trust that code"
            if "auto_map" in raw
            else "; expected a causal LM config of a family transformers supports"
        )
        known = f"is not an architecture transformers {__version__} knows"
        raise TargetError(f"{file}: model_type '{model_type}' {known}{hint}")
    try:
        if own_code:
            return AutoConfig.from_pretrained(file.parent, trust_remote_code=True, local_files_only=True)
        return CONFIG_MAPPING[model_type].from_dict(copy.deepcopy(raw))  # a copy: configs fix up their sub-dicts
    except Exception as e:  # transformers' own checks (typed fields, layer_types against num_hidden_layers, …)
        raise TargetError(f"{file}: transformers cannot read this config ({_one_line(e)})") from None


def _meta_text_model(config: PreTrainedConfig, where: str, *, trust_remote_code: bool) -> _MetaModel:
    """The text model of `config` on the meta device: the causal LM transformers builds from the text config (as
    `Target.load` does), or — for VL families without one (Qwen2.5-VL, Qwen3-VL, which `Target.load` runs as
    image-text models) — their text model and an LM head, tied when the wrapper ties them."""
    import torch
    from torch import nn
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    text = config.get_text_config()
    own_code = trust_remote_code and "AutoModelForCausalLM" in (getattr(text, "auto_map", None) or {})
    try:
        with torch.device("meta"):
            if own_code or type(text) in MODEL_FOR_CAUSAL_LM_MAPPING:
                model = AutoModelForCausalLM.from_config(text, trust_remote_code=trust_remote_code)
                head = model.get_output_embeddings()
                return _MetaModel(model, model.get_input_embeddings(), head, type(model).__name__)
            if type(text) in MODEL_MAPPING:
                base = AutoModel.from_config(text)
                embeddings = base.get_input_embeddings()
                head = nn.Linear(int(text.hidden_size), int(text.vocab_size), bias=False)
                if getattr(config, "tie_word_embeddings", False):  # the wrapper's config decides, as in transformers
                    head.weight = embeddings.weight
                whole = nn.ModuleDict({"model": base, "lm_head": head})
                return _MetaModel(whole, embeddings, head, type(base).__name__)
    except Exception as e:  # sizes transformers refuses (heads that do not divide the width, …)
        raise TargetError(f"{where}: transformers cannot build a model from this config ({_one_line(e)})") from None
    raise TargetError(f"{where}: transformers has no causal LM for model_type '{text.model_type}'")


def _positive_field(cfg: Any, names: tuple[str, ...]) -> int | None:
    """The first of `names` that `cfg` sets to a positive integer."""
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _dtype(raw: dict[str, Any]) -> str | None:
    inner = raw.get("text_config")
    for cfg in (raw, inner if isinstance(inner, dict) else {}):
        for key in ("torch_dtype", "dtype"):
            if isinstance(cfg.get(key), str):
                return cfg[key]
    return None


def _counts(config: PreTrainedConfig, source: str, *, trust_remote_code: bool) -> tuple[DecoderCounts, int]:
    """The text model's parameter counts and how many of them are routed experts: in closed form for a plain dense
    decoder transformers itself defines (`decoder_counts`), else from the meta build."""
    text = config.get_text_config()
    plain = text is config and not (trust_remote_code and getattr(config, "auto_map", None))
    counts = closed_form_counts(text) if plain else None
    if counts is not None:
        return counts, 0
    built = _meta_text_model(config, source, trust_remote_code=trust_remote_code)
    total = sum(p.numel() for p in built.module.parameters())  # shared (tied) parameters once
    # routed experts: every parameter inside a module named `experts` (fused (E, …) tensors or a list of E experts)
    routed = sum(p.numel() for name, p in built.module.named_parameters() if "experts" in name.split(".")[:-1])
    tied = built.head.weight is built.embeddings.weight
    return DecoderCounts(total, built.embeddings.weight.numel(), tied, built.name), routed


def _shape(config: PreTrainedConfig, raw: dict[str, Any], source: str, *, trust_remote_code: bool) -> TargetShape:
    text = config.get_text_config()
    counts, routed = _counts(config, source, trust_remote_code=trust_remote_code)
    total = counts.total
    experts = per_token = None
    active = total
    if routed:
        experts, per_token = _positive_field(text, EXPERT_COUNT), _positive_field(text, EXPERTS_PER_TOKEN)
        if experts is None or per_token is None:
            raise TargetError(
                f"{source}: the model has routed experts but the config sets no positive "
                f"{' / '.join(EXPERT_COUNT)} and {' / '.join(EXPERTS_PER_TOKEN)}"
            )
        why = experts_problem(text)  # the counts as transformers reads them (its defaults included)
        if why:
            raise TargetError(f"{source}: {why}")
        active = total - routed + routed * per_token // experts
    architectures = raw.get("architectures")
    named = isinstance(architectures, list) and architectures and isinstance(architectures[0], str)
    layers, heads = int(text.num_hidden_layers), int(text.num_attention_heads)
    return TargetShape(
        source=source,
        architecture=architectures[0] if named else counts.name,
        model_type=str(text.model_type),
        hidden_size=int(text.hidden_size),
        num_layers=layers,
        vocab_size=int(text.vocab_size),
        intermediate_size=_positive_field(text, ("intermediate_size",)),
        num_attention_heads=heads,
        num_key_value_heads=_positive_field(text, ("num_key_value_heads",)) or heads,
        head_dim=_positive_field(text, ("head_dim",)) or int(text.hidden_size) // heads,
        layer_types=tuple(getattr(text, "layer_types", None) or ("full_attention",) * layers),
        max_position_embeddings=_positive_field(text, ("max_position_embeddings",)),
        tie_word_embeddings=counts.tied,
        num_parameters=total,
        num_active_parameters=active,
        embedding_parameters=counts.embeddings,
        num_experts=experts,
        experts_per_token=per_token,
        vision_language=isinstance(raw.get("text_config"), dict),
        dtype=_dtype(raw),
    )


__all__ = ["TargetShape", "experts_problem", "knows_architecture", "read_config_json", "read_target_shape"]
