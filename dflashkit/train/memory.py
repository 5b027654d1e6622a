"""The memory of a training step, from shapes alone: the one model that `plan`, `doctor` and `train` read.

    est = step_memory(drafter_cfg, target_shape, StepShape(rows=1, tokens=3072, blocks=512), MemorySettings())
    est.peak, est.parts          # bytes; each part named, with how it was obtained

Per device (a rank), the peak of one optimizer step is

    resident   the target's weights (all of them when it runs in the step: online features, an objective that
               reads its distribution, a head that needs it; else its embedding table and LM head), the drafter's
               fp32 parameters, AdamW's two fp32 moments — FSDP shards the drafter's three over the ranks
    + the larger of
      online    the target's forward over the step's rows (`features.footprint.forward_transient`), before the
                drafter runs
      setup     offline: the whole target, loaded while setup takes its two tables (then freed)
      optimizer AdamW's step: the gradients and a foreach implementation's temporaries
    FSDP adds the parameters and gradients it gathers (the root's and one decoder layer's) to the drafter's phase.
      drafter   the context features (B, T, K·H) and dense masks, then the largest of: the drafter's forward, the
                loss over its saved activations, its backward (with the parameters' gradients) — the forward and
                backward traced by running the real drafter on fake tensors, so every head and attention path is
                counted as it runs; the loss from its chunked pass (`losses._chunked_pass`: a chunk's logits and
                the arrays live beside them)

Only the activations depend on the data: `blocks` (anchors per row) sets the queries, Nq = blocks · block_size.
Checked against the allocator's own peak on CPU (tests/train/test_memory.py: within 15 %).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from dflashkit.drafter.capture_needs import capture_layer_ids
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads import head_of
from dflashkit.drafter.tiled_attention import widest_tiles
from dflashkit.features.footprint import MemoryParts
from dflashkit.train.losses import CHUNK_LOGITS, DISTRIBUTION_KINDS

# Arrays of one chunk's width (rows_c, V) live at once at the peak of the chunked loss pass (`_chunked_pass`):
# CE/top-k — the logits z, log p and g = exp(log p) (and g's bf16 copy for the product under bf16); the
# distribution objectives add the target's chunk, its log-probabilities, both probabilities and the divergence's
# gradient.
_LOSS_ARRAYS = {"ce": 3, "topk": 3, "distribution": 7}


@dataclass(frozen=True)
class StepShape:
    """One micro-batch: `rows` packed rows of `tokens` tokens each, `blocks` blocks (anchors) per row."""

    rows: int = 1
    tokens: int = 3072
    blocks: int = 512


@dataclass(frozen=True)
class MemorySettings:
    """How the step runs: device kind ("cpu": dense masks, fp32; "cuda": flex block masks, bf16 autocast unless
    fp32), parallel layout ("single", "ddp", "fsdp") over `world` ranks, the objective (`loss`), online features."""

    device: str = "cpu"
    precision: str = "auto"  # "auto": fp32 on CPU, bf16 autocast on CUDA
    layout: str = "single"
    world: int = 1
    loss: str = "ce"
    online: bool = False
    target_dtype_bytes: int = 4  # the target's weights as loaded (bf16 on GPUs: 2)
    target_elsewhere: bool = False  # the target on another device (`target_device`): only its two tables here
    loss_chunk_rows: int | None = None  # blocks per chunk of the loss (default: `losses.CHUNK_LOGITS` logits)
    open_shard_bytes: int = 0  # offline: the capture shards the reader keeps open (memory-mapped in host memory)

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16" or (self.precision == "auto" and self.device == "cuda")


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive now, and the most at once, for the ops run under it (real or fake
    tensors): a storage counts from the op that made it until it is freed (a weak reference's callback)."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.now = 0
        self.peak = 0

    def known(self, *tensors: torch.Tensor) -> None:
        """Storages that existed before (inputs, parameters): their views made under the mode add nothing."""
        for t in tensors:
            self._seen[t.untyped_storage()] = None

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage in self._seen:
            return
        n = int(storage.nbytes())
        self.now += n
        self.peak = max(self.peak, self.now)

        def freed(_ref: Any, n: int = n) -> None:
            self.now -= n

        self._seen[storage] = weakref.ref(storage, freed)

    def reset_peak(self) -> None:
        self.peak = self.now

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out


def drafter_parameters(cfg: DrafterConfig) -> int:
    """The drafter's trainable parameters (its head's included), counted on the meta device."""
    from dflashkit.drafter.model import DFlashDrafter

    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _largest_gathered(cfg: DrafterConfig) -> int:
    """Parameters FSDP holds unsharded at once beside the shards: the root's (fc, norms) plus one decoder layer's."""
    from dflashkit.drafter.model import DFlashDrafter

    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    layer = max((sum(p.numel() for p in block.parameters()) for block in model.layers), default=0)
    return sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.layers.parameters()) + layer


@dataclass
class FakeStep:
    """The drafter and one micro-batch's inputs as fake tensors (shapes only, no memory): `fake_step` makes it."""

    drafter: Any
    embed: torch.Tensor  # (V, H) the target's table, frozen
    features: torch.Tensor  # (B, T, K·H)
    first: torch.Tensor  # (B, Nb) the blocks' given tokens
    context_positions: torch.Tensor  # (B, T)
    block_positions: torch.Tensor  # (B, Nq)
    masks: dict[str, Any]  # per layer type: (B, 1, Nq, T + Nq) dense, or its widest query tiles (CPU)
    bf16: bool

    @property
    def inputs(self) -> list[torch.Tensor]:
        """Every tensor that exists before the step runs: its inputs, the drafter's parameters and buffers."""
        made = [self.embed, self.features, self.first, self.context_positions, self.block_positions]
        masks = [t for m in self.masks.values() for t in ([m] if isinstance(m, torch.Tensor) else m.additive)]
        return [*made, *masks, *self.drafter.parameters(), *self.drafter.buffers()]

    def forward(self) -> torch.Tensor:
        """The drafter's forward as a training step runs it → (B, Nq, H)."""
        bs = self.drafter.config.block_size
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            embeds = self.drafter.block_embeddings(self.first, self.embed, bs)  # (B, Nq, H)
            return self.drafter(
                self.features, embeds, context_positions=self.context_positions,
                block_positions=self.block_positions, attention_mask=self.masks, block_len=bs,
            )  # fmt: skip


@contextlib.contextmanager
def fake_step(cfg: DrafterConfig, shape: StepShape, *, bf16: bool = False, tiled: bool = False) -> Iterator[FakeStep]:
    """The drafter of `cfg` and a micro-batch of `shape`, built under a FakeTensorMode that stays on while used.
    `tiled`: the masks as CPU training cuts them (`tiled_attention`), at their widest; else dense."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dflashkit.drafter.model import DFlashDrafter

    b, t, nq = shape.rows, shape.tokens, shape.blocks * cfg.block_size
    dtype = torch.bfloat16 if bf16 else torch.float32
    with FakeTensorMode():
        yield FakeStep(
            drafter=DFlashDrafter(cfg).train(),
            embed=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype),
            features=torch.empty(b, t, cfg.num_features * cfg.hidden_size),
            first=torch.zeros(b, shape.blocks, dtype=torch.long),
            context_positions=torch.arange(t).expand(b, t),
            block_positions=torch.arange(nq).expand(b, nq),
            masks={
                kind: widest_tiles(b, nq, t, dtype) if tiled else torch.zeros(b, 1, nq, t + nq, dtype=dtype)
                for kind in set(cfg.layer_types)
            },
            bf16=bf16,
        )


def trace_drafter_step(cfg: DrafterConfig, shape: StepShape, settings: MemorySettings) -> dict[str, int]:
    """The drafter's forward and backward over one micro-batch, run on fake tensors (no memory, any size):
    {"forward_peak", "saved" (live after the forward: the activations kept for backward), "backward_peak"} in
    bytes above the inputs (features, masks, parameters), the gradient arriving from the loss included."""
    with fake_step(cfg, shape, bf16=settings.bf16, tiled=settings.device == "cpu") as step:
        live = LiveBytes()
        live.known(*step.inputs)
        with live:
            hidden = step.forward()  # (B, Nq, H)
            forward_peak, saved = live.peak, live.now
            grad = torch.empty_like(hidden)  # (B, Nq, H) d loss / d hidden, from the loss's chunks
            live.reset_peak()
            hidden.backward(grad)
            backward_peak = live.peak
        del step, hidden, grad
    return {"forward_peak": forward_peak, "saved": saved, "backward_peak": backward_peak}


def loss_working_set(cfg: DrafterConfig, shape: StepShape, settings: MemorySettings) -> int:
    """Bytes the loss holds at its peak beside the saved activations: the live rows' states (M, H) and their
    gradient (M, H) float32, and one chunk of (rows_c, V) arrays (`_LOSS_ARRAYS`)."""
    bs = cfg.block_size
    vocab = cfg.draft_vocab_size or cfg.vocab_size
    live_per_block = bs - head_of(cfg).first_draft_slot  # slot 0 carries no loss where the head does not draft it
    m = shape.rows * shape.blocks * live_per_block
    chunk_blocks = settings.loss_chunk_rows or max(1, CHUNK_LOGITS // max(1, bs * vocab))
    rows_c = min(m, chunk_blocks * bs)
    kind = settings.loss if settings.loss in ("ce", "topk") else "distribution"
    arrays = _LOSS_ARRAYS[kind] * 4 + (2 if settings.bf16 else 0)  # bytes per (row, vocabulary entry)
    return 2 * m * cfg.hidden_size * 4 + arrays * rows_c * vocab


def step_memory(
    cfg: DrafterConfig, target: Any, shape: StepShape, settings: MemorySettings | None = None
) -> MemoryParts:
    """The peak bytes per rank of one training step of drafter `cfg` on `target` (a `TargetShape`)."""
    from dflashkit.features.footprint import forward_transient

    s = settings or MemorySettings()
    est = MemoryParts()
    p = drafter_parameters(cfg)
    shard = s.world if s.layout == "fsdp" else 1
    head = head_of(cfg)
    resident = (s.online or s.loss in DISTRIBUTION_KINDS or head.training_needs_target) and not s.target_elsewhere
    tw = target.num_parameters if resident else target.embedding_parameters * (1 if target.tie_word_embeddings else 2)
    est.parts["target weights"] = tw * s.target_dtype_bytes
    est.notes["target weights"] = (
        "all of it (it runs in the step)" if resident else "embedding table and LM head (the drafter reads them)"
    )
    est.parts["drafter weights"] = math.ceil(p / shard) * 4
    est.parts["optimizer state"] = 2 * math.ceil(p / shard) * 4
    est.notes["drafter weights"] = f"{p:,} fp32 parameters" + (f", sharded over {shard} ranks" if shard > 1 else "")
    est.notes["optimizer state"] = "AdamW's two fp32 moments"
    if not s.online and s.open_shard_bytes and s.device == "cpu":
        est.parts["open feature shards"] = s.open_shard_bytes
        est.notes["open feature shards"] = "capture shards the reader keeps open, memory-mapped (up to 4)"
    if s.layout == "ddp" and s.world > 1:
        est.parts["DDP gradient buckets"] = p * 4
        est.notes["DDP gradient buckets"] = "DDP's reducer keeps a copy of every gradient for the all-reduce"
    traced = trace_drafter_step(cfg, shape, s)
    b, t, nq = shape.rows, shape.tokens, shape.blocks * cfg.block_size
    inputs = b * t * cfg.num_features * cfg.hidden_size * 4  # (B, T, K·H) float32 features
    if s.device == "cpu":  # per layer type the additive masks of the query tiles, at their widest (CUDA: flex)
        with torch.device("meta"):
            tiled = widest_tiles(b, nq, t, torch.bfloat16 if s.bf16 else torch.float32)
        inputs += len(set(cfg.layer_types)) * sum(m.nbytes for m in tiled.additive)
    grads = math.ceil(p / shard) * 4
    if shard > 1:  # FSDP gathers one decoder layer at a time (and the root: fc, norms), with its gradients
        grads += 2 * 4 * _largest_gathered(cfg)
    loss = loss_working_set(cfg, shape, s)
    if s.loss in DISTRIBUTION_KINDS:  # the target's logits over every row position (`kl_target_logits`)
        inputs += b * t * cfg.vocab_size * 4
    # AdamW's step: every gradient, and a foreach implementation's temporaries (one per parameter, at most)
    est.phases["optimizer step"] = 2 * math.ceil(p / shard) * 4
    est.notes["optimizer step"] = "the gradients and the optimizer's temporaries (foreach: one per parameter)"
    est.phases["drafter step"] = inputs + max(
        traced["forward_peak"], traced["saved"] + loss, traced["backward_peak"] + grads
    )
    est.notes["drafter step"] = (
        f"features + masks, then forward {traced['forward_peak'] / 2**30:.3f} / loss over saved "
        f"{(traced['saved'] + loss) / 2**30:.3f} / backward + gradients "
        f"{(traced['backward_peak'] + grads) / 2**30:.3f} GiB (traced on fake tensors)"
    )
    if s.online and not s.target_elsewhere:
        est.phases["online features"] = forward_transient(
            target, rows=b, tokens=t, layers=capture_layer_ids(cfg), dtype_bytes=s.target_dtype_bytes
        )
        est.notes["online features"] = "the target's forward over the rows (before the drafter runs)"
    elif not resident and not s.target_elsewhere:  # setup loads the whole target, keeps its two tables, frees it
        est.phases["setup"] = target.num_parameters * s.target_dtype_bytes - est.parts["target weights"]
        est.notes["setup"] = "the whole target while setup takes its embedding table and LM head (then freed)"
    return est


__all__ = [
    "FakeStep",
    "LiveBytes",
    "MemorySettings",
    "StepShape",
    "drafter_parameters",
    "fake_step",
    "loss_working_set",
    "step_memory",
    "trace_drafter_step",
]
