"""The reference implementation: dflashkit's `convert --to speculators` exports loaded by vllm-project/speculators'
own DFlash and DSpark models (opt-in: `pytest -m speculators`, skipped unless scripts/setup_speculators.sh has made
.venv-speculators; about a minute).

For each drafter (random weights and heads; DFlash and DSpark; full and reduced vocabularies with the draft ids out of
target-id order; one full-attention layer, or a sliding-window layer before a full one, causal or not in the block)
speculators' `SpeculatorModel.from_pretrained` loads the export — its embeddings and verifier tables from the target
named in the export — and its training forward on one anchor gives the block's final-normed hidden states, draft
logits (with the Markov bias, teacher-forced) and confidence logits equal to dflashkit's to float32 rounding.
D-PACE's position weights equal speculators' `dpace_loss_decay` on the same cross-entropies and masks.
The sliding window is wider than the context: speculators' training counts a window from the anchor, dflashkit (as
z-lab and vLLM) from each slot (the import notes say so), so a binding window differs by design.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflashkit.drafter.checkpoint import load_drafter
from dflashkit.export.convert import convert
from dflashkit.target.model import Target
from helpers.checkpoints import small_config, write_checkpoint
from helpers.reference_envs import in_speculators, speculators_python

pytestmark = [
    pytest.mark.speculators,
    pytest.mark.skipif(
        speculators_python() is None, reason="no speculators environment (scripts/setup_speculators.sh)"
    ),
]

CASES = {
    "dflash-full-vocab": dict(kind="dflash", draft_vocab=None, layers="full", target="llama"),
    "dflash-reduced-sliding-causal": dict(kind="dflash", draft_vocab=20, layers="sliding", target="qwen3"),
    "dspark-full-vocab": dict(kind="dspark", draft_vocab=None, layers="full", target="qwen3"),
    "dspark-reduced-sliding-bidirectional": dict(kind="dspark", draft_vocab=20, layers="bidirectional", target="llama"),
}


def _drafter(tmp_path: Path, case: dict) -> tuple[Path, torch.Tensor]:
    changes: dict = dict(kind=case["kind"], learned_mask_embedding=False, mask_token_id=5)
    if case["kind"] == "dspark":
        changes["markov_rank"] = 6
    if case["layers"] != "full":
        changes.update(
            num_hidden_layers=2,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=64,
            is_causal=None if case["layers"] == "sliding" else False,
        )
    order = torch.arange(97)
    if case["draft_vocab"]:
        changes["draft_vocab_size"] = case["draft_vocab"]
        order = torch.randperm(97, generator=torch.Generator().manual_seed(0))[: case["draft_vocab"]]  # unsorted
    cfg = small_config(**changes)

    def edit(sd: dict) -> None:
        g = torch.Generator().manual_seed(3)
        for key, value in sd.items():
            if key.startswith(("markov_head.markov_w2", "confidence_head")):
                value.copy_(torch.randn(value.shape, generator=g))  # W2 starts at zero: give the bias a value
            elif value.dim() >= 2 and not key.startswith("markov"):
                value.copy_(torch.randn(value.shape, generator=g) * 0.1)  # a real spread of logits
        if "draft_to_target" in sd:
            sd["draft_to_target"].copy_(order)

    return write_checkpoint(tmp_path / "ours", cfg, edit=edit), order


@pytest.mark.parametrize("name", list(CASES))
def test_speculators_own_model_runs_the_export_as_dflashkit_does(name, tmp_path, tiny_target_dirs) -> None:
    case = CASES[name]
    target_dir = tiny_target_dirs[case["target"]]
    target = Target.load(target_dir)
    src, order = _drafter(tmp_path, case)
    report = convert(src, tmp_path / "spec", to="speculators", target=target)
    assert not any("verifier.name_or_path left empty" in n for n in report.notes)
    drafter = load_drafter(src).eval()
    cfg = drafter.config
    bs, p = cfg.block_size, 13
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(7))  # (1, T)
    with torch.no_grad():
        out = target.forward(ids, layer_ids=cfg.target_layer_ids)
        blk = drafter.block_embeddings(ids[:, p : p + 1], target.embed_weight, bs)  # (1, γ, H)
        hidden = drafter(
            out.features[:, :p],
            blk,
            context_positions=torch.arange(p)[None],
            block_positions=torch.arange(p, p + bs)[None],
        )[0]  # (γ, H)
        logits = drafter.logits(hidden, target.lm_head_weight)  # (γ, V')
        confidence = None
        if drafter.head.kind == "dspark":
            prev = ids[0, p : p + bs]  # teacher-forced previous tokens: the anchor, then the block's true tokens
            logits = logits + drafter.markov_head.bias(prev)
            confidence = drafter.confidence_head(hidden, drafter.markov_head.prev_embeddings(prev))
    logits = logits[:, order.argsort()]  # the export orders draft ids by target id
    inputs = {"ids": ids, "features": out.features, "final": out.final_hidden, "anchor": p}
    theirs = in_speculators("speculators_forward.py", inputs, tmp_path, tmp_path / "spec")
    assert theirs["kind"] == ("DSparkDraftModel" if drafter.head.kind == "dspark" else "DFlashDraftModel")
    assert theirs["block_positions"].tolist() == list(range(p, p + bs))
    pairs = {"hidden": hidden, "logits": logits, **({"confidence": confidence} if confidence is not None else {})}
    for key, ours in pairs.items():
        # float32 on both sides, the same products in another order: rounding of a few ulps of the largest value
        tol = 1e-5 * max(1.0, float(ours.abs().max()))
        assert theirs[key].shape == ours.shape, key
        assert float((theirs[key] - ours).abs().max()) <= tol, (key, float((theirs[key] - ours).abs().max()))


@pytest.mark.parametrize("alpha", [0.5, 0.2, 1.0])
def test_dpace_weights_equal_speculators_own(alpha, tmp_path) -> None:
    """D-PACE's position weights (`dpace_weights`) against speculators' `dpace_loss_decay`, the default DFlash loss
    weighting there, on the same per-slot cross-entropies and masks (slot 0, the given token, never valid)."""
    from dflashkit.train.losses import dpace_weights

    g = torch.Generator().manual_seed(5)
    ce = torch.rand(9, 6, generator=g) * 4  # (N, γ)
    lengths = torch.tensor([0, 1, 2, 3, 4, 5, 6, 6, 3])
    valid = (torch.arange(6)[None] < lengths[:, None]) & (torch.arange(6)[None] > 0)  # (N, γ)
    valid[7, 3] = False  # a hole inside a block
    theirs = in_speculators("speculators_dpace.py", {"ce": ce, "valid": valid, "alpha": alpha}, tmp_path)["weights"]
    torch.testing.assert_close(dpace_weights(ce, valid, alpha), theirs, rtol=1e-6, atol=1e-7)


def test_dspark_with_dpace_equals_speculators_loss(tmp_path) -> None:
    """DSpark + D-PACE (`position_weights: dpace`, L1 weight 0) against speculators' DSpark loss with `--loss-fn ce
    --per-position-loss-weight dpace`: D-PACE-weighted CE plus the confidence BCE on exp(−k/4), over the valid slots."""
    from dflashkit.drafter.heads.dspark_loss import DSparkLossSpec, DSparkLossWeights, dspark_loss
    from dflashkit.train.losses import dpace_weights
    from helpers.dspark_blocks import dspark_blocks

    drafter, hidden, head, tokens, valid, labels, prev = dspark_blocks()
    (n, g), vocab = labels.shape, head.shape[0]
    targets = torch.randn(n, g, vocab) * 2 + 20 * F.one_hot(tokens[:, 1:], vocab)  # speculators' label: the argmax
    with torch.no_grad():
        emb = drafter.markov_head.prev_embeddings(prev)
        logits = hidden @ head.T + drafter.markov_head.bias(prev)  # (N, γ, V)
        ce = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1), reduction="none").view(n, g)
        confidence = drafter.confidence_head(hidden, emb)
        spec = DSparkLossSpec(DSparkLossWeights(ce=1.0, l1=0.0), dpace=lambda ce, m: dpace_weights(ce, m, 0.5))
        ours = dspark_loss(hidden, head, drafter, labels, prev, targets, spec).loss
    payload = {"ce": ce * valid, "valid": valid, "alpha": 0.5, "logits": logits, "targets": targets}
    theirs = float(in_speculators("speculators_dpace.py", {**payload, "confidence": confidence}, tmp_path)["loss"])
    # speculators divides by Σm + 1e-5 (the CE) and Σm + 1e-8 (the BCE), Σm = 20 here: a relative 5e-7 apart
    assert abs(float(ours) - theirs) <= 2e-6 * abs(theirs), (float(ours), theirs)


@pytest.mark.parametrize("kind", ["tv", "nla", "lk_hybrid"])
def test_acceptance_losses_equal_speculators_own(kind: str, tmp_path) -> None:
    """`loss: tv | nla | lk_hybrid` against speculators' eager `tv_loss`, `neg_log_acceptance_loss` and
    `lk_hybrid_loss` on the same logits: dflashkit's slot-weighted mean equals the same weighting of their
    per-position values (float32, the precision both train in)."""
    from dflashkit.train.losses import LossSpec, LossTarget, block_loss, decay_weights

    g = torch.Generator().manual_seed(9)
    n, bs, h, v = 6, 4, 8, 13
    hidden = torch.randn(n, bs, h, generator=g)
    head = torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (n, bs), generator=g)
    labels[torch.rand(n, bs, generator=g) < 0.2] = -100
    targets = torch.randn(n, bs, v, generator=g) * 2
    ours = block_loss(hidden, head, labels, LossSpec(kind=kind, lk_eta=2.0), LossTarget(logits=targets)).loss
    logits = (hidden @ head.T).reshape(-1, v)
    per = in_speculators(
        "speculators_losses.py", {"logits": logits, "targets": targets.reshape(-1, v), "eta": 2.0}, tmp_path
    )[kind]
    w = decay_weights(bs)[None].expand(n, bs).reshape(-1) * (labels.reshape(-1) != -100)
    theirs = (per * w).sum() / w.sum()
    torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=1e-7)
