"""Decoding with XPress drafters: greedy output equals the target's own greedy decoding (chain and DDTree, several
block sizes, a reduced vocabulary), drafts are the Jacobi passes as a float64 Python loop computes them from the raw
refiner weights (slot 0's previous token the one before the bonus), 0 passes give the backbone's drafts and bs
passes the refined model's own greedy rollout (the Jacobi fixed point), simulation replays the real loop exactly,
and sampling at T > 0 reproduces the target's joint distribution of three tokens (a wrong acceptance rule fails)."""

from __future__ import annotations

import pytest
import torch

from dflashkit.decode.generate import DecodeSettings, generate
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads import BlockSlots, xpress_draft
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.target.model import Target
from helpers.joint_law import check_joint_law, tiny_target
from helpers.xpress_reference import bias64, jacobi64, weights64

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def xpress_config(vocab: int = 97, bs: int = 4, hidden: int = 64, layers: int = 8, **kw) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=hidden, vocab_size=vocab, num_target_layers=layers,
        target_layer_ids=[1, 4, 6] if layers == 8 else [0, layers - 1], num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=32, block_size=bs, mask_token_id=min(5, vocab - 1),
        kind="xpress", xpress_rank=8, **kw,
    )  # fmt: skip


def random_xpress(cfg: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    """Random weights with a refiner large enough to change the drafts (and a mixer that is not zero)."""
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg).eval()
    with torch.no_grad():
        for p in d.refiner_head.parameters():
            p.normal_(0, 0.5)
        d.refiner_head.readout.weight.normal_(0, 2.0)
        if cfg.draft_vocab_size:
            d.draft_to_target.copy_(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values)
    return d


def _to_target(d):
    return (lambda i: i) if d.config.draft_vocab_size is None else (lambda i: int(d.draft_to_target[i]))


@pytest.fixture(scope="module")
def target(tiny_llama_dir) -> Target:
    return Target.load(tiny_llama_dir)


def test_drafts_are_the_jacobi_passes(target: Target, monkeypatch) -> None:
    """Every round's drafts and rows against jacobi64 on the round's own backbone states; the token before the
    bonus is the one the sequence holds."""
    for vocab, passes in ((None, 6), (40, 2), (None, 1)):
        drafter = random_xpress(xpress_config(bs=5, draft_vocab_size=vocab, num_jacobi_passes=passes), seed=3)
        seen, rounds, real, real_round = [], [], xpress_draft.refined_rows, xpress_draft.draft_xpress

        def spy(d, logits, first, block, real=real, seen=seen):
            out = real(d, logits, first, block)
            seen.append((logits, first, block, out))
            return out

        def spy_round(r, real_round=real_round, rounds=rounds):
            rounds.append((r.start, r.before))
            return real_round(r)

        monkeypatch.setattr(xpress_draft, "refined_rows", spy)
        monkeypatch.setattr(xpress_draft, "draft_xpress", spy_round)
        prompt = [3, 4, 5, 6]
        res = generate(target, torch.tensor(prompt), drafter=drafter, settings=DecodeSettings(max_new_tokens=12))
        monkeypatch.undo()
        assert seen and len(seen) == len(rounds)
        sequence = prompt + res.tokens
        w, differs = weights64(drafter), False
        for (logits, first, block, rows), (start, before) in zip(seen, rounds, strict=True):
            assert first == sequence[start] and block.before == before == sequence[start - 1]
            base = torch.zeros(drafter.config.block_size, logits.shape[1])  # slot 0's row is never read; rows past
            base[1 : 1 + logits.shape[0]] = logits  # the drafts committed this round only change later slots
            want = jacobi64(w, base, block.hidden, first, block.before, passes, _to_target(drafter))[-1]
            want = want[1 : 1 + logits.shape[0]]
            err = float((rows.double() - want).abs().max() / want.abs().max())  # float32 rows of magnitude ~10³
            assert err < 1e-5 and rows.argmax(-1).tolist() == want.argmax(-1).tolist(), err
            differs |= rows.argmax(-1).tolist() != logits.argmax(-1).tolist()
        assert differs, "the refiner never changed a draft: the test would not see a missing refiner"


def test_no_passes_give_the_backbone_and_bs_passes_its_own_greedy_rollout() -> None:
    """K = 0: the backbone's argmax. K ≥ bs − 1: the fixed point, where slot k's draft is the argmax of its row given
    the drafts before it — the refined model's sequential greedy rollout."""
    bs, vocab = 6, 30
    d = random_xpress(xpress_config(vocab=vocab, bs=bs, hidden=32, layers=2), seed=2)
    g = torch.Generator().manual_seed(0)
    logits, hidden = torch.randn(bs - 1, vocab, generator=g) * 3, torch.randn(bs, 32, generator=g)
    block = BlockSlots(hidden, first=7, before=11)
    d.config.head_settings.num_jacobi_passes = 0
    assert xpress_draft.greedy_chain(d, logits, 7, block)[0] == logits.argmax(-1).tolist()
    d.config.head_settings.num_jacobi_passes = bs
    drafts = xpress_draft.greedy_chain(d, logits, 7, block)[0]
    w, prev = weights64(d), [11, 7]
    base = torch.cat([torch.zeros(1, vocab), logits]).double()
    for k in range(1, bs):  # the sequential rollout: slot k given the drafts of slots 1 … k − 1
        row = base[k] + bias64(w, hidden, prev + [0] * (bs - len(prev)))[k]
        prev.append(int(row.argmax()))
    assert drafts == prev[2:]


def test_teacher_forced_rows_read_the_given_previous_tokens() -> None:
    bs, vocab = 5, 30
    d = random_xpress(xpress_config(vocab=vocab, bs=bs, hidden=32, layers=2), seed=4)
    g = torch.Generator().manual_seed(1)
    logits, hidden = torch.randn(bs - 1, vocab, generator=g), torch.randn(bs, 32, generator=g)
    prevs = torch.tensor([7, 3, 9, 1])  # slot j + 1's previous token
    got = xpress_draft.teacher_forced(d, logits, prevs, BlockSlots(hidden, 7, 12)).detach()
    want = logits.double() + bias64(weights64(d), hidden, [12, 7, 3, 9, 1])[1:]
    assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-5


def test_sampling_matches_the_targets_joint_distribution_of_three_tokens() -> None:
    """Tokens 2 and 3 come from one round of drafts whose q is the last pass's distribution."""
    target = tiny_target()
    drafter = random_xpress(xpress_config(vocab=3, bs=3, hidden=32, layers=2), seed=1)
    check_joint_law(target, drafter)
