"""How far back a drafter reads, and what to warn about when it drafts after longer contexts.

    context_warnings(drafter.config, context_tokens=6000)   # → ["sliding-window layers see the last 2048 …", …]
    smallest_window(drafter.config)                          # → 2048, or None when no layer is windowed

Two limits matter when a drafter drafts after a long prompt:

- **Sliding-window layers** (`layer_types` "sliding_attention", `sliding_window` W) attend to the last W positions
  only, in training and in decoding alike, so beyond W tokens such a layer sees what it saw in training; but an
  engine that runs the layer as full attention (vLLM before its drafter sliding-window support) gives it the whole
  context — a distribution it never trained on. Full-attention layers always read the whole context.
- **The longest training context** (`train_context`, recorded at training: the longest training sample, cut to
  `max_tokens` — a block never reads another document of its row): a drafter whose full-attention layers never
  read a context longer than that usually accepts less beyond it.

Both warnings are facts about the drafter and the context length, not a measurement: `eval --dataset long-context`
measures τ per context length.
"""

from __future__ import annotations

from dflashkit.drafter.config import DrafterConfig


def trained_context(cfg: DrafterConfig) -> int | None:
    """The longest context the drafter was trained on, when its training recorded it."""
    value = cfg.extra.get("train_context")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def smallest_window(cfg: DrafterConfig) -> int | None:
    """The narrowest sliding window among the drafter's layers (None: every layer attends to the whole context)."""
    return min((w for i in range(cfg.num_hidden_layers) if (w := cfg.layer_window(i)) is not None), default=None)


def context_warnings(cfg: DrafterConfig, context_tokens: int) -> list[str]:
    """The reasons to expect less acceptance after `context_tokens` tokens of context (empty: none known)."""
    out = []
    window = smallest_window(cfg)
    if window is not None and context_tokens > window:
        out.append(
            f"contexts of {context_tokens} tokens exceed the drafter's sliding window of {window}: its sliding "
            f"layers read the last {window} positions (as in training) only where the engine honours the window "
            f"(docs/evaluation.md#long-context)"
        )
    full = [i for i in range(cfg.num_hidden_layers) if cfg.layer_window(i) is None]
    trained = trained_context(cfg)
    if trained is not None and full and context_tokens > trained:
        out.append(
            f"contexts of {context_tokens} tokens exceed the longest training context ({trained} tokens): its "
            f"full-attention layers never read a context this long — measure with `dflashkit eval --dataset "
            f"long-context`, train on longer samples and rows or with a sliding-window layer"
        )
    return out


__all__ = ["context_warnings", "trained_context"]
