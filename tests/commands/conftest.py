"""Fixtures of the command-level tests: a small captured feature directory of the tiny Llama target."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashkit.data.samples import Sample, read_tokens
from dflashkit.features.capture import CaptureSettings, capture
from helpers.bad_input import LAYERS, _tokens_line


@pytest.fixture()
def captured(target, tmp_path) -> tuple[Path, list[Sample], dict[str, bytes]]:
    path = tmp_path / "tokens.jsonl"
    path.write_text("".join(_tokens_line(i, n=14 + i) + "\n" for i in range(3)))
    samples, _ = read_tokens(path)
    out = tmp_path / "feats"
    capture(
        target,
        samples,
        out,
        log=None,
        progress=False,
        settings=CaptureSettings(layer_ids=LAYERS, dtype="fp32", shard_max_tokens=16),
    )
    return out, samples, {p.name: p.read_bytes() for p in out.glob("shard-*")}
