"""Shared fixtures: tiny random HF targets (Llama, Qwen3, Qwen3.5 hybrid, Qwen3.5 VL wrapper) saved to disk.

Each is a real transformers model with a small vocabulary, built once per test session and loaded through the
same `Target.load(path)` that users call.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

TINY_VOCAB = 97
# the config fields every tiny target shares (tests that build other architectures in memory reuse them)
TINY_CONFIG = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# Tiny models are dominated by per-op overhead: one thread is several times faster than two, and immune to
# contention from other processes on this 2-core machine.
torch.set_num_threads(1)


# Every choice made by measurement (cpu_products/choice.py) is pinned or kept in memory for the suite, in this process
# and in the ones it starts (CLI children, torchrun ranks), through one variable, DFLASHKIT_CHOICES:
# - store=off: choices measured by the suite (tiny shapes, timings on a busy machine) stay in memory; the user's store
#   (~/.cache/dflashkit/products, …) keeps only what real runs measured.
# - optimizer=fused: AdamW's implementation is measured at the start of a run (optimizer_impl: auto); runs a test
#   compares bit for bit must not choose differently on a busy machine.
# - train_precision=fp32, capture_precision=fp32: a CPU run's precision (dtype: auto) and a capture's are timed at
#   their start; the suite trains and captures in fp32, the reference.
# - train_compile, capture_compile, regenerate_compile, decode_compile=off: a test run with a long schedule would
#   otherwise compile for minutes; the suite runs eager.
# The tests of each choice measure with its entry removed (tests/helpers/choices.py: set_choice).
os.environ["DFLASHKIT_CHOICES"] = ",".join(
    [
        "store=off",
        "optimizer=fused",
        "train_precision=fp32",
        "capture_precision=fp32",
        "train_compile=off",
        "capture_compile=off",
        "regenerate_compile=off",
        "decode_compile=off",
    ]
)

# MKL's packed copies (target/packed_weights.py) default to a quarter of the machine's memory; the suite's processes
# load SmolLM2 in many modules and would hold GBs of them. 1 GB still lets a decoding width of SmolLM2 pack.
os.environ["DFLASHKIT_PACKED_MAX_GB"] = "1"


def _tiny_config(kind: str):
    from transformers import LlamaConfig, Qwen3Config
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig

    common = dict(TINY_CONFIG)
    if kind == "llama":
        return LlamaConfig(**common, head_dim=16)
    if kind == "qwen3":
        return Qwen3Config(**common, head_dim=16)
    text = dict(
        common,
        head_dim=16,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    )
    if kind == "qwen3_5":
        return Qwen3_5TextConfig(**text)
    if kind == "qwen3_5_vl":
        return Qwen3_5Config(
            text_config=text,
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64),
        )
    raise ValueError(kind)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Whole-pipeline tests (`integration`: the longest, minutes each) run first. With one worker per core
    (scripts/test.sh), a long test started last holds one worker while the others have nothing left; started first,
    the rest of the queue fills in beside it. The order is otherwise the collection's (a stable sort)."""
    items.sort(key=lambda item: item.get_closest_marker("integration") is None)


def build_tiny_target(kind: str, path: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = _tiny_config(kind)
    model = Qwen3_5ForConditionalGeneration(cfg) if kind == "qwen3_5_vl" else AutoModelForCausalLM.from_config(cfg)
    # Random init of transformers is tiny (std 0.02): scale up so logits have real margins and greedy paths vary.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25 if "embed" in name or "lm_head" in name else 0.08)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_target_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("targets")
    return {k: build_tiny_target(k, root / k) for k in ("llama", "qwen3", "qwen3_5", "qwen3_5_vl")}


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_target_dirs) -> Path:
    return tiny_target_dirs["llama"]


@pytest.fixture(scope="session")
def tiny_hybrid_dir(tiny_target_dirs) -> Path:
    return tiny_target_dirs["qwen3_5"]


@pytest.fixture(scope="module")
def target(tiny_llama_dir: Path):
    """The tiny random Llama target (hidden 64, vocab 97, 8 layers), loaded once per test module."""
    from dflashkit.target.model import Target

    return Target.load(tiny_llama_dir)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tests, restored afterwards (a test elsewhere may have changed it):
    tiny matmuls only add OpenMP contention on a shared 2-core machine (25 s → 0.7 s per training run)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def wide_head_target(tmp_path_factory) -> Path:
    """A tiny Llama whose attention (2 heads × 32) differs from dflashkit's default for hidden 64 (4 × 16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
    )
    path = tmp_path_factory.mktemp("wide") / "llama_wide"
    model.save_pretrained(path)
    return path
