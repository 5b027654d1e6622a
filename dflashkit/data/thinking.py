"""Thinking mode of reasoning models: the template switch, the reasoning split from an answer, and the record that
lets every later stage refuse data prepared in another mode.

    kwargs = template_kwargs("off", tokenizer, source)   # {"enable_thinking": False}
    info = data_info("data/tokens.jsonl")                  # {"thinking": "keep", "turns": "all", ...} from prepare.json
    check_same_thinking(info.get("thinking"), "off", where="eval of drafter x")   # ConfigError when they differ

Modes (`--thinking`): off (switch off), on (switch on; the reasoning saved apart, not trained), keep (switch on;
the reasoning trained — a drafter that serves a thinking model drafts its reasoning too); none given = the
template's own default. A drafter trained on one mode and served in another sees prompts and responses unlike
its training data; acceptance drops without any error — the most common cause of "acceptance lower than
reported" in DFlash issue trackers — so prepare records the mode, capture and train carry it, and capture (with a
drafter config), eval and simulate refuse a mismatch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflashkit.errors import ConfigError, DataError

THINKING_MODES = ("off", "on", "keep")
THINK_END = "</think>"


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, answer) of a reply: the text before / after the last `</think>` ("" reasoning when none)."""
    if THINK_END not in text:
        return "", text
    head, _, answer = text.rpartition(THINK_END)
    return head.replace("<think>", "", 1).strip(), answer.lstrip("\n")


def template_kwargs(mode: str | None, tokenizer: Any, source: str) -> dict[str, Any]:
    """Chat template kwargs of a thinking mode; a mode for a template without the switch is refused."""
    if mode is None:
        return {}
    if mode not in THINKING_MODES:
        raise ConfigError(f"--thinking {mode}: expected one of {'|'.join(THINKING_MODES)}")
    template = getattr(tokenizer, "chat_template", None) or ""
    if "enable_thinking" not in template:
        raise ConfigError(
            f"--thinking {mode}: the chat template of {source} has no enable_thinking switch; "
            f"expected no --thinking for this target"
        )
    return {"enable_thinking": mode != "off"}


def data_info(tokens_file: str | Path | None) -> dict[str, Any]:
    """How a tokens file was prepared (from the prepare.json next to it): thinking, turns, chat_template_kwargs,
    target; {} when there is no prepare.json (tokens written by hand or by an older dflashkit)."""
    if tokens_file is None:
        return {}
    report = Path(tokens_file).parent / "prepare.json"
    if not report.is_file():
        return {}
    try:
        raw = json.loads(report.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{report}: not valid JSON ({e}); rerun `dflashkit prepare` or delete it") from None
    keys = ("thinking", "turns", "chat_template_kwargs")
    return {k: raw.get(k) for k in keys if raw.get(k) not in (None, {})}


def check_same_thinking(trained: str | None, now: str | None, *, where: str, flag: str = "--thinking") -> None:
    """Refuse work whose thinking mode differs from the one the drafter's data was prepared with."""
    if trained == now:
        return
    name = {None: "the template's default (no --thinking)"}
    raise ConfigError(
        f"{where}: the drafter's training data was prepared with {name.get(trained, f'--thinking {trained}')}, "
        f"but this run uses {name.get(now, f'{flag} {now}')}; a drafter meets prompts and responses unlike its "
        f"training data in another thinking mode (acceptance drops silently); pass "
        f"{'no --thinking' if trained is None else f'{flag} {trained}'}, or prepare and train in the mode you serve"
    )


__all__ = ["THINKING_MODES", "check_same_thinking", "data_info", "split_reasoning", "template_kwargs"]
