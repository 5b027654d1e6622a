"""Conversations, JSONL input, and tokenisation with a loss mask on the assistant tokens.

A `Conversation` is a list of `{"role", "content"}` messages (roles system|user|assistant) with an id and a
source. `read_jsonl_conversations` reads three line formats, freely mixed in one file:

    {"messages": [{"role": "user", "content": "..."}, ...]}            OpenAI chat (content may be text parts)
    {"conversations": [{"from": "human", "value": "..."}, ...]}        ShareGPT (human→user, gpt→assistant)
    {"prompt": "...", "system": "...", "response": "..."}             plain prompt (system/response optional)
    "a bare JSON string"                                              plain prompt

Each line may carry an `"id"` (string or number); otherwise the id is `<file stem>-<line number>`.

`tokenize_for_training` renders the tokenizer's chat template and marks as supervised exactly the tokens the
model produces for each assistant turn: its content and the end-of-turn token that closes it (`<|im_end|>` in
ChatML), never system/user/header tokens. The mask is found by diffing token ids of the template rendered on
prefixes of the conversation (no `{% generation %}` markers needed): an assistant turn starts where the
rendering of the messages before it plus the generation prompt stops matching the full rendering, and ends at
the first end-of-turn token after that. When BPE merges the end of the generation prompt with the first
content characters into one token, that token is supervised (it carries content). `tokenize_regenerated`
builds a sample from a target transcript (prompt ids + the exact response token ids the target generated), so
training sees the target's own tokens and that boundary question never arises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dflashkit.data.jsonl import read_lines
from dflashkit.errors import DataError

ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}
# End-of-turn / end-of-text tokens of common chat templates; those present in a vocabulary stop a turn.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<|eom_id|>",
)


@dataclass
class Conversation:
    """One chat: messages with role in system|user|assistant and string content."""

    messages: list[dict[str, str]]
    id: str
    source: str
    meta: dict[str, Any] = field(default_factory=dict)  # dataset extras (MT-Bench category, HumanEval task …)


@dataclass
class TokenizedSample:
    input_ids: list[int]
    loss_mask: list[bool]  # True on supervised (assistant) tokens
    truncated: bool  # the rendered conversation was longer than max_length and was cut

    @property
    def num_supervised(self) -> int:
        return sum(self.loss_mask)


# ---------------------------------------------------------------------------------------------- parsing
def _content_text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts: keep the text parts
        parts = []
        for k, part in enumerate(value):
            if isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise ValueError(f"field {where}[{k}]: expected a text part {{'type': 'text', 'text': str}}")
        return "".join(parts)
    raise ValueError(f"field {where}: expected a string, got {type(value).__name__}")


def _normalise_messages(raw: Any, field_name: str, role_key: str, content_key: str) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"field {field_name!r}: expected a non-empty list of messages")
    messages = []
    for k, m in enumerate(raw):
        where = f"{field_name}[{k}]"
        if not isinstance(m, dict):
            raise ValueError(f"field {where}: expected an object, got {type(m).__name__}")
        rk = role_key if role_key in m else ("role" if "role" in m else "from")
        ck = content_key if content_key in m else ("content" if "content" in m else "value")
        if rk not in m or ck not in m:
            raise ValueError(f"field {where}: expected keys {role_key!r} and {content_key!r}")
        role = ROLE_ALIASES.get(str(m[rk]).lower())
        if role is None:
            raise ValueError(f"field {where}.{rk}: expected one of system|user|assistant (or human|gpt), got {m[rk]!r}")
        messages.append({"role": role, "content": _content_text(m[ck], f"{where}.{ck}")})
    return messages


def conversation_from_record(record: Any, *, default_id: str, source: str, categories: bool = False) -> Conversation:
    """Turn one parsed JSON value (any accepted format) into a Conversation; ValueError says what is wrong.
    `categories`: keep (and check) a `category` field in `meta` — evaluation groups its statistics by it; training
    reads past it."""
    if isinstance(record, str):
        messages = [{"role": "user", "content": record}]
        return Conversation(messages, default_id, source)
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object or string, got {type(record).__name__}")
    if "messages" in record:
        messages = _normalise_messages(record["messages"], "messages", "role", "content")
    elif "conversations" in record:
        messages = _normalise_messages(record["conversations"], "conversations", "from", "value")
    elif "prompt" in record:
        messages = []
        if record.get("system") is not None:
            messages.append({"role": "system", "content": _content_text(record["system"], "system")})
        messages.append({"role": "user", "content": _content_text(record["prompt"], "prompt")})
        for key in ("response", "completion"):
            if record.get(key) is not None:
                messages.append({"role": "assistant", "content": _content_text(record[key], key)})
                break
    else:
        raise ValueError("expected a field 'messages' (OpenAI), 'conversations' (ShareGPT) or 'prompt'")
    if not any(m["role"] == "user" for m in messages):
        raise ValueError("no user message (expected at least one message with role 'user'/'human')")
    rid = record.get("id", default_id)
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise ValueError(f"field 'id': expected a string or integer, got {type(rid).__name__}")
    meta: dict[str, Any] = {}
    if categories and "category" in record:
        category = record["category"]
        if not isinstance(category, str) or not category.strip():
            raise ValueError("field 'category': expected a non-empty string (the prompt's category, e.g. 'coding')")
        meta["category"] = category.strip()
    return Conversation(messages, str(rid), source, meta)


def read_jsonl_conversations(
    path: str | Path, *, on_error: Literal["stop", "skip"] = "stop", limit: int | None = None, categories: bool = False
) -> tuple[list[Conversation], list[str]]:
    """Read conversations from a JSONL file. Returns (conversations, problems). `categories`: keep each line's
    `category` (conversation_from_record).

    on_error="stop": the first malformed line raises DataError naming file:line. on_error="skip": the line is
    skipped and its problem ("file:line: what") recorded in the returned list. Duplicate ids are malformed lines
    (ids key resumable regeneration). A file with no usable conversation raises DataError either way.
    """
    if on_error not in ("stop", "skip"):
        raise DataError(f"on_error={on_error!r}: expected 'stop' or 'skip'")
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file (expected a JSONL file or a dataset name)")
    conversations: list[Conversation] = []
    problems: list[str] = []
    seen: set[str] = set()
    for line in read_lines(path):
        if limit is not None and len(conversations) >= limit:
            break
        lineno = line.number
        try:
            record = line.json()  # LineProblem: over the line-size cap, not UTF-8, or not JSON
            conv = conversation_from_record(
                record, default_id=f"{path.stem}-{lineno}", source=str(path), categories=categories
            )
            if conv.id in seen:
                raise ValueError(f"field 'id': duplicate id {conv.id!r} (ids must be unique)")
        except ValueError as e:
            problem = f"{path}:{lineno}: {e}"
            if on_error == "stop":
                raise DataError(problem + " (use --on-error skip to skip malformed lines)") from None
            problems.append(problem)
            continue
        seen.add(conv.id)
        conversations.append(conv)
    if not conversations:
        detail = f"; {len(problems)} malformed lines, first: {problems[0]}" if problems else ""
        raise DataError(
            f"{path}: no conversations (expected JSONL lines with 'messages', 'conversations' or 'prompt'){detail}"
        )
    return conversations, problems


def prompt_messages(conv: Conversation) -> list[dict[str, str]]:
    """The prompt for regenerating the first assistant turn: messages before the first assistant reply.

    Multi-turn conversations are cut there: only the first assistant turn is regenerated, later turns are
    dropped (their user messages were written against the original model's answers). Assistant messages that
    come before any user message (ShareGPT's split-off continuation parts start with "gpt") are dropped;
    leading system messages are kept. Raises DataError when no user message precedes the reply.
    """
    out: list[dict[str, str]] = []
    seen_user = False
    for m in conv.messages:
        if m["role"] == "assistant":
            if seen_user:
                break
            continue
        seen_user |= m["role"] == "user"
        out.append({"role": m["role"], "content": m["content"]})
    if not seen_user:
        raise DataError(f"conversation {conv.id!r} ({conv.source}): no user message to prompt with")
    return out


# ---------------------------------------------------------------------------------------------- tokens
def end_of_turn_ids(tokenizer: Any, extra: Any = None) -> list[int]:
    """Token ids that end an assistant turn: the tokenizer's eos, known end-of-turn tokens, and `extra` ids."""
    ids: list[int] = []

    def add(i: Any) -> None:
        if isinstance(i, (list, tuple)):
            for j in i:
                add(j)
        elif i is not None and int(i) >= 0 and int(i) not in ids:
            ids.append(int(i))

    add(getattr(tokenizer, "eos_token_id", None))
    add(extra)
    vocab = tokenizer.get_vocab()
    for tok in END_OF_TURN_TOKENS:
        if tok in vocab:
            add(vocab[tok])
    return ids


def default_stop_token_ids(target: Any) -> list[int]:
    """Where a target's reply ends: the end-of-turn ids of its tokenizer (+ its generation config's eos); the config's
    eos when the target has no tokenizer. `target` is a `dflashkit.target.model.Target`."""
    eos = getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)
    if target.tokenizer is not None:
        return end_of_turn_ids(target.tokenizer, eos)
    eos = eos if eos is not None else getattr(target.text_config, "eos_token_id", None)
    return sorted({int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None})


def render_ids(
    tokenizer: Any,
    messages: list[dict[str, str]],
    *,
    add_generation_prompt: bool,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of the chat template rendered on `messages` (as HF does: no extra special tokens added)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template "
            f"(expected a chat/instruct model)"
        )
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
        )
    except Exception as e:  # jinja's raise_exception (e.g. roles must alternate) and template syntax errors
        roles = "/".join(m["role"] for m in messages)
        raise DataError(f"chat template cannot render roles {roles}: {e}") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompt(
    tokenizer: Any, messages: list[dict[str, str]], chat_template_kwargs: dict[str, Any] | None = None
) -> list[int]:
    """The prompt ids a target generates from: the template with the generation prompt appended."""
    return render_ids(tokenizer, messages, add_generation_prompt=True, chat_template_kwargs=chat_template_kwargs)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def truncate_sample(ids: list[int], mask: list[bool], max_length: int) -> TokenizedSample:
    if max_length < 1:
        raise DataError(f"max_length={max_length}: expected a positive number of tokens")
    truncated = len(ids) > max_length
    return TokenizedSample(ids[:max_length], mask[:max_length], truncated)


def tokenize_for_training(
    tokenizer: Any,
    messages: list[dict[str, str]],
    *,
    max_length: int,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> TokenizedSample:
    """Render `messages` with the chat template; loss mask on assistant content + its end-of-turn token.

    Messages after the last assistant turn are dropped (they carry no supervision), and an assistant message
    that opens the conversation is not supervised (it has no prompt). Raises DataError when the conversation
    has no assistant turn.
    """
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    if last < 0:
        raise DataError("conversation has no assistant message (nothing to supervise)")
    messages = messages[: last + 1]
    kw = chat_template_kwargs
    full = render_ids(tokenizer, messages, add_generation_prompt=False, chat_template_kwargs=kw)
    mask = [False] * len(full)
    stops = set(end_of_turn_ids(tokenizer))
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i == 0:  # a leading assistant message has no prompt: not supervised
            continue
        # Where the model starts writing: the longest shared prefix of (history + generation prompt) and full.
        start = _common_prefix(
            render_ids(tokenizer, messages[:i], add_generation_prompt=True, chat_template_kwargs=kw), full
        )
        # Where the template leaves this turn: the shared prefix of the rendering that ends with this turn.
        upto = render_ids(tokenizer, messages[: i + 1], add_generation_prompt=False, chat_template_kwargs=kw)
        boundary = _common_prefix(upto, full)
        end = next((j + 1 for j in range(start, len(full)) if full[j] in stops), None)
        if end is None or (boundary > start and end > boundary):
            end = boundary if boundary > start else len(full)
        for j in range(start, end):
            mask[j] = True
    return truncate_sample(full, mask, max_length)


def tokenize_regenerated(
    tokenizer: Any,
    prompt: list[dict[str, str]],
    response_token_ids: list[int],
    *,
    max_length: int,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> TokenizedSample:
    """A target transcript as a training sample: prompt ids (unsupervised) + the generated ids (supervised).

    `response_token_ids` are exactly what the target generated, including the stop token when it finished;
    using them (rather than re-tokenising the decoded text) keeps the target's own tokenisation.
    """
    prompt_ids = encode_prompt(tokenizer, prompt, chat_template_kwargs)
    ids = prompt_ids + [int(t) for t in response_token_ids]
    mask = [False] * len(prompt_ids) + [True] * len(response_token_ids)
    return truncate_sample(ids, mask, max_length)
