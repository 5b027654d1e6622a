"""The target's log-sum-exp over its whole vocabulary at every position of a packed row, computed once per row.

    cache = RowLogSumExp()
    lse = cache.rows(target, final_hidden, input_ids, doc_ids)       # (B, T) float32
    p_draft_vocab = exp(final_norm(h) · W[draft ids]ᵀ − lse)          # the target's probabilities of the draft ids

A DSpark drafter with a reduced draft vocabulary (V' of the target's V ids) needs, at each supervised slot, the
target's probabilities of the V' draft ids and the mass outside them. Both follow from the logits of those V' ids
and the log-sum-exp over all V — and only the log-sum-exp needs all V logits. It depends on the row alone (the
target's final-layer output stored in the features), so it is computed once per row, the first time the row is
met, and kept: every later epoch's step forms only V' logits per position (SmolLM2 with 8,192 draft ids: 1/6 of
the target's head). A row is keyed by its content (a 128-bit hash of its token ids and document ids: the features
of a row are a function of them), so training and validation rows never mix. The cache holds at most
`max_positions` positions (least recently used rows leave first; 4 bytes each), so any corpus stays bounded in
memory.

The log-sum-exp of a row is always computed the same way (the whole row, `chunk` positions at a time), so a
resumed run, whose cache starts empty, gets bit-identical values. Features captured with `--target-lse` carry it
per position (`Sample.target_lse`, computed at capture from the final-layer state as stored); training then reads
it from the rows and never fills this cache (`dflashkit.train.step`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

from dflashkit.target.logsumexp import row_logsumexp

DEFAULT_MAX_POSITIONS = 1 << 26  # 64 M positions: 256 MiB of float32


class RowLogSumExp:
    """Per-row log-sum-exp of the target's logits, computed on first sight and kept (LRU, `max_positions`)."""

    def __init__(self, max_positions: int = DEFAULT_MAX_POSITIONS) -> None:
        self.max_positions = max_positions
        self._rows: OrderedDict[bytes, Tensor] = OrderedDict()
        self._positions = 0
        self.computed = 0  # rows computed (a cache miss each)

    def __len__(self) -> int:
        return len(self._rows)

    @staticmethod
    def _key(input_ids: Tensor, doc_ids: Tensor) -> bytes:
        h = hashlib.blake2b(input_ids.cpu().numpy().tobytes(), digest_size=16)
        h.update(doc_ids.cpu().numpy().tobytes())
        return h.digest()

    def rows(self, target: Any, final_hidden: Tensor, input_ids: Tensor, doc_ids: Tensor) -> Tensor:
        """(B, T) float32 log-sum-exp for a batch of rows: final_hidden (B, T, H), input_ids / doc_ids (B, T)."""
        out = []
        for i in range(final_hidden.shape[0]):
            key = self._key(input_ids[i], doc_ids[i])
            lse = self._rows.get(key)
            if lse is None:
                lse = row_logsumexp(target, final_hidden[i])
                self.computed += 1
                self._rows[key] = lse
                self._positions += lse.numel()
                while self._positions > self.max_positions and len(self._rows) > 1:
                    _, old = self._rows.popitem(last=False)
                    self._positions -= old.numel()
            else:
                self._rows.move_to_end(key)
            out.append(lse.to(final_hidden.device))
        return torch.stack(out)


__all__ = ["DEFAULT_MAX_POSITIONS", "RowLogSumExp", "row_logsumexp"]
