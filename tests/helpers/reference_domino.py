"""Run Model-Optimizer's and SpecForge's own Domino code on a dflashkit Domino checkpoint (inside .venv-speculators,
where scripts/setup_speculators.sh installs nvidia-modelopt 0.47.0 and specforge 0.2.0 with --no-deps).

    python reference_domino.py CKPT_DIR INPUTS.pt OUTPUT.pt

CKPT_DIR: dflashkit's checkpoint (z-lab layout: config.json with dflash_config.projector_type "domino",
model.safetensors). INPUTS.pt: input_ids (1, T), anchors (1, N), hidden (1, N·bs, H) the backbone's block output,
lm_head (V, H), embed (V, H), loss_mask (1, T), lambda_base, gamma. OUTPUT.pt: the corrected logits and the loss of
Model-Optimizer's `HFDominoModel` methods (on its `DominoModule` holding the checkpoint's head), and SpecForge's
`DominoDraftModel.apply_logits_head` logits and `OnlineDominoModel` objective sums.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def _config(ckpt: Path):
    from transformers import Qwen3Config

    raw = json.loads((ckpt / "config.json").read_text())
    cfg = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "dflash_config")})
    cfg.dflash_config = dict(raw["dflash_config"])
    for key in ("block_size", "num_target_layers"):
        setattr(cfg, key, raw[key])
    for key, value in raw["dflash_config"].items():  # Model-Optimizer reads the head's fields from the config
        setattr(cfg, key, value)
    return cfg


def _head_tensors(ckpt: Path) -> dict:
    return {
        k: v
        for k, v in load_file(str(ckpt / "model.safetensors")).items()
        if k.startswith(("prefix_gru", "embed_proj"))
    }


def modelopt(ckpt: Path, x: dict) -> dict:
    from modelopt.torch.speculative.plugins.hf_domino import HFDominoModel
    from modelopt.torch.speculative.plugins.modeling_domino import DominoModule

    cfg = _config(ckpt)
    module = DominoModule(cfg)
    missing, unexpected = module.load_state_dict(_head_tensors(ckpt), strict=False)
    assert not unexpected and not [k for k in missing if k.startswith(("prefix_gru", "embed_proj"))], missing
    bs, n = cfg.block_size, x["anchors"].shape[1]
    me = SimpleNamespace(
        dflash_block_size=bs, dflash_module=module, dflash_loss_decay_factor=x["gamma"],
        _base_model_embeddings=lambda ids: F.embedding(ids, x["embed"]),
        _current_lambda_base=lambda: x["lambda_base"],
    )  # fmt: skip
    base = x["hidden"] @ x["lm_head"].t()  # (1, N·bs, V)
    with torch.no_grad():
        final = HFDominoModel._apply_domino_head(me, x["hidden"], base, x["input_ids"], x["anchors"], n)
        keep = torch.ones_like(x["anchors"], dtype=torch.bool)
        loss, _, metrics = HFDominoModel._compute_domino_loss(
            me, base, final, x["input_ids"], x["anchors"], keep, x["loss_mask"]
        )
    return {"final": final, "loss": loss, "final_loss": metrics["final_loss"], "base_loss": metrics["base_loss"]}


def specforge(ckpt: Path, x: dict) -> dict:
    from specforge.algorithms.common.dflash_family_model import OnlineDominoModel
    from specforge.modeling.draft.domino import DominoDraftModel

    cfg = _config(ckpt)
    draft = DominoDraftModel(cfg)
    missing, _ = draft.load_state_dict(_head_tensors(ckpt), strict=False)
    assert not [k for k in missing if k.startswith(("prefix_gru", "embed_proj"))], missing
    v, h = x["lm_head"].shape
    lm_head, embed = torch.nn.Linear(h, v, bias=False), torch.nn.Embedding(v, h)
    with torch.no_grad():
        lm_head.weight.copy_(x["lm_head"])
        embed.weight.copy_(x["embed"])
    bs, n = cfg.block_size, x["anchors"].shape[1]
    online = OnlineDominoModel(
        draft_model=draft, target_lm_head=lm_head, target_embed_tokens=embed, mask_token_id=cfg.dflash_config[
            "mask_token_id"], block_size=bs, attention_backend="sdpa", loss_decay_gamma=x["gamma"], shift_label=True,
    )  # fmt: skip
    ids, anchors = x["input_ids"], x["anchors"]
    t = ids.shape[1]
    label_idx = (anchors[..., None] + torch.arange(1, bs + 1)).clamp(max=t - 1)  # (1, N, bs)
    target_ids = torch.gather(ids[:, None].expand(-1, n, -1), 2, label_idx)
    hidden4d = x["hidden"].reshape(1, n, bs, h)
    with torch.no_grad():
        _, prev_ids = online._build_domino_head_inputs(ids, anchors, target_ids, x["hidden"])
        base4d = hidden4d @ x["lm_head"].t()
        final = draft.apply_logits_head(base4d, prev_token_embeddings=embed(prev_ids), hidden_states=hidden4d)
        weight = torch.exp(-torch.arange(bs, dtype=torch.float32) / x["gamma"]).expand(1, n, bs).contiguous()
        sums = online._domino_objective_chunk_terms(hidden4d, prev_ids, target_ids, weight, torch.ones_like(weight))
    return {"final": final.reshape(1, n * bs, -1), "final_num": sums[0], "base_num": sums[1], "den": sums[2]}


def main() -> None:
    ckpt, src, dst = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    x = torch.load(src)
    torch.save({"modelopt": modelopt(ckpt, x), "specforge": specforge(ckpt, x)}, dst)


if __name__ == "__main__":
    main()
