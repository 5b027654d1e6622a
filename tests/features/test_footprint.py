"""The capture footprint from shapes alone (`dflashkit.features.footprint`) against real captures: the shards' data
and headers to the byte, the directory's size, and the allocator's measured peak on CPU for several small targets."""

from __future__ import annotations

import json
import struct
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dflashkit.data.samples import Sample
from dflashkit.features import online
from dflashkit.features.capture import CaptureSettings, capture
from dflashkit.features.footprint import (
    LSE_CHUNK_VALUES,
    TOPK_CHUNK_VALUES,
    capture_disk,
    capture_memory,
    forward_transient,
    settings_token_bytes,
    shard_header_bytes,
    shard_tokens,
    token_bytes,
)
from dflashkit.features.manifest import Manifest, bytes_per_token
from dflashkit.target import logsumexp
from dflashkit.target.model import Target
from dflashkit.target.shape import read_target_shape
from helpers.choices import set_choice
from tests.helpers.peak_memory import AllocationTrace, own_parameters

TOLERANCE = 0.15  # the estimated peak within 15 % of the measured one
TRANSIENT_TOLERANCE = 0.05  # and what the batch adds above the weights within 5 % (the model counts every tensor)


def make_samples(lengths: list[int], vocab: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [
        Sample(
            id=f"sample-{j}",
            input_ids=torch.randint(3, vocab, (n,), generator=g),
            loss_mask=torch.rand(n, generator=g) > 0.3,
        )
        for j, n in enumerate(lengths)
    ]


def read_shard(path: Path) -> tuple[int, dict]:
    """(header bytes: the 8-byte length + the padded JSON, the JSON) of a safetensors file."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return 8 + n, json.loads(raw[8 : 8 + n])


# ---------------------------------------------------------------------------------------------------------- disk
LENGTHS = [7, 12, 5, 130, 9, 44, 3, 300, 17, 8, 11, 6, 25]  # 13 samples: indices 10.. sort before 2 in names


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(dtype="fp32", store_topk=5, store_target_lse=True),
        dict(dtype="fp16", store_target_tokens=False, shard_max_tokens=20),
        dict(store_topk=3, store_target_lse=True, shard_max_tokens=100),
    ],
    ids=["bf16", "fp32+topk+lse", "fp16-small-shards", "bf16+topk+lse"],
)
def test_disk_is_what_capture_writes(target, tmp_path, kw, monkeypatch):
    # stock products: the log-sum-exp's few-row products would otherwise be timed for each short length (seconds)
    set_choice(monkeypatch, "products", "stock")
    settings = CaptureSettings(layer_ids=(1, 4, 6), **kw)
    capture(target, make_samples(LENGTHS, 97), tmp_path, settings=settings, progress=False, log=None)
    per = settings_token_bytes(settings, hidden_size=64)
    est = capture_disk(LENGTHS, settings=settings, hidden_size=64, id_chars=len("sample-1"))
    manifest = Manifest.load(tmp_path)
    assert est.shards == len(manifest.shards) and est.tokens == sum(LENGTHS)
    by_kind: dict[str, int] = {}  # "features", "input_ids", …: bytes over all samples
    data = headers = 0
    for sh in manifest.shards:
        path = tmp_path / sh["file"]
        header, entries = read_shard(path)
        first, last = sh["first"], sh["first"] + sh["count"]
        assert header == shard_header_bytes(first, LENGTHS[first:last], settings, hidden_size=64)  # exact
        headers += header
        data += path.stat().st_size - header
        for name, e in entries.items():
            kind = name.split(".", 1)[-1]  # "{k}.features" → "features"
            if name != "__metadata__":
                by_kind[kind] = by_kind.get(kind, 0) + e["data_offsets"][1] - e["data_offsets"][0]
    tokens = sum(LENGTHS)
    assert data == est.tensors == tokens * per.total  # exact
    assert headers == est.headers  # exact
    want = {
        "features": per.features,
        "input_ids": per.input_ids,
        "loss_mask": per.loss_mask,
        "target_tokens": per.target_tokens,
        "topk_ids": per.topk * 4 // 6,
        "topk_logprobs": per.topk * 2 // 6,
        "target_lse": per.target_lse,
    }
    assert by_kind == {k: v * tokens for k, v in want.items() if v}
    real = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert abs(est.total - real) <= 0.01 * real
    assert abs(est.manifest - (tmp_path / "manifest.json").stat().st_size) < 1024  # the head's paths: a guess


def test_token_bytes_agree_with_the_manifest_and_plan_a_large_capture():
    per = token_bytes(hidden_size=5120, num_layers=5, dtype="bf16")
    assert per.features == 5 * 5120 * 2 == 51_200 and per.total == 51_209  # + int32 id, bool mask, int32 token
    for dtype, tokens, topk, lse in (("fp32", True, 32, True), ("fp16", False, 0, False)):
        got = token_bytes(
            hidden_size=576,
            num_layers=5,
            dtype=dtype,
            store_target_tokens=tokens,
            store_topk=topk,
            store_target_lse=lse,
        )
        assert got.total == bytes_per_token(5 * 576, dtype, tokens, topk, lse)
    settings = CaptureSettings(layer_ids=(1, 17, 33, 49, 61))
    est = capture_disk([3000] * 800_000, settings=settings, hidden_size=5120)  # 800k samples × 3k tokens
    assert est.tensors == 800_000 * 3000 * 51_209  # 122.9 TB
    assert est.shards == -(-800_000 // (shard_tokens(settings, hidden_size=5120) // 3000))
    assert 0 < est.headers + est.manifest < 1e-5 * est.tensors  # ~300 B of header per sample


def test_the_footprint_copies_capture_s_constants(target, tmp_path):
    """The chunk sizes and the default shard size are capture's own."""
    assert TOPK_CHUNK_VALUES == online._TOPK_CHUNK and LSE_CHUNK_VALUES == logsumexp._CHUNK_LOGITS
    settings = CaptureSettings(layer_ids=(1, 4), store_topk=4)
    capture(target, make_samples([5, 6], 97), tmp_path, settings=settings, progress=False, log=None)
    assert Manifest.load(tmp_path).shard_max_tokens == shard_tokens(settings, hidden_size=64)


# -------------------------------------------------------------------------------------------------------- memory
def build_target(path: Path, kind: str, *, hidden: int, vocab: int, inter: int, layers: int, heads: int, kv: int,
                 head_dim: int) -> Path:  # fmt: skip
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    torch.manual_seed(0)
    config = (Qwen3Config if kind == "qwen3" else LlamaConfig)(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


# (architecture and sizes, weights' dtype, sample length × count, capture settings, the moment of the peak): a
# different one each time — the logits and features at the forward's end, the MLP of the last layer, the
# log-sum-exp chunks, a shard of several batched forwards (the previous one's outputs still alive)
CONFIGS = {
    "qwen3-logits": (
        dict(kind="qwen3", hidden=256, vocab=8192, inter=768, layers=6, heads=4, kv=2, head_dim=64),
        "fp32", (1024, 1), dict(layer_ids=(0, 2, 3)), "forward end",
    ),
    "llama-mlp": (
        dict(kind="llama", hidden=512, vocab=2048, inter=1536, layers=4, heads=8, kv=2, head_dim=64),
        "fp32", (2048, 1), dict(layer_ids=(0, 1), store_target_tokens=False), "forward layers",
    ),
    "qwen3-bf16-lse": (
        dict(kind="qwen3", hidden=192, vocab=16000, inter=512, layers=5, heads=6, kv=2, head_dim=32),
        "bf16", (512, 1), dict(layer_ids=(0, 1, 2), dtype="fp32", store_topk=16, store_target_lse=True), "log-sum-exp",
    ),
    "qwen3-batched-shard": (
        dict(kind="qwen3", hidden=128, vocab=4096, inter=384, layers=5, heads=4, kv=1, head_dim=64),
        "fp32", (256, 8), dict(layer_ids=(0, 1, 2), store_topk=8, batch_tokens=1024), "forward end",
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def memory_targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("footprint")
    return {name: build_target(root / name, **cfg[0]) for name, cfg in CONFIGS.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_capture_memory_is_the_measured_peak(name, memory_targets, tmp_path):
    _, dtype, (length, count), kw, moment = CONFIGS[name]
    shape = read_target_shape(memory_targets[name])
    target = Target.load(memory_targets[name], dtype=dtype)
    settings = CaptureSettings(**kw, shard_max_tokens=length * count)  # one shard, held whole before it is written
    samples = make_samples([length] * count, shape.vocab_size)
    with AllocationTrace() as trace:
        own_parameters(target.model)  # the weights as a real load holds them (not memory-mapped)
        capture(target, samples, tmp_path, settings=settings, progress=False, log=None)
    est = capture_memory(shape, settings=settings, tokens=length, dtype_bytes=4 if dtype == "fp32" else 2)
    measured, weights = trace.peak(), est.parts["target weights"]
    assert abs(est.peak - measured) <= TOLERANCE * measured, "\n".join(est.lines())
    assert abs((est.peak - weights) - (measured - weights)) <= TRANSIENT_TOLERANCE * (measured - weights), (
        f"measured {measured - weights:,} B above the weights\n" + "\n".join(est.lines())
    )
    assert max(est.phases, key=est.phases.__getitem__) == moment
    assert est.peak == est.device + est.host


def test_forward_transient_is_an_online_forward(memory_targets):
    """What online features hold above the weights (`train.memory` reads it): float32 features, logits formed."""
    path = memory_targets["qwen3-logits"]
    target, shape = Target.load(path), read_target_shape(path)
    ids = make_samples([1024], shape.vocab_size)[0].input_ids[None]  # (1, T)
    with AllocationTrace() as trace:
        own_parameters(target.model)
        mark = time.time_ns()
        target.forward(ids, layer_ids=[0, 2, 3], feature_dtype=torch.float32)
    weights = trace.live_at(mark)
    measured = trace.peak(after=mark) - weights
    est = forward_transient(shape, rows=1, tokens=1024, layers=[0, 2, 3])
    assert abs(est - measured) <= TRANSIENT_TOLERANCE * measured
    assert forward_transient(shape, rows=1, tokens=1024, layers=3) >= est  # a count: ids assumed below L − 2


def test_capture_memory_of_a_large_target_has_the_right_order(tmp_path):
    """Qwen3-8B's shape, bf16 on a GPU, samples of 3k tokens: 16.4 GB of weights; the largest moment is the end of a
    forward, where its logits (T, V) and the previous forward's (alive until this one returns) dominate; a shard of
    ~1 GiB on the host."""
    config = dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, tie_word_embeddings=False, torch_dtype="bfloat16",
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = read_target_shape(tmp_path)
    settings = CaptureSettings(layer_ids=(1, 9, 17, 25, 33))
    est = capture_memory(shape, settings=settings, tokens=3000, dtype_bytes=2, total_tokens=3000 * 800_000)
    assert est.parts["target weights"] == shape.num_parameters * 2 == 16_381_470_720
    assert max(est.phases, key=est.phases.__getitem__) == "forward end"
    logits = 3000 * 151936 * 2  # (T, V) bf16: 0.91 GB
    assert 2 * logits < est.phases["forward end"] < 1.5 * 2 * logits
    assert est.parts["shard buffer"] < 2**30 and est.parts["samples"] == 9 * 3000 * 800_000
    assert est.host == est.parts["samples"] + est.parts["shard buffer"]
    bigger = capture_memory(shape, settings=replace(settings, store_target_lse=True), tokens=3000, dtype_bytes=2)
    assert bigger.device > est.device
