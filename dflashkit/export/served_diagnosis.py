"""Why a deployment accepts less than dflashkit measured: the evidence `served.check_server` gathers, turned into
causes — each one line naming what differs and one line with the fix.

    findings = diagnose(evidence)     # [Finding(cause, line, fix)]; empty when the engine agrees exactly

A cause is named only on evidence that separates it from the others, checked in this order:
  template   the server's own rendering of a chat (vLLM's and llama-server's /tokenize) differs from the prompt the
             drafter was trained on: chat template, thinking mode, BOS, system prompt
  sampling   the same greedy request answered twice differently, neither answer the target's greedy output, or the
             server says it sampled at T > 0: greedy comparisons do not hold there (the other causes are not judged)
  length     outputs and acceptance equal to dflashkit's on every prompt up to some length (two or more) and
             different on every prompt at least half as long again: a shorter window than trained (sliding window,
             context limit, RoPE scaling)
  numerics   outputs that part from the target's own greedy output where the target has no near-tie: another
             precision or a quantized target
  config     the drafter config the engine reads (its exported files) differs from the trained one; or the engine's
             counts are exactly those of the drafter reading every target layer one off; or it drafts another
             number of tokens a round than the block trains; else, acceptance different on identical outputs: the
             drafter as served is not the one trained (mask, layer ids, vocabulary map, block size)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Finding:
    cause: str  # "template" | "sampling" | "length" | "numerics" | "config"
    line: str
    fix: str


@dataclass
class Evidence:
    protocol: str
    block_size: int
    slots: int  # drafts a round proposes as trained
    trained_config: dict[str, Any]
    served_config: dict[str, Any] | None
    prompts: list[Any]  # served.ServedPrompt
    rendered: list[tuple[list[int], list[int] | None]]  # (trained prompt ids, the server's rendering or None)
    repeat: tuple[list[int], list[int]] | None  # the first prompt's output, twice
    echoed_settings: dict[str, Any] = field(default_factory=dict)  # sampling settings the server says it used
    shifted_layers: dict[int, list[Any]] = field(default_factory=dict)  # shift → counts of the usable requests
    tokenizer: Any = None


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    k = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if k is None and len(a) != len(b):
        k = min(len(a), len(b))
    return k


def _text(tok: Any, ids: Sequence[int]) -> str:
    if tok is None:
        return str(list(ids))
    return repr(tok.decode(list(ids), skip_special_tokens=False))


def same_counts(engine: Any, ours: Any) -> bool:
    """Engine counts equal dflashkit's on what the engine reports (rounds unless -1, accepted, positions if any)."""
    if engine.drafts >= 0 and engine.drafts != ours.drafts:
        return False
    if engine.accepted != ours.accepted:
        return False
    if engine.accepted_per_pos:
        width = max(len(engine.accepted_per_pos), len(ours.accepted_per_pos))
        pad = lambda v: list(v) + [0] * (width - len(v))  # noqa: E731
        return pad(engine.accepted_per_pos) == pad(ours.accepted_per_pos)
    return True


def _template(ev: Evidence) -> Finding | None:
    for i, (ours, theirs) in enumerate(ev.rendered):
        if theirs is None or theirs == ours:
            continue
        k = _first_difference(ours, theirs) or 0
        mine, served = _text(ev.tokenizer, ours[k : k + 12]), _text(ev.tokenizer, theirs[k : k + 12])
        what = "chat template"
        both = f"{mine} {served}"
        if "think>" in both:
            what = "thinking mode"
        elif (
            k == 0
            and ev.tokenizer is not None
            and getattr(ev.tokenizer, "bos_token_id", None) in (ours[:1] + theirs[:1])
        ):
            what = "BOS token"
        elif "system" in served and "system" not in mine:
            what = "system prompt"
        return Finding(
            "template",
            f"the prompt tokens differ ({what}): prompt {ev.prompts[i].id if i < len(ev.prompts) else i} as the "
            f"server renders it parts from the trained one at token {k}: server {served}, trained {mine}",
            "serve with the chat template and thinking mode the drafter was trained with (vLLM --chat-template and "
            "chat_template_kwargs, llama-server --jinja --chat-template-file, --reasoning-budget), or prepare the "
            "training data with the server's template (`dflashkit prepare --thinking …`)",
        )
    return None


def _sampling(ev: Evidence) -> Finding | None:
    temp = ev.echoed_settings.get("temperature")
    if isinstance(temp, (int, float)) and temp > 0:
        return Finding(
            "sampling",
            f"the server sampled at temperature {temp:g} though 0 was asked: greedy acceptance does not apply",
            "serve and measure at temperature 0 (the server's defaults: llama-server --temp, vLLM "
            "--generation-config / --override-generation-config, SGLang --sampling-defaults); to measure a drafter "
            "at T > 0, `dflashkit eval --temperatures T`",
        )
    greedy = ev.prompts[0].own.tokens if ev.prompts else []
    # one of two answers equal to the target's greedy output: a greedy server whose second answer ran other batch
    # shapes (a cached prompt) past a near-tie, not a sampling one
    either_greedy = ev.repeat is not None and any(r == greedy[: len(r)] for r in ev.repeat)
    if ev.repeat is not None and ev.repeat[0] != ev.repeat[1] and not either_greedy:
        k = _first_difference(*ev.repeat)
        return Finding(
            "sampling",
            f"two identical greedy requests got outputs that part at token {k}: the server samples (temperature or "
            "top-p/top-k set on its side, or non-deterministic batching), so its outputs and acceptance are not "
            "greedy's",
            "serve and measure at temperature 0 with top-p 1 (the server's defaults: llama-server --temp, vLLM "
            "--generation-config / --override-generation-config, SGLang --sampling-defaults); to measure a drafter "
            "at T > 0, `dflashkit eval --temperatures T`",
        )
    return None


def _differs(p: Any) -> bool:
    """The request's output or acceptance differs from dflashkit's (the target's own near-ties are no difference)."""
    if not p.same_tokens and p.near_tie is None:
        return True
    return p.engine is not None and not same_counts(p.engine, p.teacher_forced)


def _length(ev: Evidence) -> Finding | None:
    good = [p.prompt_tokens for p in ev.prompts if not _differs(p)]
    bad = [p.prompt_tokens for p in ev.prompts if _differs(p)]
    # a window shows as a clean split well apart (a few prompts split by chance otherwise): two or more exact
    # prompts, and every differing one half as long again as the longest exact one
    if len(good) < 2 or not bad or min(bad) < 1.5 * max(good):
        return None
    return Finding(
        "length",
        f"acceptance falls with prompt length: outputs and acceptance equal dflashkit's on every prompt up to "
        f"{max(good)} tokens and differ on every prompt from {min(bad)} tokens on: the engine attends to a shorter "
        "window than the drafter or target was trained with (a sliding window in the served config, a context "
        "limit, other RoPE scaling)",
        "check the served config's sliding_window, layer_types and rope_scaling against the trained ones "
        "(`dflashkit inspect DRAFTER`) and the engine's context flags (vLLM --max-model-len, llama-server -c / "
        "--ctx-size, which is shared by its --parallel slots)",
    )


def _numerics(ev: Evidence) -> Finding | None:
    clear = [p for p in ev.prompts if not p.same_tokens and p.near_tie is None]
    if not clear:
        return None
    p = clear[0]
    return Finding(
        "numerics",
        f"the served target's greedy output differs from the target's here on {len(clear)} of {len(ev.prompts)} "
        f"prompts (first: {p.id} at token {p.first_difference}, not a near-tie): the engine runs other numerics — "
        "a quantized (FP8, INT4/AWQ, GGUF Q4/Q8) or lower-precision target — so the hidden states the drafter reads "
        "are not those it was trained on",
        "train on the numerics you serve: prepare and capture from the served weights (`dflashkit capture --target "
        "model-Q4_K_M.gguf` reads the dequantized GGUF; FP8 / AWQ checkpoints load through transformers on a GPU), "
        "or serve the target at the precision the drafter was trained on",
    )


_CONFIG_FIX = (
    "re-export the drafter with `dflashkit convert` and serve those files; `dflashkit inspect DRAFTER` lists what "
    "each engine reads"
)


def _config(ev: Evidence) -> Finding | None:
    if ev.served_config:
        diffs = [
            f"{k} {ev.served_config[k]!r} served, {v!r} trained"
            for k, v in ev.trained_config.items()
            if k in ev.served_config
            and ev.served_config[k] != v
            and not (k == "layer_types" and not ev.served_config[k] and not v)
        ]
        if diffs:
            return Finding(
                "config",
                "the drafter config the engine reads differs from the trained one: " + "; ".join(diffs),
                _CONFIG_FIX,
            )
    usable = [p for p in ev.prompts if p.engine is not None]
    if not usable or all(same_counts(p.engine, p.teacher_forced) for p in usable):
        return None
    for shift, counts in sorted(ev.shifted_layers.items()):
        if counts and all(same_counts(p.engine, c) for p, c in zip(usable, counts, strict=True)):
            ids = ev.trained_config["target_layer_ids"]
            return Finding(
                "config",
                f"the engine's counts are exactly those of the drafter reading target layers "
                f"{[i + shift for i in ids]} instead of the trained {ids}: target_layer_ids (or the engine's layer "
                f"tap) one {'later' if shift > 0 else 'earlier'}",
                "serve a config with the trained target_layer_ids (dflashkit's ids are outputs of decoder layers, "
                "HF hidden_states[i + 1]; llama.cpp's GGUF stores i + 1) — " + _CONFIG_FIX,
            )
    widths = {len(p.engine.accepted_per_pos) for p in usable if p.engine.accepted_per_pos}
    if widths and max(widths) != ev.slots:
        return Finding(
            "config",
            f"the engine drafts {max(widths)} tokens a round; the drafter was trained for {ev.slots} (block "
            f"{ev.block_size})",
            f"set the engine's draft length to {ev.slots} (vLLM num_speculative_tokens, llama-server "
            "--spec-draft-n-max)",
        )
    if all(p.same_tokens or p.near_tie is not None for p in usable):
        return Finding(
            "config",
            "acceptance differs on identical outputs: the engine runs another drafter than the one trained — the "
            "mask (mask_token_id, or a learned mask not exported), the layer ids, the vocabulary map (d2t), the block "
            "size, the causal flags, or a draft-length flag such as llama-server --spec-draft-p-min",
            "compare the files the engine loads with the trained drafter (`serve-check … --served-drafter PATH`) — "
            + _CONFIG_FIX,
        )
    return None


def diagnose(ev: Evidence) -> list[Finding]:
    """The causes the evidence shows (module docstring); empty when the engine agrees with dflashkit exactly."""
    found = [f for f in (_template(ev),) if f]
    sampled = _sampling(ev)
    if sampled:
        return [*found, sampled]
    length = _length(ev)
    if length:
        return [*found, length, *[f for f in (_config(ev),) if f and ev.served_config]]
    return [*found, *[f for f in (_numerics(ev), _config(ev)) if f]]


__all__ = ["Evidence", "Finding", "diagnose", "same_counts"]
