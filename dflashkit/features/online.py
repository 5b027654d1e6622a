"""Target features computed online: the interface of `dflashkit.features.captured.CapturedFeatures`, nothing stored.

    OnlineFeatures(target, samples, layer_ids=ids)[i]   # → Sample with the target's features and argmax tokens
    OnlineFeatures(target, samples, layer_ids=ids, store_topk=32)[i]   # … and its top-32 log-probs per position
    OnlineFeatures(target, samples, layer_ids=ids, store_target_lse=True)[i]   # … and the log-sum-exp of its logits

The features are those of `Target.forward` (outputs of the decoder layers
`layer_ids`, final-layer argmax), exactly what `dflashkit.features.capture.capture` stores.

Top-k log-probs (`topk_logprobs`): per position, the k largest entries of log_softmax over the FULL vocabulary of
the verifier logits (final layer → final norm → LM head), sorted descending, with their token ids. Computed in
float32 and rounded to float16 — the precision `capture` stores them in, so online and captured training see the
same targets. float16 is ample for log-probs: its relative spacing is ≤ 2^-10, so a log-prob ℓ is off by at most
|ℓ|·2^-11 — a relative error under 0.025 % in a probability ≥ e^-1 and 0.4 % in one ≥ e^-16 (≈ 1e-7, negligible
mass), far below what separates a good draft from a bad one (tests/train/test_topk_loss.py measures the KL it shifts);
values below −65504 (probability 0 even in float32) would become −inf, which the loss reads as a dropped entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dflashkit.data.samples import Sample, check_token_ids

if TYPE_CHECKING:
    from dflashkit.target.model import Target

TOPK_STORE_DTYPE = torch.float16
_TOPK_CHUNK = 1 << 24  # logits per chunk when taking log_softmax (64 MiB in float32)


def topk_logprobs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """logits (…, T, V) → (ids (…, T, k) long, log-probs (…, T, k) float16): `log_softmax(logits.float()).topk(k)`
    over the whole vocabulary, in row chunks so the float32 copy of the logits never exists at once."""
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"top-k: k must be in [1, {logits.shape[-1]}] (the vocabulary size), got {k}")
    flat = logits.reshape(-1, logits.shape[-1])  # (R, V)
    step = max(1, _TOPK_CHUNK // logits.shape[-1])
    vals, ids = [], []
    for r in range(0, flat.shape[0], step):
        v, i = torch.log_softmax(flat[r : r + step].float(), dim=-1).topk(k, dim=-1)  # sorted, descending
        vals.append(v.to(TOPK_STORE_DTYPE))
        ids.append(i)
    shape = (*logits.shape[:-1], k)
    if not vals:
        return torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=TOPK_STORE_DTYPE)
    return torch.cat(ids).view(shape), torch.cat(vals).view(shape)


class OnlineFeatures:
    """Same interface as CapturedFeatures, but runs the target at access time and stores nothing.

    Features are float32 on `feature_device` (default CPU; pass the target's device to keep them there).
    store_topk: > 0 also returns the target's top-k log-probs per position (`Sample.topk_ids` / `topk_logprobs`,
    float16-rounded as captured ones are), for `loss: topk`.
    store_target_lse: also returns the log-sum-exp of the target's logits per position (`Sample.target_lse`, from
    the logits this pass forms anyway; DSpark with a reduced draft vocabulary).
    """

    def __init__(
        self,
        target: Target,
        samples: Sequence[Sample],
        *,
        layer_ids: Sequence[int],
        feature_device: torch.device | str | None = None,
        target_tokens: bool = True,
        store_topk: int = 0,
        store_target_lse: bool = False,
    ) -> None:
        self.target = target
        self.samples = list(samples)
        self._layer_ids = [int(i) for i in layer_ids]
        target.check_layer_ids(self._layer_ids)
        check_token_ids(self.samples, target.vocab_size, what=f"the target {target.source}")
        self.feature_device = torch.device(feature_device or "cpu")
        self.target_tokens = target_tokens
        if not 0 <= int(store_topk) <= target.vocab_size:
            raise ValueError(f"store_topk must be in [0, {target.vocab_size}], got {store_topk}")
        self.store_topk = int(store_topk)
        self.store_target_lse = bool(store_target_lse)

    @property
    def layer_ids(self) -> list[int]:
        return list(self._layer_ids)

    @property
    def lengths(self) -> list[int]:
        return [len(s) for s in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Sample:
        s = self.samples[i]
        need_logits = self.target_tokens or self.store_topk > 0 or self.store_target_lse
        out = self.target.forward(
            s.input_ids[None],
            layer_ids=self._layer_ids,
            logits=need_logits,
            feature_device=self.feature_device,
            feature_dtype=torch.float32,
        )
        tokens = out.logits.argmax(-1)[0].to(self.feature_device) if self.target_tokens else None  # (T,)
        top_ids = top_lp = None
        if self.store_topk:
            top_ids, top_lp = topk_logprobs(out.logits[0], self.store_topk)  # (T, k)
            top_ids, top_lp = top_ids.to(self.feature_device), top_lp.to(self.feature_device, torch.float32)
        lse = None
        if self.store_target_lse:
            lse = torch.logsumexp(out.logits[0].float(), dim=-1).to(self.feature_device)  # (T,)
        return Sample(
            id=s.id,
            input_ids=s.input_ids,
            loss_mask=s.loss_mask,
            features=out.features[0],  # (T, K·H)
            target_tokens=tokens,
            topk_ids=top_ids,
            topk_logprobs=top_lp,
            target_lse=lse,
        )
