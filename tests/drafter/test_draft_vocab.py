"""Reduced draft vocabulary: label mapping, lossless decoding with draft ids mapped back, save/load, training."""

from __future__ import annotations

import torch

from dflashkit.decode.generate import DecodeSettings, generate
from dflashkit.drafter.checkpoint import load_drafter, save_drafter
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.target.model import Target
from dflashkit.train.slot_targets import draft_vocab_head


def _cfg(**kw) -> DrafterConfig:
    base = dict(
        hidden_size=64,
        vocab_size=97,
        num_target_layers=8,
        target_layer_ids=[1, 4, 6],
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=32,
        block_size=4,
        mask_token_id=5,
        draft_vocab_size=20,
    )
    base.update(kw)
    return DrafterConfig(**base)


def test_label_mapping_and_head_rows():
    d = DFlashDrafter(_cfg())
    d2t = torch.arange(3, 97, 4)[:20]  # 3, 7, …, 79
    d.draft_to_target.copy_(d2t)
    head = torch.randn(97, 64)
    labels = torch.tensor([[-100, 3, 7, 4, 79]])
    sub, mapped = draft_vocab_head(d, head, labels)
    assert torch.equal(sub, head[d2t])
    assert mapped.tolist() == [[-100, 0, 1, -100, 19]]
    full_head, same = draft_vocab_head(DFlashDrafter(_cfg(draft_vocab_size=None)), head, labels)
    assert full_head is head and same is labels


def test_reduced_vocab_decoding_is_lossless_and_round_trips(tiny_llama_dir, tmp_path):
    target = Target.load(tiny_llama_dir)
    torch.manual_seed(0)
    d = DFlashDrafter(_cfg()).eval()
    d.draft_to_target.copy_(torch.randperm(97)[:20].sort().values)
    prompt = torch.tensor([3, 14, 15, 92, 65, 35])
    ref = target.model.generate(prompt[None], max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)[
        0, 6:
    ].tolist()
    for method in ("chain", "tree"):
        res = generate(
            target,
            prompt,
            drafter=d,
            settings=DecodeSettings(
                method=method, max_new_tokens=20, tree_budget=6, tree_top_k=2, check_invariants=True
            ),
        )
        assert res.tokens == ref, method
    save_drafter(d, tmp_path / "ckpt")
    back = load_drafter(tmp_path / "ckpt")
    assert back.config.draft_vocab_size == 20 and torch.equal(back.draft_to_target, d.draft_to_target)


def test_the_reduced_head_is_gathered_once_in_either_mode_and_never_stale():
    """`logits` reuses the gathered rows across rounds whether or not the drafter was put in eval mode; a head changed
    in place, another head tensor or another map is gathered again; a head that is trained gets its gradient."""
    torch.manual_seed(1)
    d = DFlashDrafter(_cfg())  # train mode, as constructed or loaded without `.eval()`
    d.draft_to_target.copy_(torch.randperm(97)[:20])
    head, hidden = torch.randn(97, 64), torch.randn(3, 64)
    with torch.no_grad():
        first = d.logits(hidden, head)
        gathered = d._reduced_head[2]
        assert torch.allclose(first, hidden @ head[d.draft_to_target].t(), atol=1e-5)
        d.logits(hidden, head)
        assert d._reduced_head[2] is gathered  # the second round reuses it
        head.mul_(2.0)  # in place: a new version
        assert torch.allclose(d.logits(hidden, head), 2 * first, atol=1e-4)
        other = torch.randn(97, 64)
        assert torch.allclose(d.logits(hidden, other), hidden @ other[d.draft_to_target].t(), atol=1e-5)
        d.draft_to_target.copy_(torch.randperm(97)[:20])
        assert torch.allclose(d.logits(hidden, other), hidden @ other[d.draft_to_target].t(), atol=1e-5)
    with torch.inference_mode():  # a gather made in inference mode is a normal tensor: usable for training after
        d.logits(hidden, other)
    trained = other.clone().requires_grad_(True)
    d.logits(hidden, trained).sum().backward()
    assert trained.grad is not None and trained.grad[d.draft_to_target].abs().sum() > 0
    d.logits(hidden.requires_grad_(True), other).sum().backward()  # a frozen head: the cached rows, grads to hidden
    assert hidden.grad is not None
