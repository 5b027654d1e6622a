"""Training samples: the unit that flows from `prepare` (tokens) through `capture` (features) into training.

`tokens.jsonl` (written by `dflashkit prepare`) holds one JSON object per line:
    {"id": str, "input_ids": [int, …], "loss_mask": [0/1, …]}
A `Sample` is one such sequence plus, once captured (or computed online), the target's features for it — and,
when captured with `--topk K` (or online with `store_topk`), the target's top-K log-probs per position for the
`loss: topk` objective (`topk_logprobs[i]` is the target's distribution over the token at i+1, like
`target_tokens[i]`); when captured with `--target-lse`, the log-sum-exp of the target's logits at each position
(what a DSpark drafter with a reduced draft vocabulary needs to turn a subset of the logits into probabilities).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from dflashkit.data.jsonl import LineProblem, read_lines
from dflashkit.errors import DataError


@dataclass
class Sample:
    """One tokenised sequence. T tokens, K target layers, H hidden."""

    id: str
    input_ids: Tensor  # (T,) long
    loss_mask: Tensor  # (T,) bool — True on supervised (assistant) tokens
    features: Tensor | None = None  # (T, K·H) target layer outputs (None until captured / computed online)
    target_tokens: Tensor | None = None  # (T,) long — target's final-layer argmax at each position (predicts t+1)
    origin: str | None = None  # "file:line" it was read from, for error messages (None: unknown)
    topk_ids: Tensor | None = None  # (T, K) long — the target's K most likely next tokens at each position
    topk_logprobs: Tensor | None = None  # (T, K) float32 — their log-probs under the full softmax, descending
    target_lse: Tensor | None = None  # (T,) float32 — log Σ_v exp(target logit_v) at each position

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_supervised(self) -> int:
        return int(self.loss_mask.sum())


def read_tokens(path: str | Path, *, on_error: str = "stop") -> tuple[list[Sample], list[str]]:
    """Read `tokens.jsonl`; returns (samples, problems). on_error="stop" raises on the first bad line.

    Lines are read through `dflashkit.data.jsonl` (size cap, UTF-8 check); a sample id seen on an earlier line is a
    bad line (the first one is kept). Each sample remembers its "file:line" in `origin`, so later checks (e.g. token
    ids against the target's vocabulary: `check_token_ids`) can name it."""
    path = Path(path)
    if not path.is_file():
        found = "is a directory" if path.is_dir() else "file not found"
        raise DataError(f"{path}: {found} (expected tokens.jsonl written by `dflashkit prepare`)")
    samples: list[Sample] = []
    problems: list[str] = []
    first_line: dict[str, int] = {}  # sample id → the line that holds it (ids must be unique)
    for line in read_lines(path):
        try:
            rec = line.json()
            if not isinstance(rec, dict):
                raise TypeError(f"expected a JSON object, got {type(rec).__name__}")
            ids, mask = _int_list(rec, "input_ids"), _int_list(rec, "loss_mask")
            if len(ids) != len(mask):
                raise ValueError(f"input_ids has {len(ids)} entries but loss_mask has {len(mask)}")
            if not len(ids):
                raise ValueError("empty input_ids")
            if bool(((mask != 0) & (mask != 1)).any()):
                raise ValueError("loss_mask holds values other than 0 and 1")
            sid = str(rec.get("id", f"{path.name}:{line.number}"))
            if sid in first_line:
                raise LineProblem(
                    f"field 'id': duplicate id {sid!r} (line {first_line[sid]} has it too; ids must be unique — "
                    f"were two files concatenated? a repeated sample could land in training and in validation)"
                )
            first_line[sid] = line.number
            samples.append(
                Sample(
                    id=sid,
                    input_ids=ids,
                    loss_mask=mask.bool(),
                    origin=f"{path}:{line.number}",
                )
            )
        except (KeyError, TypeError, ValueError) as e:
            msg = f"{path}:{line.number}: " + (
                str(e)
                if isinstance(e, LineProblem)
                else f"malformed tokens record ({type(e).__name__}: {e}); expected "
                f'{{"id", "input_ids": [int], "loss_mask": [0/1]}} of equal length'
            )
            if on_error == "stop":
                raise DataError(msg) from None
            problems.append(msg)
    if not samples:
        raise DataError(f"{path}: no samples (empty dataset)")
    return samples, problems


def _int_list(rec: dict, name: str) -> Tensor:
    """rec[name] as a 1-D long tensor; ValueError unless it is a flat list of integers."""
    value = rec[name]
    if not isinstance(value, list):
        raise TypeError(f"field '{name}': expected a list of integers, got {type(value).__name__}")
    try:
        t = torch.tensor(value) if value else torch.zeros(0, dtype=torch.long)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise ValueError(f"field '{name}': expected a list of integers") from None
    if t.dim() != 1 or t.dtype not in (torch.int64, torch.bool):
        raise ValueError(f"field '{name}': expected a flat list of integers")
    return t.long()


def check_token_ids(samples: Sequence[Sample], vocab_size: int, *, what: str = "the target") -> None:
    """Raise DataError naming the sample (and its file:line) whose input_ids fall outside [0, vocab_size)."""
    for s in samples:
        ids = s.input_ids
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            bad = ((ids < 0) | (ids >= vocab_size)).nonzero()[0].item()
            where = f"{s.origin}: " if s.origin else ""
            raise DataError(
                f"{where}sample {s.id!r}: input_ids[{bad}] = {int(ids[bad])} is not a token id of "
                f"{what} (expected 0 ≤ id < {vocab_size}, its vocabulary size); were these tokens made "
                f"with another tokenizer?"
            )
