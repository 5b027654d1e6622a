"""DFlash2 against the references' own code (opt-in: `pytest -m speculators`, skipped unless
scripts/setup_speculators.sh has made .venv-speculators, which holds speculators 0.9.0 and z-lab's dflash 0.1.0):

- z-lab's `DFlash2DraftModel` (dflash 0.1.0) loads dflashkit's checkpoint and gives the same draft-slot hidden states,
  unary logits (output multiplier, softcap), candidates, greedy selector walk and selector scores; and a checkpoint it
  saves itself (`save_pretrained`, random weights) imports into dflashkit and drafts the same;
- speculators' `DFlash2DraftModel` loads `convert --to speculators` and its training forward on one anchor gives the
  same block states and unary logits, and its selector objective (gold injected at rank K) the same candidates,
  scores, per-slot cross-entropies and decayed sum as dflashkit's selector term on that block.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflashkit.drafter.checkpoint import load_drafter
from dflashkit.drafter.heads import TrainingTerms
from dflashkit.drafter.heads.dflash2_draft import walk
from dflashkit.drafter.heads.dflash2_loss import selector_terms
from dflashkit.export.convert import convert
from dflashkit.target.model import Target
from dflashkit.train.losses import decay_weights
from helpers.checkpoints import small_config, write_checkpoint
from helpers.reference_envs import in_speculators, speculators_python

pytestmark = [
    pytest.mark.speculators,
    pytest.mark.skipif(speculators_python() is None, reason="no reference environment (scripts/setup_speculators.sh)"),
]


def _dflash2(tmp_path: Path, **fields) -> Path:
    cfg = small_config(
        kind="dflash2", learned_mask_embedding=False, mask_token_id=5, conv_group_size=16, conv_kernel_size=2,
        selector_rank=8, selector_top_k=4, block_size=5, **fields,
    )  # fmt: skip

    def edit(sd: dict) -> None:
        g = torch.Generator().manual_seed(3)
        for key, value in sd.items():
            if "norm" in key:
                continue
            scale = 0.3 if "conv" in key else 0.5 if "codebook" in key else 0.1
            value.copy_(torch.randn(value.shape, generator=g) * scale)

    return write_checkpoint(tmp_path / "ours", cfg, edit=edit)


def _our_block(drafter, target, ids, p):
    cfg = drafter.config
    bs = cfg.block_size
    with torch.no_grad():
        out = target.forward(ids, layer_ids=cfg.target_layer_ids)
        noise = drafter.block_embeddings(ids[:, p : p + 1], target.embed_weight, bs)  # (1, bs, H)
        hidden = drafter(
            out.features[:, :p],
            noise,
            context_positions=torch.arange(p)[None],
            block_positions=torch.arange(p, p + bs)[None],
        )[0]  # (bs, H)
        unary = drafter.logits(hidden[1:], target.lm_head_weight)  # (bs − 1, V)
    return out, noise, hidden, unary


def _close(theirs: torch.Tensor, ours: torch.Tensor, key: str) -> None:
    tol = 1e-5 * max(1.0, float(ours.abs().max()))  # float32 both sides, products in another order
    assert theirs.shape == ours.shape, key
    assert float((theirs.float() - ours.float()).abs().max()) <= tol, (key, float((theirs - ours).abs().max()))


@pytest.mark.parametrize("scaled", [False, True])
def test_zlab_dflash2_model_drafts_as_dflashkit(scaled: bool, tmp_path: Path, tiny_target_dirs) -> None:
    extra = dict(output_multiplier=1.7, final_logit_softcapping=9.0, input_embedding_scale=0.8) if scaled else {}
    target = Target.load(tiny_target_dirs["qwen3"])
    drafter = load_drafter(_dflash2(tmp_path, **extra)).eval()
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(7))
    p = 13
    out, noise, hidden, unary = _our_block(drafter, target, ids, p)
    drafts, _, dense = walk(drafter, hidden[1:], unary, int(ids[0, p]))
    positions = torch.arange(p + drafter.config.block_size)[None]
    inputs = dict(features=out.features[:, :p], noise=noise, positions=positions,
                  lm_head=target.lm_head_weight.float(), anchor=int(ids[0, p]))  # fmt: skip
    theirs = in_speculators("dflash_reference.py", inputs, tmp_path, "load", tmp_path / "ours")
    _close(theirs["hidden"], hidden[1:], "hidden")
    _close(theirs["logits"], unary, "logits")
    assert theirs["path"].tolist() == drafts
    for j in range(len(drafts)):
        assert sorted(theirs["candidates"][j].tolist()) == sorted(unary[j].topk(4).indices.tolist())
        _close(theirs["scores"][j], dense[j, theirs["candidates"][j]], f"scores {j}")


def test_a_checkpoint_saved_by_zlab_imports_and_drafts_the_same(tmp_path: Path, tiny_target_dirs) -> None:
    target = Target.load(tiny_target_dirs["qwen3"])
    ours = load_drafter(_dflash2(tmp_path))
    theirs_dir = tmp_path / "zlab"
    theirs_dir.mkdir()
    (theirs_dir / "config.json").write_text((tmp_path / "ours" / "config.json").read_text())
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(8))
    p = 11
    out, noise, _, _ = _our_block(ours, target, ids, p)
    inputs = dict(features=out.features[:, :p], noise=noise, positions=torch.arange(p + 5)[None],
                  lm_head=target.lm_head_weight.float(), anchor=int(ids[0, p]))  # fmt: skip
    theirs = in_speculators("dflash_reference.py", inputs, tmp_path, "save", theirs_dir)
    imported = load_drafter(theirs_dir).eval()
    _, _, hidden, unary = _our_block(imported, target, ids, p)
    _close(theirs["hidden"], hidden[1:], "hidden")
    _close(theirs["logits"], unary, "logits")
    assert theirs["path"].tolist() == walk(imported, hidden[1:], unary, int(ids[0, p]))[0]


def test_speculators_dflash2_forward_and_selector_loss_equal_dflashkit(tmp_path: Path, tiny_target_dirs) -> None:
    target = Target.load(tiny_target_dirs["qwen3"])
    src = _dflash2(tmp_path)
    convert(src, tmp_path / "spec", to="speculators", target=target)
    drafter = load_drafter(src).eval()
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(9))
    p, bs = 13, 5
    out, _, hidden, _ = _our_block(drafter, target, ids, p)
    gamma = 4.0
    inputs = dict(ids=ids, features=out.features, final=out.final_hidden, anchor=p, gamma=gamma)
    theirs = in_speculators("speculators_dflash2.py", inputs, tmp_path, tmp_path / "spec")
    assert theirs["kind"] == "DFlash2DraftModel"
    _close(theirs["hidden"], hidden, "hidden")
    with torch.no_grad():
        full = drafter.logits(hidden, target.lm_head_weight)
    _close(theirs["logits"], full, "logits")
    labels = theirs["target_ids"].clone()[None]  # speculators' label: the verifier's argmax at a + k − 1
    labels[0, 0] = -100  # the anchor slot
    prevs = ids[0, p - 1 : p + bs - 1].clone()[None]
    prevs[0, 0] = ids[0, p]
    assert prevs[0, 1:].tolist() == theirs["predecessors"][1:].tolist()
    weights = decay_weights(bs, gamma)
    cfg = type("C", (), dict(selector_rule="inject", selector_decay=True, selector_weight=1.0, selector_warmup_steps=0,
                             selector_ramp_steps=0))  # fmt: skip
    terms = TrainingTerms(drafter=drafter, hidden=hidden[None], head_weight=target.lm_head_weight, labels=labels,
                          prev_tokens=prevs, weights=weights, normalizer=1.0, step=0, train_cfg=cfg,
                          weights_of=None)  # fmt: skip
    with torch.no_grad():
        ce, _, gold, scores = selector_terms(terms, "inject")
    assert gold[0, 1:].tolist() == theirs["contains"][1:].tolist()
    _close(theirs["scores"][1:], scores, "scores")
    _close(theirs["ce"][1:], ce[0, 1:], "ce")
    # speculators reduces Σ_k w_k·CE_k over the block's valid slots by their count (bs); dflashkit by its normaliser
    ours = float((weights * ce[0]).sum()) / bs
    assert float(theirs["loss"]) == pytest.approx(ours, rel=1e-5)
