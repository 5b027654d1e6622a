"""The reference implementation: DeepSpec's own `Qwen3DSparkModel` (deepseek-ai/DeepSpec, not on PyPI) against
dflashkit, both ways (opt-in: `DFLASHKIT_DEEPSPEC_SRC=/path/to/DeepSpec pytest -m deepspec`; seconds).

- `convert --to deepspec --target T` exports (a token-row mask and a learned mask written into its embedding row;
  blocks of 4 and 8) load with `Qwen3DSparkModel.from_pretrained`, and its evaluator's draft path
  (`forward_dspark_draft_block` + `build_dspark_proposal`, greedy) drafts the tokens dflashkit drafts, with the same
  Markov-corrected logits and confidence logits, at several anchors;
- a drafter built and saved by DeepSpec (`build_draft_config`, `save_pretrained`) imports with `convert --target T`
  and dflashkit drafts what DeepSpec's model drafts.
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
    drafts, corrected = drafter.greedy_markov(drafter.logits(hidden, target.lm_head_weight), int(ids[0, p]))
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
