"""Training samples: the unit that flows from `prepare` (tokens) through `capture` (features) into training.

`tokens.jsonl` (written by `dflashkit prepare`) holds one JSON object per line:
    {"id": str, "input_ids": [int, …], "loss_mask": [0/1, …]}
A `Sample` is one such sequence plus, once captured (or computed online), the target's features for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from dflashkit.errors import DataError


@dataclass
class Sample:
    """One tokenised sequence. T tokens, K target layers, H hidden."""

    id: str
    input_ids: Tensor                    # (T,) long
    loss_mask: Tensor                    # (T,) bool — True on supervised (assistant) tokens
    features: Tensor | None = None       # (T, K·H) target layer outputs (None until captured / computed online)
    target_tokens: Tensor | None = None  # (T,) long — target's final-layer argmax at each position (predicts t+1)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_supervised(self) -> int:
        return int(self.loss_mask.sum())


def read_tokens(path: str | Path, *, on_error: str = "stop") -> tuple[list[Sample], list[str]]:
    """Read `tokens.jsonl`; returns (samples, problems). on_error="stop" raises on the first bad line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found (expected tokens.jsonl written by `dflashkit prepare`)")
    samples: list[Sample] = []
    problems: list[str] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ids, mask = rec["input_ids"], rec["loss_mask"]
                if len(ids) != len(mask):
                    raise ValueError(f"input_ids has {len(ids)} entries but loss_mask has {len(mask)}")
                if not ids:
                    raise ValueError("empty input_ids")
                samples.append(Sample(id=str(rec.get("id", f"{path.name}:{lineno}")),
                                      input_ids=torch.tensor(ids, dtype=torch.long),
                                      loss_mask=torch.tensor(mask, dtype=torch.bool)))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                msg = f"{path}:{lineno}: malformed tokens record ({type(e).__name__}: {e}); expected " \
                      f'{{"id", "input_ids": [int], "loss_mask": [0/1]}} of equal length'
                if on_error == "stop":
                    raise DataError(msg) from None
                problems.append(msg)
    if not samples:
        raise DataError(f"{path}: no samples (empty dataset)")
    return samples, problems
