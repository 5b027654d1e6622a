"""The reference implementation: DeepSpec's own `Qwen3DSparkModel` (deepseek-ai/DeepSpec, not on PyPI) against
dflashkit, both ways (opt-in: `DFLASHKIT_DEEPSPEC_SRC=/path/to/DeepSpec pytest -m deepspec`; seconds).

- `convert --to deepspec --target T` exports (a token-row mask and a learned mask written into its embedding row;
  blocks of 4 and 8) load with `Qwen3DSparkModel.from_pretrained`, and its evaluator's draft path
  (`forward_dspark_draft_block` + `build_dspark_proposal`, greedy) drafts the tokens dflashkit drafts, with the same
  Markov-corrected logits and confidence logits, at several anchors;
- a drafter built and saved by DeepSpec (`build_draft_config`, `save_pretrained`) imports with `convert --target T`
  and dflashkit drafts what DeepSpec's model drafts;
- `dspark_loss` equals DeepSpec's loss (`deepspec/modeling/dspark/loss.py`) on the same blocks, with the same
  gradients.
DeepSpec's draft cache calls `crop(max_length)` as older transformers took it; the shim below gives it that call.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from dflashkit.cli import main
from dflashkit.drafter.checkpoint import load_drafter
from dflashkit.export.convert import convert
from dflashkit.target.model import Target
from helpers.checkpoints import small_config, write_checkpoint

SOURCE = os.environ.get("DFLASHKIT_DEEPSPEC_SRC", "")
pytestmark = [
    pytest.mark.deepspec,
    pytest.mark.skipif(
        not (Path(SOURCE) / "deepspec/modeling/dspark/qwen3").is_dir(),
        reason="DFLASHKIT_DEEPSPEC_SRC does not name a DeepSpec checkout",
    ),
]


@pytest.fixture(scope="module")
def deepspec():
    sys.path.insert(0, SOURCE)
    from deepspec.eval.dspark import draft_ops
    from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel
    from deepspec.modeling.dspark.qwen3.config import build_draft_config
    from transformers import DynamicCache

    class Cache(DynamicCache):
        def crop(self, max_length: int) -> None:
            extra = self.get_seq_length() - max_length
            if extra > 0:
                super().crop(-extra)

    yield dict(model=Qwen3DSparkModel, config=build_draft_config, ops=draft_ops, cache=Cache)
    sys.path.remove(SOURCE)


def _ours(
    drafter, target, features: torch.Tensor, ids: torch.Tensor, p: int
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """dflashkit's greedy DSpark draft at anchor p: (drafts, corrected logits (γ, V), confidence logits (γ,))."""
    bs = drafter.config.block_size
    blk = drafter.block_embeddings(ids[:, p : p + 1], target.embed_weight, bs)  # (1, γ, H)
    pos = dict(context_positions=torch.arange(p)[None], block_positions=torch.arange(p, p + bs)[None])
    hidden = drafter(features[:, :p], blk, **pos)[0]  # (γ, H)
    logits = drafter.logits(hidden, target.lm_head_weight)  # (γ, V')
    drafts, corrected = drafter.head.greedy_drafts(drafter, logits, int(ids[0, p]), hidden, target.embed_weight)
    prevs = torch.tensor([int(ids[0, p]), *drafts[:-1]])  # slot k reads the token before it
    return drafts, corrected, drafter.confidence_head(hidden, drafter.markov_head.prev_embeddings(prevs))


def _theirs(ds, model, features: torch.Tensor, ids: torch.Tensor, p: int, bs: int):
    """DeepSpec's evaluator draft path at anchor p, greedy: (drafts, corrected logits, confidence logits)."""
    first = torch.full((1, bs), int(model.mask_token_id), dtype=torch.long)
    first[:, 0] = ids[:, p]
    hidden = ds["ops"].forward_dspark_draft_block(
        model,
        draft_input_ids=first,
        position_ids=torch.arange(p + bs)[None],
        past_key_values_draft=ds["cache"](),
        target_hidden_states=features[:, :p],
        start=p,
        block_size=bs,
    )[:, :bs]
    proposal = ds["ops"].build_dspark_proposal(
        model, draft_input_ids=first, block_hidden=hidden, block_size=bs, temperature=0.0, confidence_threshold=0.0
    )
    _, logits = model.sample_draft_tokens(
        model.compute_logits(hidden), first_prev_token_ids=first[:, 0], temperature=0.0, hidden_states=hidden
    )
    return proposal.verify_input_ids[0, 1:].tolist(), logits[0], proposal.confidence_logits[0]


def _same(ours, theirs) -> None:
    assert theirs[0] == ours[0]  # the drafted tokens
    for a, b in zip(ours[1:], theirs[1:], strict=True):  # float32 both sides: a few ulps of the largest value
        assert float((a - b).abs().max()) <= 1e-5 * max(1.0, float(a.abs().max()))


@pytest.mark.parametrize("learned, block", [(False, 4), (True, 4), (False, 8)])
def test_deepspec_runs_dflashkits_export_as_dflashkit_does(deepspec, tmp_path, tiny_target_dirs, learned, block):
    target = Target.load(tiny_target_dirs["qwen3"])
    cfg = small_config(kind="dspark", markov_rank=6, learned_mask_embedding=learned, block_size=block)
    cfg = cfg if learned else cfg.replace(mask_token_id=5)

    def edit(sd: dict) -> None:
        g = torch.Generator().manual_seed(3)
        for key, value in sd.items():
            if key.startswith(("markov_head.markov_w2", "confidence_head")) or key == "mask_embedding":
                value.copy_(torch.randn(value.shape, generator=g))
            elif value.dim() >= 2 and not key.startswith("markov"):
                value.copy_(torch.randn(value.shape, generator=g) * 0.1)

    src = write_checkpoint(tmp_path / "ours", cfg, edit=edit)
    convert(src, tmp_path / "ds", to="deepspec", target=target)
    model = deepspec["model"].from_pretrained(str(tmp_path / "ds"), dtype=torch.float32, attn_implementation="eager")
    drafter = load_drafter(src).eval()
    ids = torch.randint(1, 97, (1, 24), generator=torch.Generator().manual_seed(7))  # (1, T); token 0: the mask row
    with torch.no_grad():
        features = target.forward(ids, layer_ids=cfg.target_layer_ids).features  # (1, T, K·H)
        for p in (5, 13, 20 - block // 2):
            _same(_ours(drafter, target, features, ids, p), _theirs(deepspec, model.eval(), features, ids, p, block))


def test_a_drafter_deepspec_saved_imports_and_drafts_as_in_deepspec(deepspec, tmp_path, tiny_target_dirs) -> None:
    from transformers import AutoConfig

    tdir = tiny_target_dirs["qwen3"]
    target = Target.load(tdir)
    args = dict(num_draft_layers=2, target_layer_ids=[1, 3, 5], block_size=5, mask_token_id=7, num_anchors=64)
    args |= dict(confidence_head_alpha=1.0, confidence_head_with_markov=True, markov_rank=8, markov_head_type="vanilla")
    ds_cfg = deepspec["config"](
        AutoConfig.from_pretrained(tdir), type("Args", (dict,), {"__getattr__": dict.get})(args)
    )
    ds_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = deepspec["model"](ds_cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    model.initialize_embeddings_and_head(embed_tokens=target.model.get_input_embeddings(), lm_head=target.lm_head)
    model.save_pretrained(tmp_path / "deepspec")
    assert main(["convert", str(tmp_path / "deepspec"), str(tmp_path / "ours"), "--target", str(tdir)]) == 0
    drafter = load_drafter(tmp_path / "ours").eval()
    assert drafter.config.kind == "dspark" and drafter.config.target_layer_ids == [1, 3, 5]
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        features = target.forward(ids, layer_ids=[1, 3, 5]).features
        for p in (4, 12, 18):
            _same(_ours(drafter, target, features, ids, p), _theirs(deepspec, model.eval(), features, ids, p, 5))


def test_the_dspark_loss_and_its_gradients_equal_deepspecs(deepspec) -> None:
    """`dspark_loss` (0.1·CE + 0.9·L1 + 1.0·BCE, weights exp(−k/4) on a valid prefix) against DeepSpec's own
    `_collect_local_terms` + `_build_loss` (one rank) on the same blocks, heads and target logits: the loss and
    its gradients with respect to the hidden states, the Markov head and the confidence head."""
    from deepspec.modeling.dspark import loss as ds_loss
    from deepspec.modeling.dspark.common import AcceptRatePredictor, DSparkForwardOutput
    from deepspec.modeling.dspark.markov_head import VanillaMarkov

    from dflashkit.drafter.heads.dspark_loss import dspark_loss
    from helpers.dspark_blocks import dspark_blocks

    drafter, hidden, head, tokens, valid, labels, prev = dspark_blocks()
    vocab, h_dim, rank = head.shape[0], head.shape[1], drafter.config.head_settings.markov_rank
    markov = VanillaMarkov(vocab_size=vocab, markov_rank=rank)
    markov.load_state_dict(drafter.markov_head.state_dict())
    predictor = AcceptRatePredictor(input_dim=h_dim + rank)
    predictor.load_state_dict(drafter.confidence_head.state_dict())
    target_logits = torch.randn(*labels.shape, vocab) * 2

    ours_h = hidden.clone().requires_grad_()
    ours = dspark_loss(ours_h, head, drafter, labels, prev, target_logits).loss
    ours.backward()

    theirs_h = hidden.clone().requires_grad_()
    draft_logits = markov.apply_block_logits(
        (theirs_h @ head.T)[None], token_ids=prev[None], hidden_states=theirs_h[None]
    )
    emb = markov.get_prev_embeddings(prev)  # (N, γ, r)
    outputs = DSparkForwardOutput(
        draft_logits=draft_logits,
        target_ids=tokens[None, :, 1:],
        eval_mask=valid[None],
        block_keep_mask=valid[None, :, 0],
        confidence_pred=predictor(torch.cat([theirs_h, emb], dim=-1))[None],
        aligned_target_logits=target_logits[None],
    )
    terms, has_confidence = ds_loss._collect_local_terms(outputs=outputs, loss_decay_gamma=4.0, l1_loss_alpha=0.9)
    dens = {k: terms[k] for k in ("ce_loss_den", "l1_loss_den", "confidence_loss_den")}
    theirs = ds_loss._build_loss(
        loss_terms=terms,
        global_denominators=dens,
        ce_loss_alpha=0.1,
        l1_loss_alpha=0.9,
        confidence_head_alpha=1.0,
        has_confidence=has_confidence,
        world_size=1,
    )
    theirs.backward()
    assert has_confidence
    # DeepSpec divides by Σw + 1e-6 (Σw ≈ 13 here): a relative 1e-7 apart from float32 summation order
    assert abs(float(ours.detach()) - float(theirs.detach())) <= 1e-5 * abs(float(theirs.detach()))
    pairs = [
        (ours_h.grad, theirs_h.grad),
        (drafter.markov_head.markov_w1.weight.grad, markov.markov_w1.weight.grad),
        (drafter.markov_head.markov_w2.weight.grad, markov.markov_w2.weight.grad),
        (drafter.confidence_head.proj.weight.grad, predictor.proj.weight.grad),
    ]
    for a, b in pairs:
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
