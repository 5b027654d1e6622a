"""Fixtures of the data tests: a tiny random Llama with the SmolLM2 tokenizer (and chat template), and the same
with a Qwen3-like thinking template."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dflashkit.target.model import Target


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A 2-layer hidden-16 Llama with the SmolLM2 vocabulary (~0.8M params). initializer_range 0.5 makes its
    greedy outputs depend on the context, so a padding bug would change them."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from dflashkit.target.default import ensure_default_target

    tok = AutoTokenizer.from_pretrained(ensure_default_target())
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        initializer_range=0.5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    return Target.load(tiny_dir)


@pytest.fixture(scope="session")
def thinking_dir(tiny_dir, tmp_path_factory):
    """The tiny target with a Qwen3-like template: an enable_thinking switch, reasoning stripped from history."""
    path = tmp_path_factory.mktemp("thinking")
    for f in tiny_dir.iterdir():
        shutil.copy(f, path / f.name)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
        "{%- if m.role == 'assistant' %}{{ m.content.split('</think>')[-1].lstrip('\\n') }}"
        "{%- else %}{{ m.content }}{%- endif %}<|im_end|>\n{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_start|>assistant\n"
        "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif -%}"
        "{%- endif -%}"
    )
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return path
