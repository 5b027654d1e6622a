"""Target features computed online: the same interface as `dflashkit.features.CapturedFeatures`, nothing stored.

    OnlineFeatures(target, samples, layer_ids=ids)[i]   # → Sample with the target's features and argmax tokens

Re-exported by `dflashkit.features`; the features are those of `Target.forward` (outputs of the decoder layers
`layer_ids`, final-layer argmax), exactly what `dflashkit.features.capture` stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from dflashkit.samples import Sample, check_token_ids

if TYPE_CHECKING:
    from dflashkit.target import Target


class OnlineFeatures:
    """Same interface as CapturedFeatures, but runs the target at access time and stores nothing.

    Features are float32 on `feature_device` (default CPU; pass the target's device to keep them there).
    """

    def __init__(self, target: Target, samples: Sequence[Sample], *, layer_ids: Sequence[int],
                 feature_device: torch.device | str | None = None, target_tokens: bool = True) -> None:
        self.target = target
        self.samples = list(samples)
        self._layer_ids = [int(i) for i in layer_ids]
        target.check_layer_ids(self._layer_ids)
        check_token_ids(self.samples, target.vocab_size, what=f"the target {target.source}")
        self.feature_device = torch.device(feature_device or "cpu")
        self.target_tokens = target_tokens

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
        out = self.target.forward(s.input_ids[None], layer_ids=self._layer_ids, logits=self.target_tokens,
                                  feature_device=self.feature_device, feature_dtype=torch.float32)
        tokens = out.logits.argmax(-1)[0].to(self.feature_device) if self.target_tokens else None  # (T,)
        return Sample(id=s.id, input_ids=s.input_ids, loss_mask=s.loss_mask, features=out.features[0],  # (T, K·H)
                      target_tokens=tokens)
