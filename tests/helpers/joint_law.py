"""The joint-law test of lossless sampling, shared by every drafter kind: a tiny random Llama over a 3-token
vocabulary, its exact joint distribution of the next three tokens at T = 1, the empirical one from `generate`
with a drafter (chain with argmax and sampled drafts, DDTree), and the same runs with a wrong rule (accept every
sampled draft; follow the target's argmax at the tree's nodes) that must fail.

    check_joint_law(drafter, block)   # asserts both; `drafter` built for vocab 3, hidden 32, 2 target layers
"""

from __future__ import annotations

import torch

from dflashkit.decode import generate as decode_mod
from dflashkit.decode.generate import DecodeSettings, generate
from dflashkit.sampling import SamplingParams, probs
from dflashkit.target.model import Target

VOCAB = 3
PROMPT = torch.tensor([1, 2, 0, 1])
TOL = 0.1  # E[TV] for 27 cells and n = 1000 is ≤ 0.065


def tiny_target(hybrid: bool = False) -> Target:
    """A random 2-layer Llama (hidden 32) over 3 tokens, with weights large enough for peaked distributions;
    `hybrid`: a Qwen3.5 text model instead, its first layer Gated DeltaNet (linear attention), its second full."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    if hybrid:
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

        model = Qwen3_5ForCausalLM(
            Qwen3_5TextConfig(
                **common, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
                linear_num_key_heads=1, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            )
        )  # fmt: skip
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.5)
    return Target(model)


def exact_joint(target: Target, params: SamplingParams) -> torch.Tensor:
    """(3, 3, 3): P(x1, x2, x3 | PROMPT) from the target's own distributions."""
    model, out = target.model, torch.zeros(VOCAB, VOCAB, VOCAB)
    with torch.no_grad():
        p1 = probs(model(PROMPT[None]).logits[0, -1], params)
        for a in range(VOCAB):
            p2 = probs(model(torch.cat([PROMPT, torch.tensor([a])])[None]).logits[0, -1], params)
            for b in range(VOCAB):
                p3 = probs(model(torch.cat([PROMPT, torch.tensor([a, b])])[None]).logits[0, -1], params)
                out[a, b] = p1[a] * p2[b] * p3
    return out


def empirical_joint(target: Target, drafter, n: int, **settings) -> torch.Tensor:
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    for s in range(n):
        t = generate(target, PROMPT, drafter=drafter, settings=DecodeSettings(max_new_tokens=3, seed=s, **settings))
        counts[t.tokens[0], t.tokens[1], t.tokens[2]] += 1
    return counts / n


def check_joint_law(target: Target, drafter, n: int = 1000) -> None:
    """Argmax and sampled drafts reproduce the exact joint within TOL; accepting every sampled draft does not."""
    params = SamplingParams(temperature=1.0)
    exact = exact_joint(target, params)
    for draft_sampling in (False, True):
        emp = empirical_joint(target, drafter, n, sampling=params, draft_sampling=draft_sampling)
        assert 0.5 * (emp - exact).abs().sum().item() < TOL, draft_sampling
    orig = decode_mod.accept_sampled_drafts
    try:
        decode_mod.accept_sampled_drafts = lambda d, p, q, gen=None: (len(d), int(torch.multinomial(p[-1], 1)))
        emp = empirical_joint(target, drafter, 400, sampling=params, draft_sampling=True)
    finally:
        decode_mod.accept_sampled_drafts = orig
    assert 0.5 * (emp - exact).abs().sum().item() > 2 * TOL
    check_tree_joint_law(target, drafter, exact, n)


def check_tree_joint_law(
    target: Target, drafter, exact: torch.Tensor, n: int = 1000, budget: int = 3, **settings
) -> None:
    """DDTree at T = 1 (one target sample per node, the walk following it) reproduces the exact joint; following
    the target's argmax at the nodes instead does not. `settings`: more DecodeSettings (e.g. hybrid_tree)."""
    params = SamplingParams(temperature=1.0)
    emp = empirical_joint(target, drafter, n, sampling=params, method="tree", tree_budget=budget, **settings)
    assert 0.5 * (emp - exact).abs().sum().item() < TOL
    orig = decode_mod.target_tokens
    try:
        decode_mod.target_tokens = lambda logits, params, gen=None: logits.argmax(-1)
        emp = empirical_joint(target, drafter, 200, sampling=params, method="tree", tree_budget=budget, **settings)
    finally:
        decode_mod.target_tokens = orig
    assert 0.5 * (emp - exact).abs().sum().item() > 2 * TOL


__all__ = [
    "PROMPT",
    "VOCAB",
    "check_joint_law",
    "check_tree_joint_law",
    "empirical_joint",
    "exact_joint",
    "tiny_target",
]
