"""The drafter dflashkit builds for a target: `default_drafter_config(target)` is the one place that turns a loaded
target into a `DrafterConfig` (own geometry, z-lab layer ids, mask-token choice); plus the `key=value` override
parser the CLI uses for drafter fields, and the one-line description of a drafter's mask choice.

    cfg = default_drafter_config(target, num_hidden_layers=2, block_size=8)
    parse_overrides(["num_hidden_layers=3", "target_layer_ids=[1,5,9]"])   # → {"num_hidden_layers": 3, …}
"""

from __future__ import annotations

from typing import Any

from dflashkit.drafter.config import KIND_FIELDS, TARGET_COUPLED, DrafterConfig, foreign_field_problem
from dflashkit.errors import ConfigError
from dflashkit.validation import PositiveInt, Where, check_fields, parse_assignments, problem, show


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """`key=value` strings → dict of checked drafter fields (values parsed as YAML: `target_layer_ids=[1,5,9]`)."""
    out, where = parse_assignments(items, example="num_hidden_layers=3")
    check_overrides(out, lambda k: where.get(k, "drafter overrides"))
    return out


def check_overrides(overrides: Any, where: Where, *, prefix: str = "") -> None:
    """Drafter config fields given as overrides (CLI `key=value`, a training config's `drafter:` mapping): known
    names, each value of its declared type; `num_features` (how many target layers, default 5) besides."""
    if not isinstance(overrides, dict):
        raise ConfigError(
            f"{where('')}: {prefix.rstrip('.') or 'drafter'} = {show(overrides)}: expected a mapping "
            f"of drafter config fields"
        )
    fields_only = {k: v for k, v in overrides.items() if k != "num_features"}
    check_fields(DrafterConfig, fields_only, where, prefix=prefix, what="drafter config field")
    for name in fields_only:
        if name in TARGET_COUPLED:
            raise ConfigError(
                f"{where(name)}: {prefix}{name} follows the target ({TARGET_COUPLED[name]}) and cannot be set; a "
                f"drafter for another size is a drafter for another target (--target)"
            )
    kind = fields_only.get("kind", "dflash")
    for name in KIND_FIELDS:
        why = foreign_field_problem(name, fields_only[name], kind, prefix) if name in fields_only else None
        if why:
            raise ConfigError(f"{where(name)}: {why}")
    if "num_features" in overrides:
        why = problem(PositiveInt, overrides["num_features"])
        if why:
            raise ConfigError(
                f"{where('num_features')}: {prefix}num_features = {show(overrides['num_features'])}: {why}"
            )


def default_drafter_config(target: Any, **overrides: Any) -> DrafterConfig:
    """The drafter dflashkit builds for `target` (a `Target`): own geometry, z-lab layer ids, mask-token choice.

    The mask token is a spare embedding row when the target has one (z-lab's choice for Qwen3), else the row of
    a special token no chat produces (SmolLM2: 16 `<empty_output>`; `mask_choice.py`; measured as good as a
    learned mask at equal training minutes, docs/studies.md "Mask choice"), else a learned mask embedding stored in the
    drafter. `learned_mask_embedding=True` asks for the learned one.
    """
    check_overrides(overrides, lambda _k: "drafter overrides")
    overrides = dict(overrides)
    spare = target.spare_mask_token_id()
    if overrides.pop("learned_mask_embedding", False):
        mask, why = None, "a learned mask embedding was asked for"
    elif "mask_token_id" in overrides:
        mask, why = overrides.pop("mask_token_id"), "chosen by the user"
    elif spare is not None:
        mask, why = spare, f"spare embedding row {spare}: beyond the tokenizer, never produced"
    else:
        from dflashkit.drafter.mask_choice import unused_special_token

        pick = unused_special_token(target.tokenizer) if target.tokenizer is not None else None
        mask, why = pick if pick else (None, "every embedding row is a token the tokenizer can produce")
    extra = {
        "chat_template": target.chat_template_info(),
        "target_architecture": target.architecture,
        "mask_reason": why,
    }
    extra.update(overrides.pop("extra", {}) or {})
    cfg = DrafterConfig.for_target(
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        num_target_layers=target.num_layers,
        target_intermediate_size=getattr(getattr(target, "text_config", None), "intermediate_size", None),
        mask_token_id=mask,
        extra=extra,
        **overrides,
    )
    target.check_layer_ids(cfg.target_layer_ids)
    return cfg


def describe_mask(cfg: DrafterConfig, tokenizer: Any = None) -> str:
    """Which mask the drafter uses, why (as recorded at creation), and where it loads unchanged."""
    why = cfg.extra.get("mask_reason")
    if cfg.learned_mask_embedding:
        text = "learned mask embedding (the drafter's own vector"
        text += f"; {why})" if why else ")"
        return text + (
            f" — vLLM reads it (mask_embedding.pt), llama.cpp only with a table copy in the GGUF; "
            f"z-lab and SGLang would use row {cfg.mask_token_id} instead"
        )
    kind, token = "", None
    if tokenizer is not None:
        n = len(tokenizer)
        if cfg.mask_token_id >= n:
            kind = "beyond the tokenizer: never produced"
        else:
            token = tokenizer.convert_ids_to_tokens(cfg.mask_token_id)
            special = cfg.mask_token_id in set(
                getattr(tokenizer, "all_special_ids", []) or []
            ) or cfg.mask_token_id in (getattr(tokenizer, "added_tokens_decoder", None) or {})
            kind = f"{token!r}, {'a special token' if special else 'an ordinary token'}"
    names_token = bool(why and token is not None and repr(token) in why)  # the recorded reason names the token
    parts = [why] if names_token else [p for p in (kind, why) if p]
    return (
        f"target embedding row {cfg.mask_token_id}"
        + (f" ({'; '.join(parts)})" if parts else "")
        + " — loads unchanged in z-lab, vLLM, SGLang and llama.cpp"
    )


__all__ = ["default_drafter_config", "describe_mask", "parse_overrides"]
