"""Speculative decoding: greedy output equals the target's own greedy decoding (chain, tree, AR; dense and
hybrid targets), a chain-shaped tree verifies exactly like chain verification, per-round invariants hold, and
sampling at T > 0 reproduces the target's distribution."""

from __future__ import annotations

import pytest
import torch

from dflashkit.decode import generate as decode_mod
from dflashkit.decode.generate import DecodeSettings, generate
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.sampling import SamplingParams, probs
from dflashkit.target.model import Target
from helpers.choices import set_choice
from helpers.oracles import reference_greedy


def drafter_config(vocab: int = 97, bs: int = 6, hidden: int = 64, layers: int = 8) -> DrafterConfig:
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
    )


class OracleDrafter(DFlashDrafter):
    """A real drafter network whose logits are replaced by a noisy oracle of the target's greedy continuation:
    slot k proposes the true token with probability `p_correct`, else a wrong one (with the true token ranked
    second, so DDTree can recover it). Exercises every acceptance length without training."""

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
            pos = self._positions[k + 1]
            true = (
                self.reference[pos]
                if pos < len(self.reference)
                else int(torch.randint(vocab, (1,), generator=self.rng))
            )
            wrong = (true + 1 + int(torch.randint(vocab - 1, (1,), generator=self.rng))) % vocab
            good = torch.rand(1, generator=self.rng).item() < self.p_correct
            out[k, true if good else wrong] = 20.0
            out[k, wrong if good else true] = 15.0
        return out


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_greedy_is_lossless(tiny_target_dirs, kind):
    target = Target.load(tiny_target_dirs[kind])
    taus = {}
    for seed in range(2):
        prompt = torch.randint(3, 97, (7 + seed,), generator=torch.Generator().manual_seed(seed))
        ref = reference_greedy(target, prompt, 40)
        full = prompt.tolist() + ref
        for method in ("ar", "chain", "tree"):
            drafter = OracleDrafter(drafter_config(), full, p_correct=0.8, seed=seed).eval()
            res = generate(
                target,
                prompt,
                drafter=drafter,
                settings=DecodeSettings(
                    method=method, max_new_tokens=40, tree_budget=10, tree_top_k=2, check_invariants=True
                ),
            )
            assert res.tokens == ref, (kind, method, seed)
            taus.setdefault(method, []).append(res.tau)
    assert max(taus["ar"]) == 1.0
    assert min(taus["chain"]) > 1.5  # acceptance is really exercised
    if kind == "llama":  # the tree recovers second-ranked tokens: longer accepted runs than the chain
        assert sum(taus["tree"]) > sum(taus["chain"])


def test_random_drafter_is_lossless_and_stop_tokens(tiny_llama_dir):
    target = Target.load(tiny_llama_dir)
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config()).eval()
    prompt = torch.tensor([3, 14, 15, 92, 65, 35])
    ref = reference_greedy(target, prompt, 25)
    for method in ("chain", "tree"):
        assert (
            generate(target, prompt, drafter=drafter, settings=DecodeSettings(method=method, max_new_tokens=25)).tokens
            == ref
        )
    stop = ref[10]
    res = generate(target, prompt, drafter=drafter, settings=DecodeSettings(max_new_tokens=25, stop_token_ids=[stop]))
    assert res.stop_reason == "stop_token" and res.tokens == ref[: ref.index(stop) + 1]


def test_a_drafter_is_a_plain_module_until_generate_routes_its_layers(tiny_llama_dir):
    # CPU speed is one explicit call (cpu_products.route_linears): a drafter built for training or export keeps
    # nn.Linear's own forward; `generate` routes its layers (one pass group) on first use, and once only.
    from torch import nn

    target = Target.load(tiny_llama_dir)
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config()).eval()
    linears = [m for m in drafter.layers.modules() if type(m) is nn.Linear]
    assert linears and not any(getattr(m, "_routed", False) or "forward" in vars(m) for m in linears)
    prompt = torch.tensor([3, 14, 15, 92, 65, 35])
    settings = DecodeSettings(method="chain", max_new_tokens=12)
    first = generate(target, prompt, drafter=drafter, settings=settings).tokens
    groups = {id(m._pass_group) for m in linears}
    assert all(m._routed for m in linears) and len(groups) == 1
    assert generate(target, prompt, drafter=drafter, settings=settings).tokens == first
    assert {id(m._pass_group) for m in linears} == groups  # a second decode routes nothing anew
    assert first == reference_greedy(target, prompt, 12)


def test_chain_shaped_tree_equals_chain(tiny_llama_dir):
    target = Target.load(tiny_llama_dir)
    prompt = torch.randint(3, 97, (8,), generator=torch.Generator().manual_seed(5))
    full = prompt.tolist() + reference_greedy(target, prompt, 30)
    runs = {}
    for method in ("chain", "tree"):
        drafter = OracleDrafter(drafter_config(bs=6), full, p_correct=0.7, seed=11).eval()
        # top_k=1 and budget bs−1: the tree is exactly the drafted chain
        runs[method] = generate(
            target,
            prompt,
            drafter=drafter,
            settings=DecodeSettings(
                method=method, max_new_tokens=30, tree_top_k=1, tree_budget=5, check_invariants=True
            ),
        )
    assert runs["tree"].tokens == runs["chain"].tokens
    assert runs["tree"].acceptance_lengths == runs["chain"].acceptance_lengths


def test_invariant_violation_is_detected():
    with pytest.raises(AssertionError, match="acceptance length"):
        decode_mod._check(7, 17, 10, 10, bs=6, budget=None)
    with pytest.raises(AssertionError, match="target cache holds"):
        decode_mod._check(2, 13, 10, 10, bs=6, budget=None)


def test_bad_generate_arguments(tiny_llama_dir):
    target = Target.load(tiny_llama_dir)
    with pytest.raises(ValueError, match="valid methods"):
        generate(target, [3, 4], settings=DecodeSettings(method="beam"))
    with pytest.raises(ValueError, match="context window of 512"):
        generate(target, list(range(3, 93)) * 5, settings=DecodeSettings(method="ar", max_new_tokens=100))
    drafter = DFlashDrafter(drafter_config()).eval()
    # values that used to be replaced or ignored without a word are refused
    for kw, msg in (
        (dict(max_new_tokens=0), "max_new_tokens = 0"),
        (dict(max_new_tokens=-5), "max_new_tokens = -5"),
        (dict(block_size=1), "block_size = 1"),
        (dict(block_size=-2), "block_size = -2"),
        (dict(method="tree", tree_budget=0), "tree_budget = 0"),
    ):
        with pytest.raises(ValueError, match=msg):
            generate(target, [3, 4], drafter=drafter, settings=DecodeSettings(**{"method": "chain", **kw}))


def _joint_counts(target, drafter, prompt, n, **kw):
    counts = torch.zeros(target.vocab_size, target.vocab_size)
    for s in range(n):
        toks = generate(target, prompt, drafter=drafter, settings=DecodeSettings(max_new_tokens=2, seed=s, **kw)).tokens
        counts[toks[0], toks[1]] += 1
    return counts / n


def test_sampling_matches_target_distribution(tmp_path):
    """Joint law of the first two sampled tokens (the second one goes through draft-and-verify) equals the
    target's exact p(t1)·p(t2 | t1), for argmax drafts and for sampled drafts; always accepting drafts fails."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = 6
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.5)
    target = Target(model)
    params = SamplingParams(temperature=1.0)
    prompt = torch.tensor([1, 2, 3, 4])
    with torch.no_grad():  # exact joint distribution
        p1 = probs(model(prompt[None]).logits[0, -1], params)
        exact = torch.stack(
            [
                p1[a] * probs(model(torch.cat([prompt, torch.tensor([a])])[None]).logits[0, -1], params)
                for a in range(vocab)
            ]
        )
    torch.manual_seed(1)
    drafter = DFlashDrafter(drafter_config(vocab=vocab, bs=2, hidden=32, layers=2)).eval()
    n = 1200
    tol = 0.09  # E[TV] for 36 cells and n = 1200 is ≈ 0.055
    for draft_sampling in (False, True):
        emp = _joint_counts(target, drafter, prompt, n, sampling=params, draft_sampling=draft_sampling)
        tv = 0.5 * (emp - exact).abs().sum().item()
        assert tv < tol, (draft_sampling, tv)
    # a wrong rule (accept every draft) must fail the same test
    orig = decode_mod.accept_argmax_drafts
    try:
        decode_mod.accept_argmax_drafts = lambda drafts, p, gen=None: (
            len(drafts),
            int(torch.multinomial(p[-1], 1, generator=gen)),
        )
        emp = _joint_counts(target, drafter, prompt, n, sampling=params)
    finally:
        decode_mod.accept_argmax_drafts = orig
    assert 0.5 * (emp - exact).abs().sum().item() > 2 * tol


class RecordCalls:
    """Mixin for a drafter: records every pass (block positions and hidden output) in `self.calls`."""

    def forward(self, context_features, block_embeds, *, context_positions, block_positions, **kw):
        out = super().forward(
            context_features, block_embeds, context_positions=context_positions, block_positions=block_positions, **kw
        )
        self.__dict__.setdefault("calls", []).append(
            {"block": block_positions[0].tolist(), "hidden": out.detach().clone()}
        )
        return out


class SpyDrafter(RecordCalls, DFlashDrafter):
    pass


class SpyOracle(RecordCalls, OracleDrafter):
    pass


def test_last_round_drafts_with_the_full_block(tiny_llama_dir, monkeypatch):
    """Every drafter pass reads the full block, also when max_new_tokens leaves room for fewer than bs tokens; the
    drafts verified in the last round are those of a direct full-block drafter forward (not of a shorter block,
    which bidirectional attention makes different)."""
    target = Target.load(tiny_llama_dir)
    bs = 6
    torch.manual_seed(0)
    drafter = SpyDrafter(drafter_config(bs=bs)).eval()
    prompt = torch.tensor([3, 14, 15, 92, 65, 35, 8])
    verified: list[list[int]] = []
    real_verify = decode_mod._verify_chain

    def spy_verify(target_, cache, block, *args, **kw):
        verified.append(block[0].tolist())
        return real_verify(target_, cache, block, *args, **kw)

    monkeypatch.setattr(decode_mod, "_verify_chain", spy_verify)
    n_new = 9
    res = generate(
        target,
        prompt,
        drafter=drafter,
        settings=DecodeSettings(method="chain", max_new_tokens=n_new, check_invariants=True),
    )
    assert res.tokens == reference_greedy(target, prompt, n_new)
    assert len(drafter.calls) == len(verified) == res.rounds
    assert all(len(c["block"]) == bs for c in drafter.calls)
    committed = 1  # the prefill's token
    for _call, block, L in zip(drafter.calls, verified, res.acceptance_lengths, strict=True):
        room = n_new - committed
        assert len(block) == 1 + min(bs - 1, room)  # only what fits is verified
        committed += L
    assert committed >= n_new
    # the last round: a direct, cache-free, full-block drafter forward proposes exactly the verified drafts
    last, block = drafter.calls[-1], verified[-1]
    start = last["block"][0]
    seq = torch.tensor(prompt.tolist() + res.tokens)[None]
    ctx = target.forward(seq[:, :start], layer_ids=drafter.config.target_layer_ids, logits=False).features
    n_verify = len(block) - 1
    assert n_verify < bs - 1  # the case under test: the block is cut by max_new_tokens

    def direct(block_len: int) -> torch.Tensor:
        embeds = drafter.block_embeddings(torch.tensor([[block[0]]]), target.embed_weight, block_len)
        with torch.no_grad():
            hidden = DFlashDrafter.forward(
                drafter,
                ctx,
                embeds,
                context_positions=torch.arange(start)[None],
                block_positions=torch.arange(start, start + block_len)[None],
            )
        return drafter.logits(hidden[0, 1 : n_verify + 1], target.lm_head_weight)  # (nv, V)

    full = direct(bs)
    assert torch.allclose(
        full, drafter.logits(last["hidden"][0, 1 : n_verify + 1], target.lm_head_weight), atol=1e-4, rtol=1e-4
    )
    assert full.argmax(-1).tolist() == block[1:]
    assert not torch.allclose(direct(n_verify + 1), full, atol=1e-3)  # a shorter block would draft otherwise


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_greedy_exact_with_odd_max_new_tokens(tiny_target_dirs, kind, monkeypatch):
    """Full-block drafting with a cut verification keeps greedy equality and the exact token count; in tree mode
    the drafter reads the full block and the tree's depth is limited to what fits."""
    target = Target.load(tiny_target_dirs[kind])
    bs = 6
    prompt = torch.randint(3, 97, (9,), generator=torch.Generator().manual_seed(21))
    ref = reference_greedy(target, prompt, 17)
    depths: list[int] = []
    real_build = decode_mod.build_tree

    def spy_build(logp, *args, **kw):
        depths.append(int(logp.shape[0]))
        return real_build(logp, *args, **kw)

    monkeypatch.setattr(decode_mod, "build_tree", spy_build)
    for n_new in (1, 2, 5, 9, 13, 17):
        for method in ("chain", "tree"):
            drafter = SpyOracle(drafter_config(bs=bs), prompt.tolist() + ref, p_correct=0.9, seed=n_new).eval()
            depths.clear()
            res = generate(
                target,
                prompt,
                drafter=drafter,
                settings=DecodeSettings(method=method, max_new_tokens=n_new, tree_budget=12, check_invariants=True),
            )
            assert res.tokens == ref[:n_new] and len(res.tokens) == n_new, (kind, method, n_new)
            assert all(len(c["block"]) == bs for c in getattr(drafter, "calls", []))
            if method == "tree":
                committed = 1
                for depth, L in zip(depths, res.acceptance_lengths, strict=True):
                    assert depth == min(bs - 1, n_new - committed)
                    committed += L


def test_the_prompts_width_is_never_measured(tiny_llama_dir, monkeypatch):
    """The prefill and the first draft round run at the prompt's width, a one-off per prompt: they take stock
    products and never a measured choice, so no timing of the product candidates lands inside a decode of the
    same prompt run twice (a benchmark's repeat). Decoding widths (1 row, a block) are still measured."""
    from dflashkit.cpu_products import products

    measured: list[int] = []
    chooser = products.Chooser(timer=lambda name, fn: (fn(), 1.0)[1], store=None, repeats=1)
    real_trial = products._first_product  # a pass group's trial in real steps starts here
    monkeypatch.setattr(
        products, "_first_product", lambda g, rows, dt: measured.append(rows) or real_trial(g, rows, dt)
    )
    real_one = chooser.measure
    monkeypatch.setattr(chooser, "measure", lambda x, w, b: measured.append(x.shape[0]) or real_one(x, w, b))
    monkeypatch.setattr(products, "chooser", lambda: chooser)
    set_choice(monkeypatch, "products", "auto")
    target = Target.load(tiny_llama_dir)
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config()).eval()
    prompt = torch.tensor([3, 14, 15, 92, 65, 35, 8, 9, 10, 11, 12])  # 11 tokens: no decoding width has 11 rows
    ref = reference_greedy(target, prompt, 12)
    for _ in range(3):
        assert generate(target, prompt, settings=DecodeSettings(method="ar", max_new_tokens=12)).tokens == ref
        assert (
            generate(target, prompt, drafter=drafter, settings=DecodeSettings(method="chain", max_new_tokens=12)).tokens
            == ref
        )
    assert measured and len(prompt) not in measured and len(prompt) + 6 not in measured, measured
    assert 1 in measured  # the AR step's width is measured as before


@pytest.mark.parametrize("budget", [1, 3, 6])
def test_tree_sampling_matches_target_distribution(budget):
    """DDTree at T = 1 is lossless: one target sample per node, the walk following it, gives the target's exact joint
    law of three tokens for a chain-like (B = 1) and branching trees; following the nodes' argmax does not."""
    from helpers.joint_law import VOCAB, check_tree_joint_law, exact_joint, tiny_target

    target = tiny_target()
    torch.manual_seed(1)
    drafter = DFlashDrafter(drafter_config(vocab=VOCAB, bs=4, hidden=32, layers=2)).eval()
    check_tree_joint_law(target, drafter, exact_joint(target, SamplingParams(temperature=1.0)), budget=budget)
