"""Integration: the embedded SmolLM2-135M-Instruct converts, loads, and answers a short question."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.integration


def test_smollm2_default_converts_loads_and_answers():
    from dflashkit.drafter.defaults import default_drafter_config
    from dflashkit.target.default import default_target_dir
    from dflashkit.target.model import Target

    target = Target.load("default")
    assert (default_target_dir() / "model.safetensors").is_file()
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    assert target.chat_template_info()["present"]
    tok = target.tokenizer
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    out = target.model.generate(ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
    assert text, "greedy answer is empty"
    assert "paris" in text.lower()
    # the captured final state reproduces the model's own logits
    fwd = target.forward(ids, layer_ids=[1, 8])
    # the two passes may take different product paths (stock for a one-off, the measured choice in the model's own
    # call): 576-long float32 dot products summed in another order differ by up to ~1e-4 at logits of ~20
    torch.testing.assert_close(fwd.logits, target.model(ids).logits, rtol=1e-4, atol=1e-3)
    # the default drafter: own geometry; SmolLM2 has no spare embedding row, so the mask is the row of its
    # never-used special token <empty_output> (16), or a learned mask embedding when asked for
    cfg = default_drafter_config(target)
    assert not cfg.learned_mask_embedding and cfg.mask_token_id == 16 and cfg.num_features == 5
    assert "<empty_output>" in cfg.extra["mask_reason"]
    assert default_drafter_config(target, learned_mask_embedding=True).learned_mask_embedding
    assert (cfg.num_attention_heads, cfg.head_dim) != (9, 64)


def test_info_command_runs(capsys):
    from dflashkit.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and "target embedding row 16 ('<empty_output>'" in out and "Cache" in out
    from dflashkit.cpu_products.products import CANDIDATES

    assert f"timed candidates  {', '.join(CANDIDATES)}" in out and "BLAS" in out  # what the products choose from
    assert "choices kept      in this process only" in out  # the suite keeps no store (DFLASHKIT_CHOICES=store=off)
    if "onednn" in CANDIDATES:
        assert "onednn_fused (the target's layers)" in out
    if "mkl_packed" in CANDIDATES:  # the memory its copies may take
        assert "packed copies     up to " in out and "GiB (DFLASHKIT_PACKED_MAX_GB)" in out
    if "native_rows" in CANDIDATES:  # where the kernel compiled for this CPU is, or why there is none
        assert "native kernel     built for this CPU: " in out and "rows_linear-" in out
    else:
        assert "native kernel     not available (" in out
