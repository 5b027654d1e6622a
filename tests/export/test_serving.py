"""The serving layout (`convert --to vllm`): the fields and tensors vLLM loads (d2t offsets, the target's LM-head rows,
top-level draft_vocab_size, mask_embedding.pt), an exact round trip back into dflashkit (same tensors, same decode),
refusals that name what is missing, and the engine verdicts `inspect` / `doctor` print."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflashkit.cli import main
from dflashkit.decode.generate import DecodeSettings, generate
from dflashkit.diagnose.doctor import run_doctor
from dflashkit.diagnose.inspect_checkpoint import inspect_checkpoint, render_report
from dflashkit.drafter.checkpoint import drafter_state_dict, load_drafter, read_tensors
from dflashkit.errors import CheckpointError
from dflashkit.export.convert import convert
from dflashkit.export.engines import engine_verdicts, verdicts_for_dir
from dflashkit.export.serving import safe_learned_mask_id
from helpers.checkpoints import small_config, write_checkpoint

KEEP = [3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59]  # a reduced draft vocabulary (target ids)


def _reduced(path, **changes):
    def set_map(sd):
        sd["draft_to_target"] = torch.tensor(KEEP, dtype=torch.long)

    cfg = small_config(draft_vocab_size=len(KEEP), **changes)
    return write_checkpoint(path, cfg, edit=set_map)


def _verdicts(path):
    return {v.engine: v for v in verdicts_for_dir(path)}


def test_reduced_vocabulary_exports_what_vllm_loads_and_round_trips_exactly(tmp_path, target):
    src = _reduced(tmp_path / "ours")
    report = convert(src, tmp_path / "vllm", to="vllm", target=target)
    assert report.out_format == "vllm" and any("d2t offsets" in n for n in report.notes)
    raw = json.loads((tmp_path / "vllm/config.json").read_text())
    assert raw["draft_vocab_size"] == len(KEEP)  # vLLM reads only the top-level field
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == 4
    st = load_file(str(tmp_path / "vllm/model.safetensors"))
    assert "draft_to_target" not in st  # vLLM fails on it ("no module or parameter named 'draft_to_target'")
    assert st["d2t"].dtype == torch.int64 and torch.equal(st["d2t"] + torch.arange(len(KEEP)), torch.tensor(KEEP))
    assert torch.equal(st["lm_head.weight"], target.lm_head_weight.detach()[KEEP])  # the target's rows
    assert (tmp_path / "vllm/mask_embedding.pt").is_file()  # a learned mask: vLLM reads only this file
    mask = torch.load(tmp_path / "vllm/mask_embedding.pt", weights_only=True)
    assert (
        torch.equal(mask["embedding"], st["mask_embedding"])
        and mask["mask_token_id"] == raw["dflash_config"]["mask_token_id"]
    )
    # back into dflashkit: the same tensors bit for bit, the same decode
    before, after = load_drafter(src), load_drafter(tmp_path / "vllm")
    a, b = drafter_state_dict(before), drafter_state_dict(after)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    prompt = [5, 9, 2, 41, 7, 7, 3]
    got = generate(target, prompt, drafter=after, settings=DecodeSettings(method="chain", max_new_tokens=12))
    ref = generate(target, prompt, drafter=before, settings=DecodeSettings(method="chain", max_new_tokens=12))
    assert got.tokens == ref.tokens and got.acceptance_lengths == ref.acceptance_lengths
    again = convert(tmp_path / "vllm", tmp_path / "vllm2", to="vllm", target=target)  # idempotent
    assert again.source_format == "zlab"
    st2 = load_file(str(tmp_path / "vllm2/model.safetensors"))
    assert st2.keys() == st.keys() and all(torch.equal(st[k], st2[k]) for k in st)


def test_a_reduced_vocabulary_needs_the_target_and_a_stale_mask_file_is_refused(tmp_path, target):
    src = _reduced(tmp_path / "ours")
    with pytest.raises(CheckpointError, match="pass --target"):
        convert(src, tmp_path / "out", to="vllm")
    full = write_checkpoint(tmp_path / "full", small_config(learned_mask_embedding=False, mask_token_id=90))
    convert(full, tmp_path / "full_vllm", to="vllm")  # a full vocabulary needs no target: vLLM shares its head
    st = load_file(str(tmp_path / "full_vllm/model.safetensors"))
    assert "lm_head.weight" not in st and "d2t" not in st and not (tmp_path / "full_vllm/mask_embedding.pt").exists()
    convert(src, tmp_path / "vllm", to="vllm", target=target)
    torch.save({"mask_token_id": 0, "embedding": torch.zeros(64)}, tmp_path / "vllm/mask_embedding.pt")
    with pytest.raises(CheckpointError, match="does not hold this drafter's mask_embedding"):
        load_drafter(tmp_path / "vllm")
    tensors = read_tensors(tmp_path / "vllm")
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:5]
    save_file(tensors, str(tmp_path / "vllm/model.safetensors"))
    with pytest.raises(CheckpointError, match="one row per draft id"):
        load_drafter(tmp_path / "vllm")


def test_cli_convert_to_vllm(tmp_path, tiny_llama_dir, capsys):
    src = _reduced(tmp_path / "ours")
    assert main(["convert", str(src), str(tmp_path / "out"), "--to", "vllm", "--target", str(tiny_llama_dir)]) == 0
    assert "(vllm)" in capsys.readouterr().out
    assert main(["convert", str(src), str(tmp_path / "out2"), "--to", "vllm"]) == 2
    assert "pass --target" in capsys.readouterr().err


def test_a_learned_mask_gets_a_token_no_chat_produces(target):
    cfg = small_config()  # learned mask, mask_token_id 0

    class WithSpare:
        tokenizer = None

        def spare_mask_token_id(self):
            return 96

    moved, why = safe_learned_mask_id(cfg, WithSpare())
    assert moved.mask_token_id == 96 and "0 → 96" in why
    same, warn = safe_learned_mask_id(cfg, target)  # the tiny target has no tokenizer: no safe token known
    assert same.mask_token_id == 0 and "drafts differently in vLLM" in warn
    plain = small_config(learned_mask_embedding=False, mask_token_id=90)
    assert safe_learned_mask_id(plain, WithSpare()) == (plain, None)


def test_engine_verdicts_name_what_each_engine_does_with_a_directory(tmp_path, target):
    ours = _verdicts(_reduced(tmp_path / "ours"))
    assert ours["vLLM (GPU)"].verdict == "converts" and "draft_to_target" in ours["vLLM (GPU)"].why
    assert ours["z-lab"].verdict == "refuses" and ours["SGLang"].verdict == "unverified"
    assert ours["llama.cpp"].verdict == "converts"
    convert(tmp_path / "ours", tmp_path / "vllm", to="vllm", target=target)
    served = _verdicts(tmp_path / "vllm")
    assert served["vLLM (GPU)"].verdict == "loads" and served["vLLM (CPU)"].verdict == "loads"
    (tmp_path / "vllm/mask_embedding.pt").unlink()
    lost = _verdicts(tmp_path / "vllm")
    assert lost["vLLM (CPU)"].verdict == "degrades" and "mask_embedding.pt" in lost["vLLM (CPU)"].why
    mixed = small_config(
        learned_mask_embedding=False,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
    )
    v = {x.engine: x for x in engine_verdicts(mixed, files=set(), keys=set(), raw={})}
    assert v["vLLM (CPU)"].verdict == "refuses" and "sliding and full" in v["vLLM (CPU)"].why
    assert v["vLLM (GPU)"].verdict == "loads"
    gelu = {x.engine: x for x in engine_verdicts(small_config(hidden_act="gelu"), files=set(), keys=set())}
    assert gelu["vLLM (GPU)"].verdict == "refuses" and gelu["llama.cpp"].verdict == "refuses"


@pytest.mark.parametrize("kind", ["dspark", "dflash2"])
def test_each_kind_gets_its_own_engine_verdicts(kind):
    """The verdicts come from the head: a GPU-only kind is refused by vLLM's CPU build and unverified on GPU under
    its own model's name; z-lab, llama.cpp and SGLang are named for this kind, never another's."""
    extra = {"markov_rank": 8} if kind == "dspark" else {"selector_rank": 8, "selector_top_k": 4}
    cfg = small_config(kind=kind, learned_mask_embedding=False, mask_token_id=90, **extra)
    v = {x.engine: x for x in engine_verdicts(cfg, files={"config.json", "model.safetensors"}, keys=set())}
    other = {"dspark": "DFlash2", "dflash2": "DSpark"}[kind]
    assert v["vLLM (CPU)"].verdict == "refuses" and v["vLLM (GPU)"].verdict == "unverified"
    assert ("Qwen3DSparkModel" if kind == "dspark" else "qwen3_dflash2") in v["vLLM (GPU)"].why
    assert {"dspark": "(--spec-type draft-dspark)", "dflash2": "(--spec-type draft-dflash)"}[kind] in v["llama.cpp"].why
    assert v["z-lab"].verdict == ("refuses" if kind == "dspark" else "unverified")
    assert not any(other in x.why or ("Markov" in x.why and kind == "dflash2") for x in v.values())


def test_inspect_and_doctor_read_the_serving_layout(tmp_path, target):
    convert(_reduced(tmp_path / "ours"), tmp_path / "vllm", to="vllm", target=target)
    ins = inspect_checkpoint(tmp_path / "vllm")
    assert not [f for f in ins.findings if f.status == "FAIL"], render_report(ins)
    text = render_report(ins)
    assert "engines" in text and "vLLM (CPU)  loads" in text
    doc = run_doctor(target, tmp_path / "vllm", prompts=1, max_new_tokens=6)
    lines = [f.line() for f in doc.findings]
    assert any(line.startswith("OK engine head rows") for line in lines), lines
    assert any(line.startswith("OK engine vLLM (GPU)") for line in lines)
    tensors = read_tensors(tmp_path / "vllm")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 2  # rows of another head
    save_file(tensors, str(tmp_path / "vllm/model.safetensors"))
    doc = run_doctor(target, tmp_path / "vllm", prompts=1, max_new_tokens=6)
    assert any(f.status == "FAIL" and f.check == "engine head rows" for f in doc.findings)


def test_what_vllm_cannot_run_is_refused_at_export_and_mixed_layers_get_a_note(tmp_path):
    gelu = write_checkpoint(tmp_path / "gelu", small_config(hidden_act="gelu", learned_mask_embedding=False))
    with pytest.raises(CheckpointError, match="vLLM cannot run this drafter: hidden_act 'gelu'"):
        convert(gelu, tmp_path / "out", to="vllm")
    mixed_cfg = small_config(
        learned_mask_embedding=False,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
    )
    report = convert(write_checkpoint(tmp_path / "mixed", mixed_cfg), tmp_path / "mixed_out", to="vllm")
    assert any("CPU runner" in n for n in report.notes)


def test_dspark_serving_layout_round_trips_and_names_vllms_limits(tmp_path, target):
    """A DSpark drafter in the serving layout: vLLM's Qwen3DSparkModel fields and head names, d2t + lm_head rows
    for its reduced vocabulary, an exact round trip; vLLM's CPU build refuses it and a learned mask degrades it."""
    src = _reduced(tmp_path / "ours", kind="dspark", markov_rank=8)
    report = convert(src, tmp_path / "vllm", to="vllm", target=target)
    assert any("GPU model runner only" in n and "ignores a learned mask" in n for n in report.notes)
    raw = json.loads((tmp_path / "vllm/config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["markov_rank"] == 8 and raw["draft_vocab_size"] == 16
    st = load_file(str(tmp_path / "vllm/model.safetensors"))
    assert st["markov_head.markov_w2.weight"].shape == (len(KEEP), 8)  # W2 over the draft vocabulary
    assert st["markov_head.markov_w1.weight"].shape == (97, 8)  # W1 over the target's
    before, after = load_drafter(src), load_drafter(tmp_path / "vllm")
    a, b = drafter_state_dict(before), drafter_state_dict(after)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    v = _verdicts(tmp_path / "vllm")
    assert v["vLLM (CPU)"].verdict == "refuses" and v["vLLM (GPU)"].verdict == "degrades"
    plain_mask = _reduced(
        tmp_path / "row", kind="dspark", markov_rank=8, learned_mask_embedding=False, mask_token_id=90
    )
    convert(plain_mask, tmp_path / "vllm_row", to="vllm", target=target)
    assert _verdicts(tmp_path / "vllm_row")["vLLM (GPU)"].verdict == "unverified"
