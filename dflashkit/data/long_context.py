"""Long-context prompts built offline for one target: chats with their earlier turns as context, and source files of
installed Python packages as code context with a task, each cut to a prompt length in tokens.

    prompts = long_context_prompts(tokenizer, LongContextSpec(lengths=(512, 1024, 2048), per_length=6))
    prompts[0].ids, prompts[0].category, prompts[0].length   # token ids, "chat", 512
    convs = long_context_conversations(tokenizer, LongContextSpec(split="train"))   # training data (`prepare`)

Per length N (capped by `max_tokens`, the target's context minus the tokens to generate), `per_length` prompts in a
fixed rotation of three kinds, each rendered with the target's chat template and ending in the generation prompt:

- `chat`: a ShareGPT conversation (all its `_<part>` pieces joined in order) up to one of its user turns; the
  earliest turns are dropped until the rendered prompt fits N, and the turn kept is the one that comes closest to N
  from below (more than half of N, else the conversation is not used for N).
- `code-explain` / `code-continue`: the first tokens of a large source file of an installed package (below), inside
  a Python code block, then "Explain what this code does…" / "Continue this file…"; the code is cut, at a token
  boundary, so that the whole prompt is N tokens (± a few where the cut text re-tokenises differently).

Two splits that share nothing: `heldout` (the `long-context` evaluation set: held-out ShareGPT chats, which never
reach training — data/datasets.py — and EVAL_CODE_FILES) and `train` (`long-context-train`, training data for
long contexts: training-split chats and TRAIN_CODE_FILES). A training chat is one user message holding the earlier
turns as a transcript and then the last question, so that `prepare` regenerates the reply to the last question
with the whole chat before it (its first-turn regeneration reads the messages before the first reply only).

Everything comes from files already installed — nothing is downloaded — and the choice is deterministic: the same
target, spec and installed package versions give the same prompts (progress.jsonl and a transcript cache keep each
prompt's token digest), in rounds over the lengths (the first prompt of every length, then the second, …). Each
prompt's `length` is the N it was built for and its `ids` may be shorter; evaluation buckets prompts by their actual
length (evaluate/groups.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflashkit.data.conversations import Conversation, encode_prompt
from dflashkit.data.datasets import load_sharegpt, package_file
from dflashkit.errors import DataError

NAME, TRAIN_NAME = "long-context", "long-context-train"  # the dataset names eval / simulate and prepare know
EVAL_CODE_FILES = (  # (package, file): large, stable sources of pinned packages, located without importing them
    ("torch", "nn/functional.py"),
    ("transformers", "modeling_utils.py"),
    ("torch", "nn/modules/module.py"),
    ("transformers", "generation/utils.py"),
    ("numpy", "_core/fromnumeric.py"),
    ("pydantic", "main.py"),
    ("tqdm", "std.py"),
    ("yaml", "constructor.py"),
)
TRAIN_CODE_FILES = (
    ("transformers", "trainer.py"),
    ("matplotlib", "axes/_axes.py"),
    ("numpy", "lib/_function_base_impl.py"),
    ("transformers", "tokenization_utils_base.py"),
    ("torch", "serialization.py"),
    ("pydantic", "fields.py"),
    ("torch", "nn/modules/conv.py"),
    ("matplotlib", "figure.py"),
)
TASKS = {
    "code-explain": "Explain what this code does: its main parts and how they fit together.",
    "code-continue": "Continue this file from where it stops, in the same style.",
}
KINDS = ("chat", "code-explain", "code-continue")


@dataclass(frozen=True)
class LongContextSpec:
    """lengths: prompt lengths in tokens; per_length: prompts per length (the kinds in rotation); max_tokens: the
    longest prompt the target can take (lengths above it are cut to it; None: no cap), and max_tokens_why: where
    that cap comes from, for messages ("the target's 512 positions minus 256 new tokens"); split: "heldout" (the
    evaluation set) or "train"."""

    lengths: Sequence[int] = (512, 1024, 2048, 4096, 8192)
    per_length: int = 6
    max_tokens: int | None = None
    split: str = "heldout"
    max_tokens_why: str = ""

    def targets(self) -> list[int]:
        """The lengths to build, capped by max_tokens, each once, ascending."""
        cap = self.max_tokens if self.max_tokens is not None else max(self.lengths)
        return sorted({min(int(n), cap) for n in self.lengths if min(int(n), cap) >= 64})


@dataclass(frozen=True)
class LongPrompt:
    id: str
    ids: list[int]
    category: str  # "chat" | "code-explain" | "code-continue"
    length: int  # the length it was built for


def long_context_prompts(
    tokenizer: Any, spec: LongContextSpec, chat_template_kwargs: dict[str, Any] | None = None
) -> list[LongPrompt]:
    """The long-context prompt set of `spec` for a target's tokenizer (one with a chat template)."""
    return [
        LongPrompt(c.id, c.meta["ids"], c.meta["category"], c.meta["length"])
        for c in long_context_conversations(tokenizer, spec, chat_template_kwargs)
    ]


def long_context_conversations(
    tokenizer: Any, spec: LongContextSpec, chat_template_kwargs: dict[str, Any] | None = None
) -> list[Conversation]:
    """The same set as conversations (a user turn last; meta: category, length, and the prompt's `ids`), e.g. for
    `prepare` to regenerate the target's replies to them."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{NAME}: the target has no tokenizer with a chat template to render the prompts with")
    if spec.per_length < 1:
        raise DataError(f"{NAME}: per_length = {spec.per_length}: expected a positive number of prompts")
    if spec.split not in ("heldout", "train"):
        raise DataError(f"{NAME}: split {spec.split!r}: expected 'heldout' or 'train'")
    lengths = spec.targets()
    if not lengths:
        why = f" = {spec.max_tokens_why}" if spec.max_tokens_why else ""
        raise DataError(
            f"{NAME}: no length ≥ 64 tokens fits (lengths {list(spec.lengths)}; the cap is {spec.max_tokens} "
            f"tokens{why})"
        )
    render = _Renderer(tokenizer, chat_template_kwargs)
    chats = _chats(spec.split)
    files = EVAL_CODE_FILES if spec.split == "heldout" else TRAIN_CODE_FILES
    used_chats: set[str] = set()
    per_length: list[list[Conversation]] = []
    for n in lengths:
        built: list[Conversation] = []
        code_index = 0
        for k in range(spec.per_length):
            kind = KINDS[k % len(KINDS)]
            if kind == "chat":
                found = _chat_prompt(render, chats, n, used_chats, flatten=spec.split == "train")
                if found is None:  # no unused chat is long enough: code context instead
                    kind = KINDS[1 + k % 2]
                else:
                    conv, ids = found
                    used_chats.add(conv.id)
                    meta = {"category": "chat", "length": n, "ids": ids}
                    built.append(Conversation(conv.messages, f"long-{n}-{k}-chat-{conv.id}", NAME, meta))
                    continue
            package, rel = files[code_index % len(files)]
            code_index += 1
            messages, ids = _code_prompt(render, package, rel, TASKS[kind], n)
            meta = {"category": kind, "length": n, "ids": ids}
            built.append(Conversation(messages, f"long-{n}-{k}-{kind}-{package}-{Path(rel).stem}", NAME, meta))
        per_length.append(built)
    # the k-th prompt of every length, then the next: a run cut short (a time budget, --limit) covers every length
    return [c for k in range(spec.per_length) for built in per_length for c in built[k : k + 1]]


class _Renderer:
    """Token ids of a message list through the target's chat template (generation prompt appended)."""

    def __init__(self, tokenizer: Any, kwargs: dict[str, Any] | None) -> None:
        self.tok, self.kwargs = tokenizer, kwargs

    def ids(self, messages: list[dict[str, str]]) -> list[int]:
        return encode_prompt(self.tok, messages, self.kwargs)

    def text_tokens(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------------------------------------- chats
def _chats(split: str) -> list[Conversation]:
    """ShareGPT conversations of a split, the `_<part>` pieces of one chat joined in order (longest contexts)."""
    joined: dict[str, list[tuple[int, Conversation]]] = {}
    for conv in load_sharegpt(split):  # type: ignore[arg-type]
        rid, _, dup = conv.id.partition(".")  # a repeated id's ".N" (another record): another chat
        base, _, part = rid.rpartition("_")
        key = (base or rid) + (f".{dup}" if dup else "")
        joined.setdefault(key, []).append((int(part) if part.isdigit() else 0, conv))
    out = []
    for key, parts in joined.items():
        messages = [m for _, conv in sorted(parts, key=lambda x: x[0]) for m in conv.messages if m["role"] != "system"]
        out.append(Conversation(messages, key, f"sharegpt:{split}"))
    return out


def _flattened(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """One user message: the earlier turns as a transcript, then the last (user) message."""
    earlier = "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages[:-1])
    if not earlier:
        return [dict(messages[-1])]
    return [{"role": "user", "content": f"Our conversation so far:\n\n{earlier}\n\nNow: {messages[-1]['content']}"}]


def _chat_prompt(
    render: _Renderer, chats: list[Conversation], n: int, used: set[str], flatten: bool = False
) -> tuple[Conversation, list[int]] | None:
    """The first unused chat that gives a prompt of n/2 … n tokens: the longest one up to a user turn, its
    earliest turns dropped to fit (`flatten`: as one user message). Returns (the chat cut to that prompt, its ids)."""
    for conv in chats:
        if conv.id in used:
            continue
        best: tuple[list[dict[str, str]], list[int]] | None = None
        users = [i for i, m in enumerate(conv.messages) if m["role"] == "user"]
        for u in reversed(users):
            start = 0
            while start <= u:
                msgs = conv.messages[start : u + 1]
                if msgs[0]["role"] != "user":
                    start += 1
                    continue
                msgs = _flattened(msgs) if flatten else msgs
                ids = render.ids(msgs)
                if len(ids) <= n:
                    if best is None or len(ids) > len(best[1]):
                        best = (msgs, ids)
                    break
                start += 1
            if best is not None and (len(best[1]) >= n * 0.9 or (u == users[-1] and len(best[1]) <= n // 2)):
                break  # close enough, or the whole chat is too short (an earlier turn gives less)
        if best is not None and len(best[1]) > n // 2:
            return Conversation(best[0], conv.id, conv.source), best[1]
    return None


# ---------------------------------------------------------------------------------------------- code
def _code_prompt(
    render: _Renderer, package: str, relative: str, task: str, n: int
) -> tuple[list[dict[str, str]], list[int]]:
    """The file's first tokens in a code block, then the task, cut so that the prompt is about n tokens.
    Returns (the one user message, its token ids)."""
    path = package_file(package, relative)
    code = render.text_tokens(path.read_text(encoding="utf-8"))

    def prompt(k: int) -> tuple[list[dict[str, str]], list[int]]:
        text = f"Here is the start of `{package}/{relative}`:\n\n```python\n{render.text(code[:k])}\n```\n\n{task}"
        messages = [{"role": "user", "content": text}]
        return messages, render.ids(messages)

    k = max(0, n - len(prompt(0)[1]))
    messages, ids = prompt(k)
    while len(ids) > n and k > 0:  # the cut text re-tokenised longer: cut by the excess
        k = max(0, k - (len(ids) - n))
        messages, ids = prompt(k)
    if k == 0:
        raise DataError(f"{NAME}: a prompt of {n} tokens leaves no room for code (the task alone takes {len(ids)})")
    return messages, ids


__all__ = [
    "EVAL_CODE_FILES",
    "NAME",
    "TRAIN_CODE_FILES",
    "TRAIN_NAME",
    "LongContextSpec",
    "LongPrompt",
    "long_context_conversations",
    "long_context_prompts",
]
