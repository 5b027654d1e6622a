"""Shared pieces of the bad-input tests (tests/commands/test_bad_input*.py): token lines, a re-capture, and the check
that a CLI error is exactly one line with no traceback. The `captured` fixture is in tests/commands/conftest.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

from dflashkit.features.capture import CaptureSettings, capture

DRAFTER = {"num_hidden_layers": 1, "block_size": 4}
LAYERS = [1, 4, 6]
DEAD_PID = 99_999_999  # above any pid_max: never a running process
CHAT_OK = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
PROMPT_OK = json.dumps({"id": "p1", "prompt_ids": [3, 4, 5]})
FAKE_TARGET = SimpleNamespace(
    vocab_size=97, tokenizer=None, source="fake", text_config=SimpleNamespace(max_position_embeddings=512)
)


def _one_line_error(capsys, rc: int, expect_rc: int = 2) -> str:
    """The CLI exited with `expect_rc` and printed exactly one error line, no traceback; returns it."""
    err = capsys.readouterr().err
    assert rc == expect_rc, err
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.strip() and "%|" not in x]  # minus progress bars
    assert len(lines) == 1, lines
    return lines[0]


def _tokens_line(i: int, n: int = 14, prompt: int = 10, vocab: int = 97) -> str:
    ids = [(7 * i + 3 * k) % (vocab - 3) + 3 for k in range(n)]
    return json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": [0] * prompt + [1] * (n - prompt)})


def _recapture(target, samples, out, **kw) -> list[str]:
    logs: list[str] = []
    settings = CaptureSettings(layer_ids=LAYERS, dtype="fp32", **kw)
    capture(target, samples, out, log=logs.append, progress=False, settings=settings)
    return logs
