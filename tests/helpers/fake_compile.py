"""torch.compile replaced by a stand-in for the compile-choice tests: the compiled target layers' calls counted, and
failing on demand with `error`'s text; the choices' store in a test directory (the cache, store on, the kind's override
removed); the target's compiled forwards made
anew before and after (they are kept per target)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.choices import set_choice


@contextmanager
def fake_layer_compile(
    target: Any, monkeypatch: pytest.MonkeyPatch, store: Path, name: str, error: str
) -> Iterator[tuple[list[int], Any]]:
    """Yields (calls, set_fail): one entry in `calls` per compiled layer call; `set_fail(True)` makes them raise."""
    _forget_compiled(target)
    monkeypatch.setenv("DFLASHKIT_CACHE", str(store))
    set_choice(monkeypatch, "store", None)
    set_choice(monkeypatch, name, None)
    calls: list[int] = []
    state = {"fail": False}

    def fake(forward, **kw):
        assert kw == {"dynamic": True}

        def run(*args, **kwargs):
            calls.append(1)
            if state["fail"]:
                raise RuntimeError(error)
            return forward(*args, **kwargs)

        return run

    monkeypatch.setattr(torch, "compile", fake)
    try:
        yield calls, lambda v: state.update(fail=v)
    finally:
        _forget_compiled(target)


def _forget_compiled(target: Any) -> None:
    """The target's compiled forwards and the decoding keys this process compiled: made anew."""
    target.__dict__.pop("_compiled_layer_forwards", None)
    target.__dict__.pop("_decode_compiled_keys", None)
