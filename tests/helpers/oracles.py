"""Drafters with known behaviour for decoding tests, and the reference they are checked against: a noisy oracle
of a reference continuation whose proposals depend only on (position, slot), tiny drafter configs, random prompts,
and the target's own greedy decoding through HF `generate`."""

from __future__ import annotations

import torch

from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.evaluate.stats import Prompt
from dflashkit.target.model import Target


def drafter_config(layer_ids=(1, 4, 6), bs: int = 6) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=64,
        vocab_size=97,
        num_target_layers=8,
        target_layer_ids=list(layer_ids),
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=32,
        block_size=bs,
        mask_token_id=5,
    )


class PositionalOracle(DFlashDrafter):
    """A real drafter network whose logits are a noisy oracle of a reference continuation (one list of ids, or a
    dict prompt length → ids for several prompts). The noise is a function of (position, slot) only — never of
    call order — so the real loop and the replay see the same proposals.
    Slot k proposes the true token with probability `p_correct`, else a wrong one with the true token second."""

    def __init__(
        self, cfg: DrafterConfig, reference: dict[int, list[int]] | list[int], p_correct: float, seed: int = 0
    ) -> None:
        super().__init__(cfg)
        self.reference, self.p_correct, self.seed = reference, p_correct, seed

    def forward(self, context_features, *args, block_positions, **kw):
        self._positions = block_positions[0].tolist()
        cache = kw.get("cache")
        if isinstance(self.reference, dict) and cache is not None and cache.length == 0:  # a new prompt starts
            self._ref = self.reference.get(context_features.shape[1], [])  # keyed by prompt length
        return super().forward(context_features, *args, block_positions=block_positions, **kw)

    def logits(self, hidden, lm_head_weight):
        n, vocab = hidden.shape[0], lm_head_weight.shape[0]
        ref = self._ref if isinstance(self.reference, dict) else self.reference
        rows = []
        for k in range(n):
            pos = self._positions[0] + k + 1  # row k proposes the token one past slot k (the first row: slot 0)
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + pos * 97 + k + 1)
            row = torch.randn(vocab, generator=g)
            true = ref[pos] if pos < len(ref) else int(torch.randint(vocab, (1,), generator=g))
            wrong = (true + 1 + int(torch.randint(vocab - 1, (1,), generator=g))) % vocab
            good = torch.rand(1, generator=g).item() < self.p_correct
            row[true if good else wrong] = 20.0
            row[wrong if good else true] = 15.0
            rows.append(row)
        return torch.stack(rows)


def make_prompts(n: int, seed: int = 0) -> list[Prompt]:
    g = torch.Generator().manual_seed(seed)
    return [Prompt(f"p{i}", torch.randint(3, 97, (6 + i,), generator=g).tolist()) for i in range(n)]


def oracle_for(target: Target, prompts: list[Prompt], n_new: int, **kw) -> PositionalOracle:
    """A PositionalOracle that knows the target's greedy continuation (n_new tokens) of every prompt."""
    from dflashkit.decode.generate import DecodeSettings, generate

    refs = {
        len(p.ids): p.ids + generate(target, p.ids, settings=DecodeSettings(method="ar", max_new_tokens=n_new)).tokens
        for p in prompts
    }
    return PositionalOracle(drafter_config(), refs, **kw).eval()


def reference_greedy(target: Target, prompt: torch.Tensor, n: int) -> list[int]:
    out = target.model.generate(prompt[None], max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, prompt.shape[0] :].tolist()
