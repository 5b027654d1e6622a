"""What every drafter kind in the registry must do, run over `HEADS` (a new head joins by one line in TINY: its
smallest settings): it trains on the tiny target (the loss falls and stays finite), a killed run resumes to the same
weights, a DFlash checkpoint warm-starts it (the backbone carried over); random drafters decode losslessly — chain
and DDTree, full and reduced vocabulary — equal to the target's own greedy decoding; `simulate` (teacher-forced
rounds over recorded transcripts) replays the real loop's acceptance lengths exactly; `convert` writes every format
its format record claims — z-lab's and speculators' layouts read back to the same tensors — and refuses each other
one in one line naming the kind. What is particular to a head (its
objective against a float64 reference, its drafts against a Python loop of its definition) stays in its own files."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dflashkit.cli import main
from dflashkit.decode.generate import DecodeSettings, generate
from dflashkit.drafter.checkpoint import load_drafter, read_tensors, save_drafter
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.defaults import default_drafter_config
from dflashkit.drafter.heads import HEADS
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import ConfigError
from dflashkit.evaluate.simulate import simulate_many
from dflashkit.evaluate.transcripts import build_transcripts
from dflashkit.export.convert import load_any
from dflashkit.target.model import Target
from dflashkit.train.config import TrainConfig
from dflashkit.train.loop import train
from dflashkit.train.metrics import read_metrics
from helpers.bad_input import _one_line_error
from helpers.oracles import PositionalOracle, make_prompts, reference_greedy
from helpers.target_gguf import write_target_gguf
from helpers.train_runs import write_tokens_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Per kind: the smallest drafter settings that exercise its own parts, and the training options it needs.
TINY: dict[str, tuple[dict, dict]] = {
    "dflash": ({}, {}),
    "dflash2": ({"selector_rank": 8, "selector_top_k": 4}, {}),
    "dspark": ({"markov_rank": 8}, {}),
    "domino": ({"gru_hidden_dim": 8, "emb_dim": 8}, {}),
    "xpress": ({"xpress_rank": 8}, {"loss": "tv"}),
}
KINDS = sorted(HEADS)


def test_every_registered_head_has_tiny_settings():
    assert sorted(TINY) == KINDS


@pytest.fixture(scope="module")
def target(tiny_llama_dir: Path) -> Target:
    return Target.load(tiny_llama_dir)


def _train_cfg(kind: str, out: Path, **kw) -> TrainConfig:
    fields, options = TINY[kind]
    base = dict(
        out=str(out), drafter={"num_hidden_layers": 1, "block_size": 4, "kind": kind, **fields}, max_tokens=48,
        max_steps=8, save_every=4, progress=False, tensorboard=False, lr=3e-3, val_samples=1, eval_every=4, **options,
    )  # fmt: skip
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("kind", KINDS)
def test_trains_resumes_exactly_and_warm_starts_from_dflash(kind, tmp_path: Path, target: Target, tiny_llama_dir):
    kw = dict(tokens=str(write_tokens_file(tmp_path / "tokens.jsonl", 6)), online=True, target=str(tiny_llama_dir))
    straight = train(_train_cfg(kind, tmp_path / "a", **kw), target=target)
    assert straight.step == 8 and straight.val_metrics is not None
    recs = [r for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if r["split"] == "train"]
    assert all(math.isfinite(r["loss"]) for r in recs) and recs[-1]["loss"] < recs[0]["loss"]
    assert load_drafter(tmp_path / "a" / "final").config.kind == kind
    # the head's own parts learn: each moved between the first checkpoint and the last
    final, first = read_tensors(tmp_path / "a" / "final"), read_tensors(min((tmp_path / "a" / "checkpoints").iterdir()))
    torch.manual_seed(4)
    save_drafter(DFlashDrafter(default_drafter_config(target, num_hidden_layers=1, block_size=4)), tmp_path / "plain")
    own = sorted(set(final) - set(read_tensors(tmp_path / "plain")))
    assert bool(own) == (kind != "dflash")
    assert all(not torch.equal(first[k], final[k]) for k in own), [k for k in own if torch.equal(first[k], final[k])]

    def kill(end) -> None:
        if end.step == 4:
            raise RuntimeError("simulated kill")

    with pytest.raises(RuntimeError, match="simulated kill"):
        train(_train_cfg(kind, tmp_path / "b", **kw), target=target, callbacks=[kill])
    train(_train_cfg(kind, tmp_path / "b", **kw), target=target)
    a, b = read_tensors(tmp_path / "a" / "final"), read_tensors(tmp_path / "b" / "final")
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)

    # a DFlash checkpoint warm-starts the kind: the backbone carried over, its own parts at their init
    warm_cfg = _train_cfg(kind, tmp_path / "c", init_from=str(tmp_path / "plain"), max_steps=1, lr=1e-12, **kw)
    train(warm_cfg, target=target)
    warm, plain = load_drafter(tmp_path / "c" / "final"), load_drafter(tmp_path / "plain")
    assert warm.config.kind == kind
    for k, v in plain.state_dict().items():  # a step at lr 1e-12 moves nothing measurable
        torch.testing.assert_close(warm.state_dict()[k], v, rtol=0, atol=1e-6, msg=k)


def tiny_config(kind: str, bs: int = 4, **kw) -> DrafterConfig:
    """A drafter for the tiny Llama target (hidden 64, vocabulary 97, 8 layers)."""
    return DrafterConfig(
        hidden_size=64, vocab_size=97, num_target_layers=8, target_layer_ids=[1, 4, 6], num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=32, block_size=bs,
        mask_token_id=5, kind=kind, **TINY[kind][0], **kw,
    )  # fmt: skip


def random_drafter(cfg: DrafterConfig, seed: int, scale: float = 1.0) -> DFlashDrafter:
    """Random weights whose head-own parts (what a DFlash drafter of the same backbone lacks) are N(0, scale²) —
    at 1, large enough to change the drafts — and a random draft vocabulary where the config reduces it."""
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg).eval()
    backbone = set(DFlashDrafter(cfg.replace(kind="dflash")).state_dict())
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name not in backbone:
                p.normal_(0, scale)
        if cfg.draft_vocab_size:
            d.draft_to_target.copy_(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values)
    return d


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bs", [2, 5])
def test_greedy_decoding_is_lossless_chain_and_ddtree(kind: str, bs: int, target: Target) -> None:
    for seed, vocab in ((0, None), (1, 40)):
        drafter = random_drafter(tiny_config(kind, bs=bs, draft_vocab_size=vocab), seed)
        prompt = torch.randint(3, 97, (6 + seed,), generator=torch.Generator().manual_seed(seed))
        ref = reference_greedy(target, prompt, 23)
        for method in ("chain", "tree"):
            settings = DecodeSettings(method=method, max_new_tokens=23, check_invariants=True, tree_budget=6)
            assert generate(target, prompt, drafter=drafter, settings=settings).tokens == ref, (seed, method)


@pytest.mark.parametrize("kind", KINDS)
def test_simulation_replays_the_real_loop(kind: str, target: Target, tmp_path: Path) -> None:
    prompts, n_new = make_prompts(2), 24
    cache = build_transcripts(target, prompts, tmp_path / "tr", max_new_tokens=n_new, layer_ids=[1, 4, 6],
                              progress=False)  # fmt: skip
    refs = {
        len(p.ids): p.ids + generate(target, p.ids, settings=DecodeSettings(method="ar", max_new_tokens=n_new)).tokens
        for p in prompts
    }
    oracle = PositionalOracle(tiny_config(kind), refs, p_correct=0.8, seed=1).eval()  # often-right backbone logits
    # beside the head's own parts, small enough that the oracle's margin (20 over 15) decides most drafts
    oracle.load_state_dict(random_drafter(tiny_config(kind), seed=1, scale=0.05).state_dict())
    drafters = {"random": random_drafter(tiny_config(kind), seed=0), "oracle": oracle}
    sims = simulate_many(drafters, cache, tree_budgets=[5], tree_top_k=3, progress=False)
    accepted = 0
    for name, d in drafters.items():
        for method, kw in (("chain", {}), ("ddtree:5", {"tree_budget": 5})):
            for p in prompts:
                settings = DecodeSettings(method="tree" if kw else "chain", max_new_tokens=n_new, tree_top_k=3,
                                          check_invariants=True, **kw)  # fmt: skip
                res = generate(target, p.ids, drafter=d, settings=settings)
                assert sims[name][method]["per_prompt"][p.id] == res.acceptance_lengths, (name, method, p.id)
                accepted += sum(n - 1 for n in res.acceptance_lengths)
    assert accepted > 0  # some drafts were accepted: the comparison reaches past the first slot


def _claims(kind: str, to: str, cfg: DrafterConfig) -> bool:
    """Whether the kind's format record says `convert --to to` writes it."""
    fmt = HEADS[kind].format
    if to == "deepspec":
        return fmt.deepspec_problem is None
    if to == "vllm":
        return fmt.vllm_problem is None
    if to == "gguf":
        return not fmt.gguf_problems(cfg)
    if to == "speculators":
        try:
            fmt.speculators_fields(cfg)
        except ConfigError:
            return False
    return True  # zlab: dflashkit's own layout holds every kind


@pytest.mark.parametrize("kind", KINDS)
def test_converts_to_what_its_record_claims_and_refuses_the_rest(kind, tiny_llama_dir, tmp_path, capsys):
    cfg = tiny_config(kind)
    src = tmp_path / "src"
    save_drafter(random_drafter(cfg, seed=2), src)
    source = read_tensors(src)
    target_gguf = write_target_gguf(tmp_path / "target.gguf", tiny_llama_dir)
    for to in ("zlab", "speculators", "vllm", "deepspec", "gguf"):
        out = tmp_path / (f"{to}.gguf" if to == "gguf" else to)
        target = target_gguf if to == "gguf" else tiny_llama_dir
        rc = main(["convert", str(src), str(out), "--to", to, "--target", str(target)])
        if not _claims(kind, to, cfg):
            line = _one_line_error(capsys, rc)
            assert HEADS[kind].format.title in line or kind in line, (to, line)
            continue
        assert rc == 0 and out.exists(), (to, capsys.readouterr())
        if to in ("zlab", "speculators"):  # read back exactly
            back_cfg, back, _ = load_any(out, num_target_layers=cfg.num_target_layers)
            assert back_cfg.kind == kind and sorted(back) == sorted(source), to
            assert all(torch.equal(back[k], source[k]) for k in source), to
