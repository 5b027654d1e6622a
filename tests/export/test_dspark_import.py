"""DSpark drafters in the other trainers' layouts: dflashkit → speculators (`speculators_model_type: dspark`) →
dflashkit is bit-exact; speculators DSpark variants dflashkit cannot run are refused by field; a DeepSpec checkpoint
(`Qwen3DSparkModel`, the target's config copied, frozen copies of the target's embeddings and LM head saved with the
drafter) imports through `convert --target`, which compares those copies with the target's tables before dropping
them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflashkit.cli import main
from dflashkit.diagnose.inspect_checkpoint import inspect_checkpoint
from dflashkit.drafter.checkpoint import drafter_state_dict, load_drafter, read_tensors
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import CheckpointError, ConfigError
from dflashkit.export.convert import convert
from dflashkit.target.model import Target
from helpers.checkpoints import small_config, write_checkpoint


def _randomise_heads(sd: dict) -> None:
    g = torch.Generator().manual_seed(3)
    for k in ("markov_head.markov_w2.weight", "confidence_head.proj.weight", "confidence_head.proj.bias"):
        sd[k].copy_(torch.randn(sd[k].shape, generator=g))


def test_dspark_speculators_round_trip_is_exact(tmp_path: Path, target: Target) -> None:
    cfg = small_config(kind="dspark", markov_rank=6, draft_vocab_size=20)
    perm = torch.randperm(97, generator=torch.Generator().manual_seed(0))[:20].sort().values

    def edit(sd: dict) -> None:
        _randomise_heads(sd)
        sd["draft_to_target"].copy_(perm)

    src = write_checkpoint(tmp_path / "ours", cfg, edit=edit)
    spec = tmp_path / "spec"
    convert(src, spec, to="speculators", target=target)
    raw = json.loads((spec / "config.json").read_text())
    assert raw["speculators_model_type"] == "dspark" and raw["architectures"] == ["DSparkSpeculator"]
    assert raw["sample_from_anchor"] is True and raw["markov_rank"] == 6 and raw["markov_head_type"] == "vanilla"
    assert raw["enable_confidence_head"] is True and raw["confidence_head_with_markov"] is True
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == cfg.block_size  # every slot
    t = read_tensors(spec)
    assert t["markov_head.markov_w1.weight"].shape == (97, 6)  # W1 over the verifier's vocabulary
    assert t["markov_head.markov_w2.weight"].shape == (20, 6)  # W2 onto the draft vocabulary
    back = tmp_path / "back"
    report = convert(spec, back)
    assert report.source_format == "speculators"
    assert load_drafter(back).config == cfg
    a, b = read_tensors(src), read_tensors(back)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize(
    "change, message",
    [
        ({"markov_head_type": "rnn"}, "markov_head_type 'rnn'"),
        ({"sample_from_anchor": False}, "sample_from_anchor false"),
        ({"confidence_head_with_markov": False}, "confidence_head_with_markov false"),
        ({"markov_rank": 0}, "markov_rank 0"),
        ({"speculators_model_type": "eagle3"}, "speculators_model_type 'eagle3'"),
    ],
)
def test_speculators_dspark_variants_dflashkit_cannot_run_are_refused(tmp_path: Path, change, message) -> None:
    src = write_checkpoint(tmp_path / "ours", small_config(kind="dspark", markov_rank=4))
    convert(src, tmp_path / "spec", to="speculators")
    cfg_file = tmp_path / "spec/config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **change}))
    with pytest.raises(CheckpointError, match=message):
        convert(tmp_path / "spec", tmp_path / "out")


def _deepspec_checkpoint(path: Path, target_dir: Path, target: Target, *, table_dtype=torch.float32, nudge=0.0):
    """A checkpoint as DeepSpec's DSpark trainer saves it: the Qwen3 target's config.json copied with the draft depth
    and the DSpark fields set (build_draft_config), and the draft model's whole state dict — embed_tokens and lm_head
    being frozen copies of the target's tables."""
    raw = json.loads((target_dir / "config.json").read_text())
    raw.update(
        architectures=["Qwen3DSparkModel"],
        num_target_layers=raw["num_hidden_layers"],
        num_hidden_layers=1,
        layer_types=["full_attention"],
        block_size=4,
        tie_word_embeddings=False,
        mask_token_id=90,
        target_layer_ids=[1, 3, 5],
        num_anchors=64,
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        markov_rank=8,
        markov_head_type="vanilla",
    )
    cfg = DrafterConfig.from_zlab_dict(raw)
    torch.manual_seed(1)
    sd = drafter_state_dict(DFlashDrafter(cfg))
    _randomise_heads(sd)
    sd["embed_tokens.weight"] = target.embed_weight.detach().to(table_dtype).clone()
    sd["lm_head.weight"] = (target.lm_head_weight.detach() + nudge).to(table_dtype).clone()
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw))
    return path, cfg, sd


def test_deepspec_checkpoint_imports_after_its_target_tables_are_checked(tmp_path: Path, tiny_target_dirs, capsys):
    target_dir = tiny_target_dirs["qwen3"]
    target = Target.load(target_dir)
    src, cfg, sd = _deepspec_checkpoint(tmp_path / "deepspec", target_dir, target)
    assert cfg.kind == "dspark" and cfg.head_settings.markov_rank == 8 and cfg.target_layer_ids == [1, 3, 5]
    with pytest.raises(CheckpointError, match="DeepSpec's frozen copies of the target's tables"):
        load_drafter(src)  # read as it is, the copies are named and the import command given
    found = [f.line() for f in inspect_checkpoint(src).findings if f.status != "OK"]
    assert len(found) == 1 and found[0].startswith("WARN tensors: unexpected tensors ['embed_tokens.weight'")
    assert "dflashkit convert SRC OUT --target T" in found[0]

    out = tmp_path / "ours"
    assert main(["convert", str(src), str(out), "--target", str(target_dir)]) == 0
    printed = capsys.readouterr().out
    assert "dropped embed_tokens.weight [97, 64]: equal to the target's table" in printed
    assert "dropped lm_head.weight [97, 64]: equal to the target's table" in printed
    drafter = load_drafter(out)
    assert drafter.config == cfg
    own = drafter.state_dict()
    for k, v in sd.items():
        if k not in ("embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(own[k], v), k
    assert set(read_tensors(out)) == set(sd) - {"embed_tokens.weight", "lm_head.weight"}

    report = convert(src, tmp_path / "unchecked")  # no target: dropped, and said so
    assert sum("not compared with the target" in n for n in report.notes) == 2

    bf16, _, _ = _deepspec_checkpoint(tmp_path / "bf16", target_dir, target, table_dtype=torch.bfloat16)
    convert(bf16, tmp_path / "bf16_out", target=target)  # bf16 copies equal the target's tables to bf16 precision

    other, _, _ = _deepspec_checkpoint(tmp_path / "other", target_dir, target, nudge=0.01)
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight' differs from the target's table"):
        convert(other, tmp_path / "refused", target=target)
    assert not (tmp_path / "refused").exists()


def test_deepspec_export_is_what_its_model_runs_and_imports_back_exactly(tmp_path: Path, tiny_target_dirs) -> None:
    target_dir = tiny_target_dirs["qwen3"]
    target = Target.load(target_dir)
    cfg = small_config(kind="dspark", markov_rank=6)  # a learned mask embedding, the whole vocabulary
    src = write_checkpoint(tmp_path / "ours", cfg, edit=_randomise_heads)
    out = tmp_path / "deepspec"
    assert main(["convert", str(src), str(out), "--to", "deepspec", "--target", str(target_dir)]) == 0
    raw = json.loads((out / "config.json").read_text())
    for field in ("target_layer_ids", "mask_token_id", "num_anchors", "enable_confidence_head", "markov_rank"):
        assert field in raw, field  # what Qwen3DSparkModel.__init__ asserts
    assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["markov_head_type"] == "vanilla"
    written = read_tensors(out)
    ours = load_drafter(src)
    mask_id = int(raw["mask_token_id"])
    torch.testing.assert_close(written["lm_head.weight"], target.lm_head_weight, rtol=0, atol=0)
    # DeepSpec embeds the block [anchor, mask × 3] through its own table: the same vectors dflashkit's drafter feeds
    anchors = torch.tensor([[5, 17, 60]])
    ids = torch.cat([anchors.T, torch.full((3, cfg.block_size - 1), mask_id)], dim=1).reshape(1, -1)  # (1, 3·bs)
    theirs = written["embed_tokens.weight"][ids]  # (1, 3·bs, H)
    with torch.no_grad():
        mine = ours.block_embeddings(anchors, target.embed_weight, cfg.block_size)
    torch.testing.assert_close(theirs, mine, rtol=0, atol=0)
    assert mask_id not in anchors  # (a real anchor never meets the substituted row when the id is a spare one)

    found = [f.line() for f in inspect_checkpoint(out).findings if f.status != "OK"]  # the mask is in its row
    assert len(found) == 1 and found[0].startswith("WARN tensors: unexpected tensors ['embed_tokens.weight'")
    assert inspect_checkpoint(out).facts["mask"]["in_embedding_row"] is True

    back = tmp_path / "back"
    report = convert(out, back, target=target)
    assert report.source_format == "deepspec"
    assert any(n == f"learned mask embedding: row {mask_id} of embed_tokens.weight" for n in report.notes)
    again = load_drafter(back)
    assert again.config == ours.config.replace(mask_token_id=mask_id)
    for k, v in ours.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k

    with pytest.raises(CheckpointError, match="draft vocabulary of 20 ids"):
        convert(
            write_checkpoint(
                tmp_path / "v",
                small_config(kind="dspark", draft_vocab_size=20),
                edit=lambda sd: sd["draft_to_target"].copy_(torch.arange(20)),  # a map of 20 distinct ids
            ),
            tmp_path / "x",
            to="deepspec",
            target=target,
        )
    with pytest.raises(CheckpointError, match="a DFlash drafter"):
        convert(write_checkpoint(tmp_path / "d", small_config()), tmp_path / "y", to="deepspec", target=target)
    with pytest.raises(ConfigError, match="--to deepspec needs --target"):
        convert(src, tmp_path / "z", to="deepspec")
