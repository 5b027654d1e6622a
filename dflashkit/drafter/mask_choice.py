"""Which embedding row a drafter's mask slots use when the target has no spare (padded) row.

    from dflashkit.drafter.mask_choice import unused_special_token
    unused_special_token(tokenizer)                       # SmolLM2 → (16, "'<empty_output>': a special token …")
    unused_special_token(tokenizer, token_lists=data)     # … and check it occurs nowhere in that data

z-lab uses a padded, never-trained row (Qwen3: 151669). SmolLM2 has none (49152 rows, all tokens), but it has
special tokens no chat ever produces (its code-dataset markers: `<repo_name>` … `<empty_output>`). A row of one of
those keeps the drafter a plain z-lab checkpoint (z-lab, vLLM, SGLang and llama.cpp load it unchanged); a learned
mask embedding needs each engine's own workaround. Candidates are added special tokens that are not the
tokenizer's control tokens (bos / eos / pad / unk) and do not appear in its chat template; the highest id wins
(the likeliest to be unused), unless `token_lists` shows it in the data.
bench/mask_choice.py measures the two choices at equal training minutes (docs/studies.md, "Mask choice").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def special_candidates(tokenizer: Any) -> list[int]:
    """Added special tokens that no chat formatting produces, highest id first."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    control = {getattr(tokenizer, f"{n}_token_id", None) for n in ("bos", "eos", "pad", "unk")}
    template = getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else " ".join(map(str, template))
    out = []
    for idx, tok in decoder.items():
        content = getattr(tok, "content", str(tok))
        if getattr(tok, "special", True) and idx not in control and content not in template:
            out.append(int(idx))
    return sorted(out, reverse=True)


def unused_special_token(tokenizer: Any, *, token_lists: Iterable[Iterable[int]] = ()) -> tuple[int, str] | None:
    """(id, why) of a special token usable as the mask row, or None when there is none."""
    candidates = special_candidates(tokenizer)
    if not candidates:
        return None
    seen: set[int] = set()
    checked = False
    for ids in token_lists:
        checked = True
        seen.update(int(i) for i in ids if int(i) in candidates)
    for idx in candidates:
        if idx not in seen:
            token = tokenizer.convert_ids_to_tokens(idx)
            why = f"{token!r}: a special token outside the chat template and the control tokens" + (
                "; it occurs nowhere in the training data" if checked else ""
            )
            return idx, why
    return None


__all__ = ["special_candidates", "unused_special_token"]
