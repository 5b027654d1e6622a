"""A target GGUF built by hand for export tests: the conftest tiny Llama's tables and a toy vocabulary, as the GGUF
exporter reads a target (`dflashkit.export.gguf_export.read_target_gguf`)."""

from __future__ import annotations

from pathlib import Path

import gguf
from safetensors.torch import load_file

QT = gguf.GGMLQuantizationType


def write_target_gguf(
    path: Path, target_dir: Path, *, embd_type: QT = QT.Q8_0, tied: bool = False, n_layers: int = 8
) -> Path:
    """A llama-arch target GGUF holding the conftest tiny Llama's tables (what the exporter reads from a target)."""
    sd = load_file(str(target_dir / "model.safetensors"))
    embd = sd["model.embed_tokens.weight"].float().numpy()
    vocab, hidden = embd.shape
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_uint32("llama.embedding_length", hidden)
    w.add_uint32("llama.block_count", n_layers)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(vocab)])
    w.add_array("tokenizer.ggml.token_type", [1] * vocab)
    w.add_array("tokenizer.ggml.merges", ["t 1"])
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(embd, embd_type), raw_dtype=embd_type)
    if not tied:
        w.add_tensor("output.weight", sd["lm_head.weight"].float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
