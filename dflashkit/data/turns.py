"""Which assistant turns regeneration rewrites, the state of one conversation while the target rewrites them, and
multi-turn transcripts as training samples.

    state = TurnState(conv, turns="all", thinking="off")
    while (prompt := state.next_prompt(tokenizer, kwargs, max_prompt_length)) is not None:
        ids, text, finished = <the target's reply to prompt>
        state.add_reply(ids, text, finished)
    record = state.record(settings)           # one line of regenerated.jsonl

Turns (`--turns`):
  first  the reply to the messages before the first assistant turn (system + user); later turns are dropped — their
         user messages were written against another model's answers. The record keeps `response_token_ids`.
  all    every run of non-assistant messages that holds a user message gets a reply, in order; the target's own
         earlier replies are the context of the next user turn. Original assistant messages are all replaced (a
         leading assistant message, with no prompt, is dropped). The record keeps `turn_token_ids` (one id list per
         regenerated turn). A turn whose context would pass the prompt-length limit ends the conversation there
         (earlier turns are kept); a reply cut at the length cap stays in the history as generated (the record's
         `finished` is then false) and the next user turn follows it.
Thinking (`--thinking`, reasoning models with an `enable_thinking` chat template switch):
  off    the template's switch off.
  on     the switch on; the reasoning (the text before `</think>`) is saved in the record's `reasoning` list and left
         out of the trained sample, which is the template's rendering of the answers (what the history shows).
  keep   the switch on and the reasoning stays in the trained response (the ids the target generated) — a drafter
         that serves a thinking model drafts its reasoning too.

`tokenize_turns` turns a multi-turn transcript into samples made of exactly the ids the target saw and wrote: turn k's
context (the template on the history, with the generation prompt) followed by its reply ids. When every context
starts with the previous context + reply (ChatML templates, with a canonical tokenisation), one sample supervises
every reply; otherwise (a template that rewrites history, e.g. strips reasoning) each turn is its own sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflashkit.data.conversations import Conversation, TokenizedSample, encode_prompt, prompt_messages, truncate_sample
from dflashkit.data.thinking import THINKING_MODES, split_reasoning
from dflashkit.errors import DataError

TURN_MODES = ("first", "all")


def turn_segments(conv: Conversation, turns: str) -> list[list[dict[str, str]]]:
    """The messages that precede each reply to regenerate (see the module docstring); [] when nothing can be."""
    if turns == "first":
        try:
            return [prompt_messages(conv)]
        except DataError:
            return []
    if turns != "all":
        raise DataError(f"turns={turns!r}: expected one of {list(TURN_MODES)}")
    segments: list[list[dict[str, str]]] = []
    current: list[dict[str, str]] = []
    for m in conv.messages:
        if m["role"] == "assistant":
            if any(x["role"] == "user" for x in current):
                segments.append(current)
                current = []
            continue  # original replies are replaced; a reply without a user message before it is dropped
        current.append({"role": m["role"], "content": m["content"]})
    if any(x["role"] == "user" for x in current):
        segments.append(current)
    return segments


@dataclass
class TurnState:
    """One conversation while its turns are regenerated."""

    conv: Conversation
    turns: str = "first"
    thinking: str | None = None
    segments: list[list[dict[str, str]]] = field(init=False)
    history: list[dict[str, str]] = field(default_factory=list)
    turn_ids: list[list[int]] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    finished: bool = True
    stopped: str | None = None  # why the conversation ended before its last segment (a context too long)

    def __post_init__(self) -> None:
        if self.thinking is not None and self.thinking not in THINKING_MODES:
            raise DataError(f"thinking={self.thinking!r}: expected one of {list(THINKING_MODES)}")
        self.segments = turn_segments(self.conv, self.turns)

    @property
    def done(self) -> bool:
        return self.stopped is not None or len(self.turn_ids) >= len(self.segments)

    def next_prompt(
        self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None, max_prompt_length: int | None
    ) -> list[int] | None:
        """Prompt ids of the next reply, or None when the conversation is done."""
        if self.done:
            return None
        context = [*self.history, *self.segments[len(self.turn_ids)]]
        ids = encode_prompt(tokenizer, context, chat_template_kwargs)
        if max_prompt_length is not None and len(ids) >= max_prompt_length:
            self.stopped = f"prompt has {len(ids)} tokens ≥ max length {max_prompt_length}"
            return None
        self.history = context
        return ids

    def add_reply(self, ids: list[int], text: str, finished: bool) -> None:
        """Record the target's reply (ids incl. the stop token when finished) to the last prompt."""
        reasoning, answer = split_reasoning(text) if self.thinking == "on" else ("", text)
        self.history.append({"role": "assistant", "content": answer})
        self.turn_ids.append([int(t) for t in ids])
        self.reasoning.append(reasoning)
        if not finished:  # cut at the length cap: kept as generated, the conversation goes on
            self.finished = False

    def record(self, settings: dict[str, Any]) -> dict[str, Any]:
        """The regenerated.jsonl line of this conversation (call when done and at least one turn was written)."""
        rec: dict[str, Any] = {"id": self.conv.id, "messages": self.history}
        if self.turns == "first":
            rec["response_token_ids"] = self.turn_ids[0]
        else:
            rec["turn_token_ids"] = self.turn_ids
        if self.thinking == "on":
            rec["reasoning"] = self.reasoning
        rec["finished"] = self.finished
        rec["generation"] = settings
        return rec


def tokenize_turns(
    tokenizer: Any,
    messages: list[dict[str, str]],
    turn_token_ids: list[list[int]],
    *,
    max_length: int,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[TokenizedSample]:
    """Samples of a multi-turn transcript (see the module docstring): one that supervises every reply when the
    contexts chain, else one per turn. `messages` end with the last regenerated reply."""
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(replies) != len(turn_token_ids) or not replies:
        raise DataError(
            f"{len(replies)} assistant messages but {len(turn_token_ids)} turn id lists: expected one per reply"
        )
    contexts = [encode_prompt(tokenizer, messages[:i], chat_template_kwargs) for i in replies]
    chained = all(
        contexts[k + 1][: len(contexts[k]) + len(turn_token_ids[k])] == contexts[k] + turn_token_ids[k]
        for k in range(len(replies) - 1)
    )
    if chained:
        ids = contexts[-1] + turn_token_ids[-1]
        mask = [False] * len(ids)
        for ctx, reply in zip(contexts, turn_token_ids, strict=True):
            for j in range(len(ctx), len(ctx) + len(reply)):
                mask[j] = True
        return [truncate_sample(ids, mask, max_length)]
    return [
        truncate_sample(ctx + reply, [False] * len(ctx) + [True] * len(reply), max_length)
        for ctx, reply in zip(contexts, turn_token_ids, strict=True)
    ]


__all__ = ["TURN_MODES", "TurnState", "tokenize_turns", "turn_segments"]
