"""XPress against speculators' own code (opt-in: `pytest -m speculators`, skipped unless scripts/setup_speculators.sh
has made .venv-speculators with speculators 0.9.0): speculators' `XPressDraftModel` loads `convert --to speculators`
of a dflashkit XPress drafter, and its training forward over the same anchors gives the same block states and
backbone logits, the same previous tokens and refiner bias in every pass (teacher-forced, then each free-running
round), and the same loss ({"ce": 0.1, "tv": 0.9}, consistency 0.3 over 3 rounds, base anchor 0.6) as dflashkit's
objective on those blocks; and a speculators export imports back into the same drafter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflashkit.drafter.checkpoint import load_drafter, read_tensors
from dflashkit.drafter.heads import TrainingTerms, head_of
from dflashkit.export.convert import convert
from dflashkit.target.model import Target
from dflashkit.train.config import TrainConfig
from dflashkit.train.losses import DISTRIBUTION_KINDS, LMHead, LossSpec, LossTarget, block_loss, decay_weights
from helpers.checkpoints import small_config, write_checkpoint
from helpers.reference_envs import in_speculators, speculators_python

pytestmark = [
    pytest.mark.speculators,
    pytest.mark.skipif(speculators_python() is None, reason="no reference environment (scripts/setup_speculators.sh)"),
]


def _xpress(tmp_path: Path) -> Path:
    cfg = small_config(kind="xpress", learned_mask_embedding=False, mask_token_id=5, xpress_rank=8, block_size=4)

    def edit(sd: dict) -> None:
        g = torch.Generator().manual_seed(3)
        for key, value in sd.items():
            if "norm" in key:
                continue
            scale = 0.5 if "refiner_head" in key else 0.1
            value.copy_(torch.randn(value.shape, generator=g) * scale)

    return write_checkpoint(tmp_path / "ours", cfg, edit=edit)


def _close(theirs: torch.Tensor, ours: torch.Tensor, key: str) -> None:
    tol = 1e-5 * max(1.0, float(ours.abs().max()))  # float32 both sides, products in another order
    assert theirs.shape == ours.shape, (key, theirs.shape, ours.shape)
    assert float((theirs.float() - ours.float()).abs().max()) <= tol, (key, float((theirs - ours).abs().max()))


def test_speculators_xpress_forward_passes_and_loss_equal_dflashkit(tmp_path: Path, tiny_target_dirs) -> None:
    target = Target.load(tiny_target_dirs["qwen3"])
    src = _xpress(tmp_path)
    convert(src, tmp_path / "spec", to="speculators", target=target)
    drafter = load_drafter(src).eval()
    cfg = drafter.config
    bs = cfg.block_size
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(9))
    anchors = [3, 9, 14]
    out = target.forward(ids, layer_ids=cfg.target_layer_ids)
    gamma = 4.0
    inputs = dict(ids=ids, features=out.features, final=out.final_hidden, doc=torch.zeros(1, 24, dtype=torch.long),
                  anchors=anchors, gamma=gamma)  # fmt: skip
    theirs = in_speculators("speculators_xpress.py", inputs, tmp_path, tmp_path / "spec")
    assert theirs["kind"] == "XPressDraftModel"

    blocks = []
    with torch.no_grad():
        for p in anchors:
            noise = drafter.block_embeddings(ids[:, p : p + 1], target.embed_weight, bs)
            blocks.append(drafter(out.features[:, :p], noise, context_positions=torch.arange(p)[None],
                                  block_positions=torch.arange(p, p + bs)[None])[0])  # fmt: skip
        hidden = torch.stack(blocks)  # (N, bs, H)
        _close(theirs["hidden"], hidden.reshape(-1, hidden.shape[-1]), "hidden")
        base = drafter.logits(hidden, target.lm_head_weight)
        _close(theirs["logits"], base.reshape(-1, base.shape[-1]), "logits")
        # every refiner pass: the same previous tokens, the same bias
        prev_tf = torch.stack([ids[0, p - 1 : p + bs - 1] for p in anchors])  # slot 0: the token before the anchor
        assert theirs["prevs"][0].tolist() == prev_tf.tolist()
        cache = drafter.refiner_head.hidden_cache(hidden)
        assert len(theirs["prevs"]) == 4  # teacher-forced + 3 rounds
        for i, (prev, bias) in enumerate(zip(theirs["prevs"], theirs["biases"], strict=True)):
            _close(bias, drafter.refiner_head.bias(prev, cache), f"bias of pass {i}")

    n = len(anchors)
    targets = theirs["targets"].reshape(n, bs, -1)
    labels = targets.argmax(-1)  # speculators' CE label: the verifier's argmax at a + k − 1
    weights = decay_weights(bs, gamma)
    normalizer = float(theirs["mask"].sum()) + 1e-5  # speculators divides each term by its mask count
    train_cfg = TrainConfig(out=str(tmp_path / "unused"), loss="tv", drafter={"kind": "xpress"})

    def backbone_loss(states, rows, kind=None, extra=None):
        spec = LossSpec(kind=kind or train_cfg.loss, weights=weights, normalizer=normalizer)
        t = LossTarget(logits=targets if spec.kind in DISTRIBUTION_KINDS else None)
        return block_loss(states, LMHead(rows, extra), labels, spec, t)

    terms = TrainingTerms(
        drafter=drafter, hidden=hidden, head_weight=target.lm_head_weight, labels=labels, prev_tokens=prev_tf,
        weights=weights, normalizer=normalizer, step=0, train_cfg=train_cfg, weights_of=None,
        backbone_loss=backbone_loss,
    )  # fmt: skip
    with torch.no_grad():
        own = head_of("xpress").objective(terms)
    assert float(own.loss) == pytest.approx(theirs["loss"], rel=1e-5)

    # and back: the speculators export imports into the same drafter
    convert(tmp_path / "spec", tmp_path / "back", to="zlab")
    a, b = read_tensors(src), read_tensors(tmp_path / "back")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    assert load_drafter(tmp_path / "back").config.to_dict() == cfg.to_dict()
