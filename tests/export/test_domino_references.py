"""Domino against the references' own code (opt-in: `pytest -m speculators`, skipped unless
scripts/setup_speculators.sh has made .venv-speculators, which also holds nvidia-modelopt 0.47.0 and specforge 0.2.0):
on a dflashkit Domino checkpoint and the same block states, token ids and anchors,

- Model-Optimizer's `DominoModule` (loading the checkpoint's `prefix_gru.*` / `embed_proj.*`) and `HFDominoModel`'s
  own `_apply_domino_head` and `_compute_domino_loss` give dflashkit's corrected logits and loss
  ((1 − λ)·CE(corrected) + λ·CE(backbone), slots weighted exp(−k/γ));
- SpecForge's `DominoDraftModel.apply_logits_head` gives the same corrected logits and `OnlineDominoModel`'s
  objective the same weighted sums of both cross-entropies.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from dflashkit.drafter.checkpoint import load_drafter, save_drafter
from dflashkit.drafter.heads import TrainingTerms, head_of
from dflashkit.drafter.heads.domino_net import corrected_logits, token_embeddings
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.train.config import TrainConfig
from helpers.checkpoints import small_config
from helpers.reference_envs import HELPERS, speculators_python

pytestmark = [
    pytest.mark.speculators,
    pytest.mark.skipif(speculators_python() is None, reason="no reference environment (scripts/setup_speculators.sh)"),
]


@pytest.mark.parametrize("prefix", [1, 0])
def test_modelopt_and_specforge_give_dflashkits_corrected_logits_and_loss(tmp_path: Path, prefix: int) -> None:
    cfg = small_config(
        kind="domino", learned_mask_embedding=False, mask_token_id=5, gru_hidden_dim=12, emb_dim=10, block_size=4,
        pure_draft_prefix_len=prefix,
    )  # fmt: skip
    torch.manual_seed(0)
    d = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in d.prefix_gru.parameters():
            p.normal_(0, 0.5)
        d.embed_proj[2].weight.normal_(0, 1.0)
    save_drafter(d, tmp_path / "ours")
    d = load_drafter(tmp_path / "ours")
    g = torch.Generator().manual_seed(1)
    v, h, bs = cfg.vocab_size, cfg.hidden_size, cfg.block_size
    ids = torch.randint(0, v, (1, 24), generator=g)
    anchors = torch.tensor([[2, 7, 11, 18]])  # every label a + k + 1 ≤ 22 lies in the row
    n = anchors.shape[1]
    hidden = torch.randn(1, n * bs, h, generator=g)
    lm_head, embed = torch.randn(v, h, generator=g) * 0.3, torch.randn(v, h, generator=g)
    gamma, lam = 7.0, 0.35
    inputs = dict(
        input_ids=ids, anchors=anchors, hidden=hidden, lm_head=lm_head, embed=embed,
        loss_mask=torch.ones(1, 24), lambda_base=lam, gamma=gamma,
    )  # fmt: skip
    torch.save(inputs, tmp_path / "in.pt")
    cmd = [str(speculators_python()), str(HELPERS / "reference_domino.py"), str(tmp_path / "ours")]
    run = subprocess.run([*cmd, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    ref = torch.load(tmp_path / "out.pt")

    # dflashkit on the same blocks: slot k's label is the token at a + k + 1, its previous tokens a … a + k
    k = torch.arange(bs)
    labels = ids[0, anchors[0][:, None] + k + 1]  # (N, bs)
    prevs = ids[0, anchors[0][:, None] + k]  # (N, bs)
    hid = hidden.reshape(n, bs, h)
    with torch.no_grad():
        base = hid @ lm_head.t()
        ours = corrected_logits(d, base, hid, token_embeddings(d, prevs, embed)).reshape(1, n * bs, v)
    for name in ("modelopt", "specforge"):
        torch.testing.assert_close(ours, ref[name]["final"].float(), rtol=1e-5, atol=1e-5, msg=name)
    weights = torch.exp(-k.float() / gamma)
    normalizer = float(weights.sum()) * n
    cfg_train = TrainConfig(lambda_base_start=lam, lambda_base_decay_ratio=1.0)
    terms = TrainingTerms(
        drafter=d, hidden=hid, head_weight=lm_head, labels=labels, prev_tokens=prevs, weights=weights,
        normalizer=normalizer, step=0, train_cfg=cfg_train, weights_of=None, embed_weight=embed, total_steps=10,
    )  # fmt: skip
    with torch.no_grad():
        own = head_of("domino").objective(terms)
    assert float(own.loss) == pytest.approx(float(ref["modelopt"]["loss"]), rel=1e-5)
    sf = ref["specforge"]
    want = ((1 - lam) * float(sf["final_num"]) + lam * float(sf["base_num"])) / float(sf["den"])
    assert float(own.loss) == pytest.approx(want, rel=1e-5)
