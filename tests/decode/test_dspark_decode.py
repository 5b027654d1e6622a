"""Decoding with DSpark drafters: greedy output equals the target's own greedy decoding (random and oracle drafters,
every block size and a reduced vocabulary), drafts are the Markov head's left-to-right argmax, a round proposes bs
drafts, the confidence cut-off only shortens rounds, sampling at T > 0 reproduces the target's joint distribution
of three tokens (argmax and sampled drafts; a wrong acceptance rule fails the same test), and what DSpark cannot
do is refused by name."""

from __future__ import annotations

import pytest
import torch

from dflashkit.decode.generate import DecodeSettings, GenerationError, generate
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.target.model import Target
from helpers.joint_law import check_joint_law, tiny_target
from helpers.oracles import reference_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def dspark_config(vocab: int = 97, bs: int = 4, hidden: int = 64, layers: int = 8, **kw) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=hidden,
        vocab_size=vocab,
        num_target_layers=layers,
        target_layer_ids=[1, 4, 6] if layers == 8 else [0, layers - 1],
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=32,
        block_size=bs,
        mask_token_id=min(5, vocab - 1),
        kind="dspark",
        markov_rank=8,
        **kw,
    )


def random_dspark(cfg: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg).eval()
    with torch.no_grad():  # a Markov bias that matters
        d.markov_head.markov_w2.weight.normal_(0, 2.0)
        if cfg.draft_vocab_size:
            d.draft_to_target.copy_(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values)
    return d


class OracleDSpark(DFlashDrafter):
    """Backbone logits replaced by a noisy oracle: slot k (position start + k + 1) proposes the reference token with
    probability p_correct (W2 = 0: the Markov head adds nothing)."""

    def __init__(self, cfg: DrafterConfig, reference: list[int], p_correct: float, seed: int = 0) -> None:
        super().__init__(cfg)
        self.reference, self.p_correct = reference, p_correct
        self.rng = torch.Generator().manual_seed(seed)

    def forward(self, *args, block_positions, **kw):
        self._positions = block_positions[0].tolist()
        return super().forward(*args, block_positions=block_positions, **kw)

    def logits(self, hidden, lm_head_weight):
        n, vocab = hidden.shape[0], lm_head_weight.shape[0]
        out = torch.randn(n, vocab, generator=self.rng)
        for k in range(n):
            pos = self._positions[k] + 1
            true = self.reference[pos] if pos < len(self.reference) else 0
            good = torch.rand(1, generator=self.rng).item() < self.p_correct
            out[k, true if good else (true + 1) % vocab] = 20.0
        return out


@pytest.fixture(scope="module")
def target(tiny_llama_dir) -> Target:
    return Target.load(tiny_llama_dir)


def test_oracle_rounds_propose_bs_drafts(target: Target) -> None:
    prompt = torch.tensor([3, 14, 15, 92, 65, 35])
    ref = reference_greedy(target, prompt, 40)
    drafter = OracleDSpark(dspark_config(bs=4), prompt.tolist() + ref, p_correct=1.0).eval()
    res = generate(target, prompt, drafter=drafter, settings=DecodeSettings(max_new_tokens=40, check_invariants=True))
    assert res.tokens == ref
    assert max(res.acceptance_lengths) == 5  # bs drafts + the bonus: one more than a DFlash block of 4
    noisy = OracleDSpark(dspark_config(bs=4), prompt.tolist() + ref, p_correct=0.7, seed=2).eval()
    res = generate(target, prompt, drafter=noisy, settings=DecodeSettings(max_new_tokens=40, check_invariants=True))
    assert res.tokens == ref and 1.5 < res.tau < 5


def test_drafts_are_the_markov_heads_left_to_right_argmax(target: Target, monkeypatch) -> None:
    drafter = random_dspark(dspark_config(bs=5), seed=3)
    seen = []
    from dflashkit.drafter.heads import dspark_draft

    real = dspark_draft.draft_dspark

    def spy(*args, **kw):
        out = real(*args, **kw)
        seen.append((args[0].bonus, out))  # (bonus, (drafts, q, logits))
        return out

    monkeypatch.setattr(dspark_draft, "draft_dspark", spy)
    generate(target, torch.tensor([3, 4, 5, 6]), drafter=drafter, settings=DecodeSettings(max_new_tokens=12))
    assert seen
    for bonus, (drafts, q, base) in seen:
        assert q is None
        prev = bonus
        for k, d in enumerate(drafts.tolist()):
            bias = drafter.markov_head.bias(torch.tensor(prev)).float()
            assert int((base[k] + bias).argmax()) == d and bias.abs().max() > 0
            prev = d
    assert any(int(base[k].argmax()) != d for _, (drafts, _, base) in seen for k, d in enumerate(drafts.tolist()))


def test_ddtree_over_dspark_drafts_is_lossless_and_follows_the_markov_head(target: Target) -> None:
    prompt = torch.tensor([3, 14, 15, 92, 65])
    ref = reference_greedy(target, prompt, 30)
    for seed, vocab in ((5, None), (6, 40)):
        drafter = random_dspark(dspark_config(bs=4, draft_vocab_size=vocab), seed)
        res = generate(
            target,
            prompt,
            drafter=drafter,
            settings=DecodeSettings(method="tree", tree_budget=6, max_new_tokens=30, check_invariants=True),
        )
        assert res.tokens == ref
    oracle = OracleDSpark(dspark_config(bs=4), prompt.tolist() + ref, p_correct=1.0).eval()
    res = generate(
        target, prompt, drafter=oracle, settings=DecodeSettings(method="tree", tree_budget=4, max_new_tokens=30)
    )
    assert res.tokens == ref and max(res.acceptance_lengths) == 5


def test_confidence_cut_off_only_shortens_rounds(target: Target) -> None:
    drafter = random_dspark(dspark_config(bs=4), seed=4)
    prompt = torch.tensor([7, 8, 9, 10, 11])
    ref = reference_greedy(target, prompt, 20)
    full = generate(target, prompt, drafter=drafter, settings=DecodeSettings(max_new_tokens=20, confidence_min=0.0))
    none = generate(
        target, prompt, drafter=drafter, settings=DecodeSettings(max_new_tokens=20, confidence_min=1.0)
    )  # sigmoid < 1: no draft
    assert full.tokens == none.tokens == ref
    assert none.tau == 1.0 and none.rounds == 19
    with pytest.raises(GenerationError, match="confidence_min"):
        generate(target, prompt, drafter=drafter, settings=DecodeSettings(max_new_tokens=5, confidence_min=1.5))
    plain = DFlashDrafter(dspark_config(bs=4).replace(kind="dflash")).eval()
    with pytest.raises(GenerationError, match="DSpark"):
        generate(target, prompt, drafter=plain, settings=DecodeSettings(max_new_tokens=5, confidence_min=0.5))
    with pytest.raises(GenerationError, match="chain"):
        generate(
            target,
            prompt,
            drafter=drafter,
            settings=DecodeSettings(method="tree", max_new_tokens=5, confidence_min=0.5),
        )
    headless = random_dspark(dspark_config(bs=4, confidence_head=False))
    with pytest.raises(GenerationError, match="no confidence head"):
        generate(target, prompt, drafter=headless, settings=DecodeSettings(max_new_tokens=5, confidence_min=0.5))


def test_sampling_matches_the_targets_joint_distribution_of_three_tokens() -> None:
    """Tokens 2 and 3 come from one draft-and-verify round of two Markov-chained drafts."""
    check_joint_law(tiny_target(), random_dspark(dspark_config(vocab=3, bs=2, hidden=32, layers=2), seed=1))


def test_cli_init_drafter_and_generate_with_confidence_cut_off(tiny_llama_dir, tmp_path, capsys) -> None:
    from dflashkit.cli import main
    from dflashkit.drafter.checkpoint import load_drafter

    ckpt = tmp_path / "sp"
    args = ["init-drafter", str(ckpt), "--target", str(tiny_llama_dir), "kind=dspark", "num_hidden_layers=1"]
    assert main([*args, "block_size=3", "markov_rank=16"]) == 0
    d = load_drafter(ckpt)
    assert d.config.kind == "dspark" and d.config.head_settings.markov_rank == 16 and d.confidence_head is not None
    gen = ["generate", "--target", str(tiny_llama_dir), "--drafter", str(ckpt), "--prompt-ids", "3,4,5,6"]
    assert main([*gen, "--max-new-tokens", "8", "--confidence-min", "0.2"]) == 0
    assert main([*gen, "--max-new-tokens", "8", "--confidence-min", "2"]) == 2
    assert "confidence-min" in capsys.readouterr().err
