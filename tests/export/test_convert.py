"""Converters: z-lab → speculators → z-lab is bit-exact; a hand-built speculators checkpoint imports with its
layer ids shifted by one and the target's tables dropped; the exported config carries what vLLM and SGLang read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflashkit.cli import main
from dflashkit.drafter.checkpoint import load_drafter, read_tensors
from dflashkit.errors import CheckpointError, ConfigError
from dflashkit.export.convert import convert, map_key
from dflashkit.export.speculators_format import ascending_draft_ids
from helpers.checkpoints import small_config, speculators_checkpoint, write_checkpoint

# Fields the serving engines' DFlash loaders read from the draft config.json (dotted = inside dflash_config).
# vLLM: vllm/model_executor/models/qwen3_dflash.py (DFlashQwen3Model / DFlashQwen3DecoderLayer /
#       _resolve_layer_attention) and vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py
#       (get_eagle3_aux_layers_from_config: dflash_config.target_layer_ids, + 1 for its capture points).
VLLM_DFLASH_FIELDS = (
    "architectures",
    "hidden_size",
    "vocab_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_parameters",
    "attention_bias",
    "layer_types",
    "sliding_window",
    "dflash_config.mask_token_id",
    "dflash_config.target_layer_ids",
)
# SGLang: python/sglang/srt/models/dflash.py (DFlashAttention / DFlashMLP / DFlashDraftModel) and
#         python/sglang/srt/speculative/dflash_utils.py (parse_dflash_draft_config, get_dflash_layer_types).
SGLANG_DFLASH_FIELDS = (
    "architectures",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_theta",
    "layer_types",
    "sliding_window",
    "num_target_layers",
    "block_size",
    "dflash_config.target_layer_ids",
    "dflash_config.mask_token_id",
)


def lookup(raw: dict, dotted: str):
    obj = raw
    for part in dotted.split("."):
        assert part in obj, f"exported config.json lacks '{dotted}'"
        obj = obj[part]
    return obj


def test_zlab_speculators_zlab_round_trip_is_exact(tmp_path, target):
    cfg = small_config(
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=32,
        draft_vocab_size=20,
        is_causal=False,
    )
    ids = torch.randperm(97)[:20].sort().values  # draft ids ascending by target id, as dflashkit builds them
    src = write_checkpoint(tmp_path / "z", cfg, edit=lambda sd: sd["draft_to_target"].copy_(ids))
    spec = tmp_path / "spec"
    with pytest.raises(CheckpointError, match="pass --target"):  # the reduced head's rows come from the target
        convert(src, spec, to="speculators")
    convert(src, spec, to="speculators", target=target)
    raw = json.loads((spec / "config.json").read_text())
    assert raw["aux_hidden_state_layer_ids"] == [2, 3, 4, 5, 6]  # hidden_states indices: + 1
    assert raw["transformer_layer_config"]["num_attention_heads"] == 4 and raw["sliding_window_non_causal"] is True
    t = read_tensors(spec)
    a = read_tensors(src)
    assert torch.equal(t["d2t"] + torch.arange(20), a["draft_to_target"]) and int(t["t2d"].sum()) == 20
    # speculators' model loads a reduced head only from the checkpoint: the target's rows of the draft ids
    assert torch.equal(t["lm_head.weight"], target.lm_head_weight.float()[ids])
    back = tmp_path / "back"
    report = convert(spec, back)
    assert report.source_format == "speculators" and report.out_format == "zlab"
    assert load_drafter(back).config == cfg
    b = read_tensors(back)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_speculators_checkpoint_imports_with_shifted_ids_and_dropped_tables(tmp_path, capsys):
    src, sd, _ = speculators_checkpoint(tmp_path / "spec")
    out = tmp_path / "z"
    assert main(["convert", str(src), str(out), "--num-target-layers", "8"]) == 0
    printed = capsys.readouterr().out
    assert "aux_hidden_state_layer_ids [2, 4, 6] (hidden_states indices) → z-lab target_layer_ids [1, 3, 5]" in printed
    assert "dropped embed_tokens.weight [97, 64]" in printed and "dropped verifier_norm.weight [64]" in printed
    drafter = load_drafter(out)
    c = drafter.config
    assert (c.target_layer_ids, c.num_target_layers, c.mask_token_id, c.block_size, c.rope_theta) == (
        [1, 3, 5],
        8,
        90,
        8,
        10000.0,
    )
    own = drafter.state_dict()
    for k, v in sd.items():
        assert torch.equal(own[k], v), k
    assert set(read_tensors(out)) == set(sd)
    # without --num-target-layers the assumption is stated
    report = convert(src, tmp_path / "z2")
    assert any("num_target_layers is not recorded in a speculators config; assumed 9" in n for n in report.notes)


def test_speculators_reduced_vocabulary(tmp_path):
    src, _, tables = speculators_checkpoint(tmp_path / "spec", draft_vocab=12)
    report = convert(src, tmp_path / "z", num_target_layers=8)
    d = load_drafter(tmp_path / "z")
    assert d.config.draft_vocab_size == 12
    assert torch.equal(d.draft_to_target, tables["d2t"] + torch.arange(12))  # target id = draft id + d2t
    assert any(n.startswith("dropped lm_head.weight [12, 64]") for n in report.notes)
    assert json.loads((tmp_path / "z/config.json").read_text())["draft_vocab_size"] == 12


@pytest.mark.parametrize(
    "change, message",
    [
        ({"shift_label": True}, "shift_label: true"),
        ({"aux_hidden_state_layer_ids": [0, 4, 6]}, "contains 0 \\(the embedding output\\)"),
        ({"projector_type": "domino"}, "projector_type 'domino'"),
        ({"mask_token_id": None}, "mask_token_id is not set"),
    ],
)
def test_speculators_refusals_name_the_field(tmp_path, change, message):
    src, _, _ = speculators_checkpoint(tmp_path / "spec", **change)
    with pytest.raises(CheckpointError, match=message):
        convert(src, tmp_path / "out")


def test_unknown_tensor_and_key_renames(tmp_path):
    src, _, _ = speculators_checkpoint(tmp_path / "spec", extra_keys={"markov_head.weight": torch.zeros(4, 4)})
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'markov_head.weight' \[4, 4\]"):
        convert(src, tmp_path / "out")
    assert map_key("model.layers.1.mlp.up_proj.weight") == "layers.1.mlp.up_proj.weight"
    assert map_key("midlayer.self_attn.q_proj.weight") == "layers.0.self_attn.q_proj.weight"
    assert map_key("encoder.fc.weight") == "fc.weight"
    assert map_key("encoder.output_norm_enc.weight") == "hidden_norm.weight"


def test_export_carries_every_field_the_serving_loaders_read(tmp_path):
    src = write_checkpoint(tmp_path / "ours", small_config(target_layer_ids=[1, 3, 5]))
    convert(src, tmp_path / "export")
    raw = json.loads((tmp_path / "export/config.json").read_text())
    for name in VLLM_DFLASH_FIELDS + SGLANG_DFLASH_FIELDS:
        lookup(raw, name)
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["hidden_act"] == "silu"  # SGLang: silu only
    assert raw["dflash_config"]["target_layer_ids"] == [1, 3, 5]  # decoder-layer indices (vLLM adds 1)
    assert raw["rope_parameters"]["rope_theta"] == raw["rope_theta"]
    mask = torch.load(tmp_path / "export/mask_embedding.pt", weights_only=True)  # vLLM's override file
    assert mask["mask_token_id"] == raw["dflash_config"]["mask_token_id"]
    assert torch.equal(mask["embedding"], read_tensors(src)["mask_embedding"])


def test_export_bf16_and_bad_sources(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "ours", small_config())
    out = tmp_path / "bf16"
    assert main(["convert", str(src), str(out), "--dtype", "bf16"]) == 0
    assert "floating tensors cast to bfloat16" in capsys.readouterr().out
    t = read_tensors(out)
    assert all(v.dtype == torch.bfloat16 for v in t.values())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ref = read_tensors(src)
    assert torch.equal(t["fc.weight"], ref["fc.weight"].to(torch.bfloat16))
    load_drafter(out)
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "o")]) == 2
    assert f"checkpoint {tmp_path / 'missing'} does not exist" in capsys.readouterr().err
    assert main(["convert", str(src), str(tmp_path / "o"), "--dtype", "int3"]) == 2
    assert "--dtype invalid choice: 'int3'" in capsys.readouterr().err
    broken = write_checkpoint(tmp_path / "broken", small_config(), edit=lambda sd: sd.pop("norm.weight"))
    assert main(["convert", str(broken), str(tmp_path / "o2")]) == 2
    assert "missing keys ['norm.weight']" in capsys.readouterr().err


def test_inspect_and_doctor_read_speculators_checkpoints(tmp_path, tiny_llama_dir):
    from dflashkit.diagnose.doctor import run_doctor
    from dflashkit.diagnose.inspect_checkpoint import inspect_checkpoint
    from dflashkit.target.model import Target

    src, _, _ = speculators_checkpoint(tmp_path / "spec", draft_vocab=12)
    r = inspect_checkpoint(src)
    assert r.ok and r.format == "speculators" and r.facts["target_layer_ids"] == [1, 3, 5]
    assert [f.line() for f in r.findings if f.status != "OK"] == [
        f"WARN format: speculators-format checkpoint (layer ids count the embedding output) — fix: convert it: "
        f"dflashkit convert {src} OUT"
    ]
    report = run_doctor(Target.load(tiny_llama_dir), src, prompts=1, max_new_tokens=4)
    lines = [f.line() for f in report.findings]
    assert "OK target layers: [1, 3, 5] of 8, distinct" in lines
    assert not any(x.startswith("FAIL") for x in lines), lines


def test_speculators_export_puts_draft_ids_in_target_id_order(tmp_path, target):
    """speculators selects the verifier's rows with the boolean t2d (target-id order): draft ids in another order are
    reordered with the rows indexed by them (DSpark's W2), and the drafter's corrected logits only permute."""
    cfg = small_config(kind="dspark", markov_rank=4, draft_vocab_size=12)
    ids = torch.randperm(97, generator=torch.Generator().manual_seed(1))[:12]
    assert not torch.equal(ids, ids.sort().values)

    def edit(sd: dict) -> None:
        sd["draft_to_target"].copy_(ids)
        sd["markov_head.markov_w2.weight"].copy_(torch.randn(12, 4))

    src = write_checkpoint(tmp_path / "z", cfg, edit=edit)
    report = convert(src, tmp_path / "spec", to="speculators", target=target)
    assert any("reordered by target id" in n for n in report.notes)
    t = read_tensors(tmp_path / "spec")
    back = t["d2t"] + torch.arange(12)
    assert torch.equal(back, ids.sort().values) and torch.equal(t["lm_head.weight"], target.lm_head_weight[back])
    a = read_tensors(src)
    order = ids.argsort()
    assert torch.equal(t["markov_head.markov_w2.weight"], a["markov_head.markov_w2.weight"][order])
    # the same draft: every slot's bias per target id is unchanged
    prev = torch.tensor([3, 50, 96])
    old_bias = a["markov_head.markov_w2.weight"] @ a["markov_head.markov_w1.weight"][prev].T  # (12, 3)
    new_bias = t["markov_head.markov_w2.weight"] @ t["markov_head.markov_w1.weight"][prev].T
    assert torch.equal(new_bias, old_bias[order])
    same, why = ascending_draft_ids({"draft_to_target": back})
    assert why is None and torch.equal(same["draft_to_target"], back)


def test_speculators_export_names_the_verifier_and_the_window_and_says_what_speculators_runs_otherwise(
    tmp_path, target
):
    cfg = small_config(
        num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=16, is_causal=True
    )
    src = write_checkpoint(tmp_path / "z", cfg)  # small_config: a learned mask embedding
    report = convert(src, tmp_path / "spec", to="speculators", target=target)
    raw = json.loads((tmp_path / "spec/config.json").read_text())
    # speculators' loader takes the embeddings from the verifier; Qwen3Config drops the window without the switch
    assert raw["speculators_config"]["verifier"]["name_or_path"] == str(Path(target.source).resolve())
    assert raw["transformer_layer_config"]["use_sliding_window"] is True
    assert raw["transformer_layer_config"]["sliding_window"] == 16
    notes = " ".join(report.notes)
    assert "embeds the target's row" in notes and "is_causal true" in notes and "from the block's anchor" in notes
    bare = convert(src, tmp_path / "spec2", to="speculators")  # no target: the empty verifier is named
    assert any("verifier.name_or_path left empty" in n for n in bare.notes)
    # import: how speculators ran the sliding layers, where that differs from dflashkit
    back = convert(tmp_path / "spec", tmp_path / "back")
    assert any("counts the 16-token window from the block's anchor" in n for n in back.notes)
    assert load_drafter(tmp_path / "back").config == cfg
    raw["transformer_layer_config"]["use_sliding_window"] = False
    (tmp_path / "spec/config.json").write_text(json.dumps(raw))
    off = convert(tmp_path / "spec", tmp_path / "back2")
    assert any("use_sliding_window is not true" in n for n in off.notes)


def test_an_output_that_holds_something_is_refused_unless_overwrite(tmp_path, capsys):
    """A typo must not replace a model's own config.json and weights: a non-empty directory is refused with what it
    holds; --overwrite replaces config.json / model.safetensors and leaves the rest; a file is refused either way."""
    src = write_checkpoint(tmp_path / "ours", small_config())
    model_dir = tmp_path / "someones_model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama"}\n')
    (model_dir / "tokenizer.json").write_text("{}\n")
    assert main(["convert", str(src), str(model_dir)]) == 2
    err = capsys.readouterr().err
    assert f"output {model_dir} is not empty (config.json, tokenizer.json)" in err and "--overwrite" in err
    assert json.loads((model_dir / "config.json").read_text()) == {"model_type": "llama"}  # untouched
    assert main(["convert", str(src), str(model_dir), "--overwrite"]) == 0
    load_drafter(model_dir)
    assert (model_dir / "tokenizer.json").read_text() == "{}\n"  # other files stay
    (tmp_path / "empty").mkdir()
    assert main(["convert", str(src), str(tmp_path / "empty")]) == 0  # an empty directory is a new one
    (tmp_path / "a_file").write_text("x")
    assert main(["convert", str(src), str(tmp_path / "a_file"), "--overwrite"]) == 2
    assert "is a file; expected a directory" in capsys.readouterr().err


def test_dflash2_round_trips_through_speculators_and_vllm_and_refuses_what_speculators_cannot_run(tmp_path, target):
    cfg = small_config(
        kind="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=4, learned_mask_embedding=False
    )
    src = write_checkpoint(tmp_path / "z", cfg)
    convert(src, tmp_path / "spec", to="speculators", target=target)
    raw = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert raw["speculators_model_type"] == "dflash2" and raw["architectures"] == ["DFlash2DraftModel"]
    assert (raw["conv_kernel_size"], raw["conv_group_size"], raw["selector_rank"], raw["selector_top_k"]) == (
        2,
        16,
        8,
        4,
    )
    convert(tmp_path / "spec", tmp_path / "back")
    assert load_drafter(tmp_path / "back").config == cfg
    a, b = read_tensors(src), read_tensors(tmp_path / "back")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    convert(src, tmp_path / "vllm", to="vllm", target=target)
    assert load_drafter(tmp_path / "vllm").config.kind == "dflash2"
    reduced = small_config(
        kind="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=4, draft_vocab_size=20,
        learned_mask_embedding=False,
    )  # fmt: skip
    ids = torch.arange(20) * 3
    src2 = write_checkpoint(tmp_path / "r", reduced, edit=lambda sd: sd["draft_to_target"].copy_(ids))
    with pytest.raises(
        (CheckpointError, ConfigError), match="speculators runs DFlash2 over the target's whole vocabulary"
    ):
        convert(src2, tmp_path / "spec2", to="speculators", target=target)
    assert not (tmp_path / "spec2").exists()
