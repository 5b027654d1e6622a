"""The memory model of a training step (`dflashkit.train.memory`) against the allocator's measured peak of real
training steps on CPU: several small targets (Qwen3, Qwen3.5 hybrid), drafter sizes, online and offline features;
and its drafter trace, scaled from small shapes, against the trace at the step's own shape: every head kind, both
attention paths, block sizes whose last query tile varies — and a step of any size estimated in integers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads import KINDS
from dflashkit.target.model import Target
from dflashkit.target.shape import read_target_shape
from dflashkit.train.config import TrainConfig
from dflashkit.train.loop import train
from dflashkit.train.memory import MemorySettings, StepShape, scaled_drafter_step, step_memory, trace_drafter_step
from tests.helpers.peak_memory import AllocationTrace, own_parameters

TOLERANCE = 0.15  # the bound: the estimate within 15 % of the measured peak


def _qwen3(path: Path, hidden: int, vocab: int, layers: int = 10, hybrid: bool = False) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    if hybrid:
        cfg = Qwen3_5TextConfig(
            **common, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
        )  # fmt: skip
    else:
        cfg = Qwen3Config(**common)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _tokens(path: Path, vocab: int, length: int, n: int = 6) -> Path:
    g = torch.Generator().manual_seed(0)
    with path.open("w") as f:
        for i in range(n):
            ids = torch.randint(3, vocab, (length,), generator=g).tolist()
            f.write(json.dumps({"id": f"x{i}", "input_ids": ids, "loss_mask": [0] * 40 + [1] * (length - 40)}) + "\n")
    return path


def _measured_step_peak(cfg: TrainConfig, target_dir: Path, online: bool) -> int:
    """The allocator's peak during the second optimizer step (the first creates AdamW's state), counting every
    tensor allocated since the trace began: the target's weights it keeps, the drafter, its optimizer state."""
    marks: list[int] = []
    with AllocationTrace() as trace:
        if online:  # the target's weights, copied into the allocator's memory (see peak_memory)
            target = Target.load(str(target_dir))
            own_parameters(target.model)
            train(cfg, target=target, callbacks=[lambda _e: marks.append(time.time_ns())])
        else:  # as a user's run: train loads the target and keeps only its embedding table and LM head
            train(cfg, callbacks=[lambda _e: marks.append(time.time_ns())])
    assert len(marks) >= 2
    return trace.peak(after=marks[0], before=marks[1])


CASES = {
    # name: (hidden, vocab, hybrid, online, drafter layers, block size, max_anchors, row tokens)
    "qwen3-online": (256, 2048, False, True, 2, 8, 64, 1024),
    "qwen3-wide-vocab": (192, 8192, False, True, 1, 16, 32, 768),
    "qwen3-offline": (256, 2048, False, False, 3, 8, 96, 1024),
    "hybrid-online": (128, 4096, True, True, 2, 16, 48, 512),
    "qwen3-offline-wide": (384, 4096, False, False, 1, 16, 40, 768),
}


@pytest.mark.parametrize("case", list(CASES))
def test_step_memory_within_15_percent_of_the_measured_peak(case: str, tmp_path: Path) -> None:
    hidden, vocab, hybrid, online, layers, bs, anchors, tokens = CASES[case]
    target_layers = 8 if hybrid else 10
    target_dir = _qwen3(tmp_path / "target", hidden, vocab, layers=target_layers, hybrid=hybrid)
    data = _tokens(tmp_path / "tokens.jsonl", vocab, tokens - 4)
    drafter = {"num_hidden_layers": layers, "block_size": bs}
    cfg = TrainConfig(
        out=str(tmp_path / "run"), target=str(target_dir), tokens=str(data), online=True, drafter=drafter,
        max_tokens=tokens, max_anchors=anchors, max_steps=3, save_every=0, progress=False, tensorboard=False,
    )  # fmt: skip
    if not online:  # offline: the same rows, features captured first
        from dflashkit.data.samples import read_tokens
        from dflashkit.features.capture import CaptureSettings, capture

        t = Target.load(str(target_dir))
        dcfg = DrafterConfig.for_target(
            hidden_size=hidden, vocab_size=vocab, num_target_layers=target_layers, mask_token_id=5, **drafter
        )
        samples, _ = read_tokens(str(data))
        capture(
            t,
            samples,
            tmp_path / "features",
            settings=CaptureSettings(layer_ids=tuple(dcfg.target_layer_ids), dtype="fp32"),
        )
        cfg = TrainConfig(**{**cfg.__dict__, "features": str(tmp_path / "features"), "tokens": None, "online": False})
    measured = _measured_step_peak(cfg, target_dir, online)
    shape = read_target_shape(target_dir)
    dcfg = DrafterConfig.for_target(
        hidden_size=hidden, vocab_size=vocab, num_target_layers=target_layers, mask_token_id=5, **drafter
    )
    shards = 0 if online else sum(p.stat().st_size for p in (tmp_path / "features").glob("shard-*.safetensors"))
    settings = MemorySettings(online=online, open_shard_bytes=shards)
    est = step_memory(dcfg, shape, StepShape(rows=1, tokens=tokens, blocks=anchors), settings)
    assert abs(est.peak - measured) <= TOLERANCE * measured, (case, est.peak, measured, est.lines())


def test_step_memory_of_the_embedded_target_within_15_percent(tmp_path: Path) -> None:
    """SmolLM2-135M (the embedded default, 30 layers, vocab 49,152, tied): online features, a 2-layer drafter."""
    data = _tokens(tmp_path / "tokens.jsonl", 49152, 508, n=3)
    drafter = {"num_hidden_layers": 2, "block_size": 16}
    cfg = TrainConfig(
        out=str(tmp_path / "run"), target="default", tokens=str(data), online=True, drafter=drafter,
        max_tokens=512, max_anchors=24, max_steps=3, save_every=0, progress=False, tensorboard=False,
    )  # fmt: skip
    marks: list[int] = []
    with AllocationTrace() as trace:
        target = Target.load("default")
        own_parameters(target.model)
        train(cfg, target=target, callbacks=[lambda _e: marks.append(time.time_ns())])
    measured = trace.peak(after=marks[0], before=marks[1])
    shape = read_target_shape("default")
    dcfg = DrafterConfig.for_target(hidden_size=576, vocab_size=49152, num_target_layers=30, mask_token_id=5, **drafter)
    est = step_memory(dcfg, shape, StepShape(rows=1, tokens=512, blocks=24), MemorySettings(online=True))
    assert abs(est.peak - measured) <= TOLERANCE * measured, (est.peak, measured, est.lines())


# The drafter's attention paths: CPU training's query tiles (fp32, and bf16 autocast where each tile's mask is
# converted), and the dense mask the CUDA estimate traces.
PATHS = {
    "tiles fp32": MemorySettings(device="cpu"),
    "tiles bf16": MemorySettings(device="cpu", precision="bf16"),
    "dense fp32": MemorySettings(device="cuda", precision="fp32"),
    "dense bf16": MemorySettings(device="cuda"),
}
# One block; fewer than 4 query tiles; a partial last tile (n = 6, r = 80); three rows over 9 tiles (r = 96).
SHAPES = [StepShape(1, 300, 1), StepShape(2, 200, 5), StepShape(1, 700, 45), StepShape(3, 500, 70)]


def _drafter(kind: str = "dflash", block_size: int = 16) -> DrafterConfig:
    return DrafterConfig.for_target(
        hidden_size=128, vocab_size=512, num_target_layers=8, mask_token_id=5, kind=kind, num_hidden_layers=2,
        block_size=block_size,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "path"),
    [
        *((k, p) for k in KINDS for p in ("tiles bf16", "dense bf16")),
        ("dflash", "tiles fp32"),
        ("dspark", "dense fp32"),
    ],
)
def test_the_scaled_trace_equals_the_trace_at_the_shape_itself(kind: str, path: str) -> None:
    cfg = _drafter(kind)
    for shape in SHAPES:
        assert scaled_drafter_step(cfg, shape, PATHS[path]) == trace_drafter_step(cfg, shape, PATHS[path]), shape


@pytest.mark.parametrize("kind", KINDS)
def test_an_fp32_trace_on_the_meta_device_equals_fake_cpu_tensors_op_for_op(kind: str) -> None:
    """fp32 steps are traced on the meta device (quick to start) with SDPA as the CPU runs it (`_CpuAttention`):
    the same ops and the same bytes after each as fake CPU tensors give, on both attention paths."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dflashkit.drafter.model import DFlashDrafter
    from dflashkit.train import memory

    cfg = _drafter(kind)
    for tiled in (True, False):
        for shape in (StepShape(2, 200, 5), StepShape(1, 150, 45)):
            with memory._shape_drafter(cfg) as drafter:
                meta = memory._trace(memory._step_inputs(drafter, shape, bf16=False, tiled=tiled))
            with FakeTensorMode():
                drafter = DFlashDrafter(cfg).train()
                fake = memory._trace(memory._step_inputs(drafter, shape, bf16=False, tiled=tiled))
            assert len(meta.forward) > 20 and len(meta.backward) > 20
            assert meta == fake, (tiled, shape)


@pytest.mark.parametrize("block_size", [3, 12, 64, 256])
def test_the_scaled_trace_follows_the_last_tile_of_any_block_size(block_size: int) -> None:
    """Block sizes whose last tile takes many row counts (3, 12), two (64) or one (256: every tile full)."""
    cfg = _drafter(block_size=block_size)
    for path in ("tiles bf16", "dense bf16"):
        for blocks in (1, 2, 9, 43, 61) if block_size < 64 else (1, 2, 7, 9):
            shape = StepShape(1, 150, blocks)
            assert scaled_drafter_step(cfg, shape, PATHS[path]) == trace_drafter_step(cfg, shape, PATHS[path]), shape


def test_a_step_of_any_size_is_estimated_exactly_in_integers() -> None:
    """Sizes whose tensors would pass int64 (a dense (Nq, T + Nq) mask of 10^9-token rows): a finite estimate from
    the same small traces; the saved activations grow at least with the context and the queries, at most with their
    product (a tile's keys, n·T; the dense mask converted for the attention, Nq·(T + Nq))."""
    cfg = _drafter()
    shape = read_target_shape("default")
    # fp32 on CUDA is left out: its mask is not converted for the attention, so nothing there grows with Nq·(T + Nq)
    for path, settings in ((p, PATHS[p]) for p in ("tiles fp32", "tiles bf16", "dense bf16")):
        small, huge = StepShape(1, 10**6, 10**5), StepShape(1, 10**9, 10**8)
        a, b = scaled_drafter_step(cfg, small, settings), scaled_drafter_step(cfg, huge, settings)
        assert all(isinstance(v, int) and v > 0 for v in b.values())
        assert 0.9 * 1000 < b["saved"] / a["saved"] < 1.1 * 1000**2, path  # 1000 × the context and the queries
        est = step_memory(cfg, shape, huge, settings)
        assert isinstance(est.peak, int) and est.peak > 10**15
