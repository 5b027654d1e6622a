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
                backward from the real drafter run on shape-only tensors (`scaled_drafter_step`), so every head and
                attention path is counted as it runs; the loss from its chunked pass (`losses._chunked_pass`: a
                chunk's logits and the arrays live beside them)

Only the activations depend on the data: `blocks` (anchors per row) sets the queries, Nq = blocks · block_size.

The drafter's forward and backward are traced at a few small shapes and scaled, so the estimate costs the same at
any size (a trace at the step's own shape costs time and memory growing with its query tiles, and a size past 2^63
bytes overflows). A trace records the bytes alive after every allocating op (a moment). At the step's rows every
tensor's size is a polynomial in the context T and the queries Nq, and so is every moment, with the same ops at
every shape (sizes of 1 aside: the traces avoid them where the step has none) — on the dense path in 1, T, Nq,
Nq·T, Nq². The CPU path loops over query tiles of 128 rows (`tiled_attention`): in a layer's loop every full tile
leaves the same bytes behind, so a moment grows linearly with the tile's index and the middle tiles never hold the
peak; the trace keeps the first two and the last two tiles of each loop, whose moments are polynomials in the tile
count n and the last tile's rows r (1, T, n, n·T, r, r·T, r²) — or, where the block size divides the tile, traced at
shapes whose last tile has the step's own r, in (1, T, n, n·T) alone. The drafter is traced at as many small shapes as
there are terms, and the moments at the step's shape are their exact interpolation (`interpolate`, in integers);
the largest is the peak. A step of one block, or of fewer than 4 tiles, is traced at its own blocks and interpolated
in T alone. tests/train/test_memory.py checks the scaled step equals the full trace for every head kind and both
attention paths.
Shape-only tensors: fp32 steps run on the meta device (SDPA as the CPU runs it, `_CpuAttention`), bf16 steps on
fake CPU tensors, which autocast casts (slower to start); the test checks both give the same ops and bytes.

Checked against the allocator's own peak on CPU (tests/train/test_memory.py: within 15 %). `traced=False` leaves
the drafter's passes out: a lower bound in closed form, which train's pre-flight check tries first (memory_check).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from dflashkit.drafter.capture_needs import capture_layer_ids
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads import head_of
from dflashkit.drafter.tiled_attention import DEFAULT_TILE, widest_tiles, widest_tiles_bytes
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
    tensors): a storage counts from the op that made it until it is freed (a weak reference's callback).
    `record`: also keep each moment — (op, bytes alive) after every op that allocated — in `moments`."""

    def __init__(self, *, record: bool = False) -> None:
        super().__init__()
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.now = 0
        self.peak = 0
        self.record = record
        self.moments: list[tuple[str, int]] = []

    def known(self, *tensors: torch.Tensor) -> None:
        """Storages that existed before (inputs, parameters): their views made under the mode add nothing."""
        for t in tensors:
            self._seen[t.untyped_storage()] = None

    def add(self, t: torch.Tensor) -> bool:
        """Count `t`'s storage if it is new; whether it was."""
        storage = t.untyped_storage()
        if storage in self._seen:
            return False
        n = int(storage.nbytes())
        self.now += n
        self.peak = max(self.peak, self.now)

        def freed(_ref: Any, n: int = n) -> None:
            self.now -= n

        self._seen[storage] = weakref.ref(storage, freed)
        return True

    def reset_peak(self) -> None:
        self.peak = self.now

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        made = [self.add(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if self.record and any(made):  # nothing is freed while an op's outputs are counted: its last is its most
            self.moments.append((str(func), self.now))
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
    """The drafter and one micro-batch's inputs as shape-only tensors (no memory): `fake_step` makes it."""

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


def _step_inputs(drafter: Any, shape: StepShape, *, bf16: bool, tiled: bool) -> FakeStep:
    """A micro-batch of `shape` for `drafter`, made in the shape-only context that made the drafter."""
    cfg = drafter.config
    b, t, nq = shape.rows, shape.tokens, shape.blocks * cfg.block_size
    dtype = torch.bfloat16 if bf16 else torch.float32
    return FakeStep(
        drafter=drafter,
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


class _CpuAttention(TorchFunctionMode):
    """On meta tensors, `scaled_dot_product_attention` as CPU tensors run it: PyTorch picks the attention kernel by
    device, and on the meta device it would pick the unfused math path (other ops, other memory) where the CPU picks
    its flash kernel. tests/train/test_memory.py checks meta traces equal fake CPU tensors' op for op."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args[0].is_meta and not kwargs.get("dropout_p"):
            q, k, v = args[:3]
            mask, scale, causal = kwargs.get("attn_mask"), kwargs.get("scale"), kwargs.get("is_causal", False)
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, causal, attn_mask=mask, scale=scale
            )[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def _shape_only(bf16: bool) -> Iterator[None]:
    """Tensors made inside carry shapes and no memory. fp32: the meta device (with `_CpuAttention`); bf16: fake CPU
    tensors (`FakeTensorMode`), since autocast casts CPU tensors only — slower to start (it imports TorchDynamo)."""
    if bf16:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            yield
    else:
        with torch.device("meta"), _CpuAttention():
            yield


@contextlib.contextmanager
def _shape_drafter(cfg: DrafterConfig, *, bf16: bool = False) -> Iterator[Any]:
    """The drafter of `cfg` in training mode, built shape-only (`_shape_only`) in a context that stays on while used."""
    from dflashkit.drafter.model import DFlashDrafter

    with _shape_only(bf16):
        yield DFlashDrafter(cfg).train()


@contextlib.contextmanager
def fake_step(cfg: DrafterConfig, shape: StepShape, *, bf16: bool = False, tiled: bool = False) -> Iterator[FakeStep]:
    """The drafter of `cfg` and a micro-batch of `shape`, built shape-only in a context that stays on while used.
    `tiled`: the masks as CPU training cuts them (`tiled_attention`), at their widest; else dense."""
    with _shape_drafter(cfg, bf16=bf16) as drafter:
        yield _step_inputs(drafter, shape, bf16=bf16, tiled=tiled)


@dataclass
class _Moments:
    """One traced step, in bytes above its inputs: the moments of the forward, what it leaves alive (`saved`: the
    activations kept for backward), the gradient from the loss allocated (`start`), the moments of the backward."""

    forward: list[tuple[str, int]]
    saved: int
    start: int
    backward: list[tuple[str, int]]

    def peaks(self) -> dict[str, int]:
        return {
            "forward_peak": max([0, *(v for _, v in self.forward)]),
            "saved": self.saved,
            "backward_peak": max([self.start, *(v for _, v in self.backward)]),
        }


def _trace(step: FakeStep) -> _Moments:
    """Run the step's forward and backward under `LiveBytes`, recording every moment; the drafter's gradients are
    dropped after, so the drafter can trace another shape."""
    live = LiveBytes(record=True)
    live.known(*step.inputs)
    with live:
        hidden = step.forward()  # (B, Nq, H)
        forward, saved, live.moments = live.moments, live.now, []
        grad = torch.empty_like(hidden)  # (B, Nq, H) d loss / d hidden, from the loss's chunks
        start = live.now
        hidden.backward(grad)
    for p in step.drafter.parameters():
        p.grad = None
    return _Moments(forward, saved, start, live.moments)


def trace_drafter_step(cfg: DrafterConfig, shape: StepShape, settings: MemorySettings) -> dict[str, int]:
    """The drafter's forward and backward over one micro-batch of `shape` itself, run on shape-only tensors:
    {"forward_peak", "saved" (live after the forward: the activations kept for backward), "backward_peak"} in
    bytes above the inputs (features, masks, parameters), the gradient arriving from the loss included. Its cost
    grows with the query tiles of the CPU path: `scaled_drafter_step` gives the same at a constant cost."""
    with fake_step(cfg, shape, bf16=settings.bf16, tiled=settings.device == "cpu") as step:
        return _trace(step).peaks()


# The context lengths of the small shapes the scaled trace runs (a trace's cost does not depend on them).
_TRACE_TOKENS = (64, 128)


def _tiles(cfg: DrafterConfig, shape: StepShape) -> tuple[int, int]:
    """The CPU path's query tiles of `shape`: how many (n), and the rows of the last (r, 1 … DEFAULT_TILE)."""
    nq = shape.blocks * cfg.block_size
    n = -(-nq // DEFAULT_TILE)
    return n, nq - DEFAULT_TILE * (n - 1)


def _remainders(cfg: DrafterConfig) -> int:
    """How many last-tile row counts r the block size allows (3 or more counted as 3): with fewer, r's terms of
    higher degree are the lower ones over the values it takes, and the traces could not tell them apart."""
    bs = cfg.block_size
    return min(3, len({(b * bs - 1) % DEFAULT_TILE for b in range(1, DEFAULT_TILE + 1)}))


def _compress(moments: list[tuple[str, int]], tiles: int) -> list[tuple[str, int]]:
    """The moments of a pass whose attention runs `tiles` query tiles per layer (one attention op each), less
    those of the third to the (tiles − 2)th: every full tile before the last leaves the same bytes behind, so a
    moment of tile k is a linear function of k between the second tile and the one before the last, and never
    above both. What is kept has the same ops for any `tiles` ≥ 4."""
    attention = [i for i, (op, _) in enumerate(moments) if "scaled_dot_product" in op]
    if tiles < 4:
        return moments
    if len(attention) % tiles:
        raise RuntimeError(f"the drafter's trace ran {len(attention)} attention ops, not a multiple of {tiles} tiles")
    drop: set[int] = set()
    for first in range(0, len(attention), tiles):
        ops = attention[first : first + tiles]
        drop.update(range(ops[1] + 1, ops[tiles - 3] + 1))  # (after the 2nd tile's op, the (tiles−2)th's op]
    return [m for i, m in enumerate(moments) if i not in drop]


@dataclass
class _Fit:
    """The moments of a drafter step traced at a few shapes, interpolated to any other. `terms(shape)` → the
    monomials every moment is a combination of (the first: the constant); `traced` the shapes, one per monomial,
    whose monomials form an invertible matrix; `values` each traced shape's moments, in the same op order."""

    terms: Any
    traced: list[StepShape]
    values: list[list[int]]  # per traced shape: [saved, start, forward moments …, backward moments …]
    forward: int  # how many forward moments

    def at(self, shape: StepShape) -> dict[str, int]:
        """{"forward_peak", "saved", "backward_peak"} at `shape`, every moment interpolated exactly."""
        moments = interpolate(self.terms, self.traced, self.values, shape)
        forward, backward = moments[2 : 2 + self.forward], moments[2 + self.forward :]
        return {
            "forward_peak": max([0, *forward]),
            "saved": moments[0],
            "backward_peak": max([moments[1], *backward]),
        }


def interpolate(terms: Any, traced: list[StepShape], values: list[list[int]], shape: StepShape) -> list[int]:
    """Quantities measured at the `traced` shapes (values[i][j]: quantity j at shape i), each a combination of the
    monomials `terms(s)` (a tuple of ints, as many as shapes traced, independent over them), at `shape`: each is
    Σ_i w_i · values[i][j] with the weights that turn the traced shapes' monomials into those of `shape` (Aᵀ w = φ),
    in exact integer arithmetic, so any size is exact and none overflows."""
    a = [terms(s) for s in traced]
    w = _solve([list(col) for col in zip(*a, strict=True)], list(terms(shape)))
    den = math.lcm(*(x.denominator for x in w))
    num = [int(x * den) for x in w]
    return [sum(n * v for n, v in zip(num, col, strict=True)) // den for col in zip(*values, strict=True)]


def _solve(m: list[list[int]], rhs: list[int]) -> list[Fraction]:
    """x with m · x = rhs, exactly (Gaussian elimination over fractions; m square and invertible)."""
    n = len(m)
    rows = [[Fraction(v) for v in row] + [Fraction(r)] for row, r in zip(m, rhs, strict=True)]
    for c in range(n):
        pivot = next(r for r in range(c, n) if rows[r][c] != 0)
        rows[c], rows[pivot] = rows[pivot], rows[c]
        for r in range(n):
            if r != c and rows[r][c] != 0:
                f = rows[r][c] / rows[c][c]
                rows[r] = [x - f * y for x, y in zip(rows[r], rows[c], strict=True)]
    return [rows[c][n] / rows[c][c] for c in range(n)]


# Fits already traced, by drafter config, precision, path and the shape's fixed sizes: `plan` asks for many shapes
# and layouts of one drafter.
_FITS: dict[tuple[Any, ...], _Fit] = {}


def _terms(cfg: DrafterConfig, path: str) -> Any:
    """The monomials of a shape that every moment of `path` is a combination of, at a given number of rows: those
    of the context T and the queries (dense: Nq; tiles: their count n and the last one's rows r; fixed: none)."""
    bs, degree = cfg.block_size, _remainders(cfg)

    def terms(s: StepShape) -> tuple[int, ...]:
        t, nq = s.tokens, s.blocks * bs
        if path == "dense":
            return (1, t, nq, nq * t, nq * nq)
        if path == "fixed":
            return (1, t)
        n, r = _tiles(cfg, s)
        if path == "tiles at r":  # the last tile's rows are the step's own: its terms are constants
            return (1, t, n, n * t)
        return (1, t, n, n * t, *(r, r * t, r * r)[: {1: 0, 2: 2, 3: 3}[degree]])

    return terms


def _candidates(cfg: DrafterConfig, path: str, shape: StepShape) -> Iterator[StepShape]:
    """Small shapes to trace for `path`, cheapest first, with `shape`'s rows: two context lengths, and blocks —
    `shape`'s own (fixed), from 2 (dense), from 4 query tiles on (tiles). A size of 1 is avoided where `shape` has
    none: PyTorch makes views of some copies along a size-1 dimension, so such a shape runs other ops."""
    if path == "fixed":
        counts: Iterator[int] = iter([shape.blocks])
    elif path == "dense":
        counts = iter([2, 3, 4, 5])
    elif path == "tiles at r":
        counts = (b for b in range(2, 8 * DEFAULT_TILE) if _same_last_tile(cfg, b, shape))
    else:
        counts = (b for b in range(2, 8 * DEFAULT_TILE) if _tiles(cfg, StepShape(1, 1, b))[0] >= 4)
    for b in counts:
        for t in _TRACE_TOKENS:
            yield StepShape(rows=shape.rows, tokens=t, blocks=b)


def _same_last_tile(cfg: DrafterConfig, blocks: int, shape: StepShape) -> bool:
    """Whether `blocks` blocks make 4 or more query tiles whose last has the rows of `shape`'s last tile."""
    n, r = _tiles(cfg, StepShape(1, 1, blocks))
    return n >= 4 and r == _tiles(cfg, shape)[1]


def _fit(cfg: DrafterConfig, shape: StepShape, *, bf16: bool, tiled: bool, path: str) -> _Fit:
    """Trace the drafter at the fewest small shapes whose monomials are independent, one per monomial (cached)."""
    import numpy as np

    fixed = shape.blocks if path == "fixed" else _tiles(cfg, shape)[1] if path == "tiles at r" else None
    key = (repr(cfg), bf16, tiled, path, shape.rows, fixed)
    if key in _FITS:
        return _FITS[key]
    terms = _terms(cfg, path)
    need = len(terms(shape))
    chosen: list[StepShape] = []
    for candidate in _candidates(cfg, path, shape):
        if np.linalg.matrix_rank(np.array([terms(s) for s in [*chosen, candidate]], dtype=float)) > len(chosen):
            chosen.append(candidate)
        if len(chosen) == need:
            break
    if len(chosen) < need:
        raise RuntimeError(f"no {need} independent small shapes to trace the {path} path of {cfg.block_size}-blocks")
    values, ops = [], None
    with _shape_drafter(cfg, bf16=bf16) as drafter:
        for traced in chosen:
            tiles = _tiles(cfg, traced)[0] if tiled else 1
            m = _trace(_step_inputs(drafter, traced, bf16=bf16, tiled=tiled))
            forward, backward = _compress(m.forward, tiles), _compress(m.backward, tiles)
            these = [op for op, _ in forward + backward]
            if ops is not None and these != ops:
                raise RuntimeError(f"the drafter runs other ops at {traced} than at {chosen[0]}: it cannot be scaled")
            ops = these
            values.append([m.saved, m.start, *(v for _, v in forward), *(v for _, v in backward)])
    fit = _Fit(terms, chosen, values, len(forward))
    if len(_FITS) >= 16:
        _FITS.pop(next(iter(_FITS)))
    _FITS[key] = fit
    return fit


def scaled_drafter_step(cfg: DrafterConfig, shape: StepShape, settings: MemorySettings) -> dict[str, int]:
    """What `trace_drafter_step` gives, from traces at small shapes (`_Fit`): the same cost at any `shape`. A shape
    of one block, or of fewer than 4 query tiles on the CPU path, is traced at its own blocks (its contexts scaled)."""
    tiled = settings.device == "cpu"
    few = shape.blocks == 1 or (tiled and _tiles(cfg, shape)[0] < 4)
    # Where the block size divides the tile, the last tile's rows repeat every few blocks: traces at the step's own
    # r make 4 instead of 7 (r's terms constants) — else r is fitted too.
    at_r = tiled and not few and DEFAULT_TILE % cfg.block_size == 0
    path = "fixed" if few else "tiles at r" if at_r else "tiles" if tiled else "dense"
    return _fit(cfg, shape, bf16=settings.bf16, tiled=tiled, path=path).at(shape)


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
    cfg: DrafterConfig, target: Any, shape: StepShape, settings: MemorySettings | None = None, *, traced: bool = True
) -> MemoryParts:
    """The peak bytes per rank of one training step of drafter `cfg` on `target` (a `TargetShape`). `traced=False`:
    a lower bound in closed form, without the drafter's forward and backward (no trace: instant at any size)."""
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
    passes = (
        scaled_drafter_step(cfg, shape, s) if traced else dict.fromkeys(("forward_peak", "saved", "backward_peak"), 0)
    )
    b, t, nq = shape.rows, shape.tokens, shape.blocks * cfg.block_size
    inputs = b * t * cfg.num_features * cfg.hidden_size * 4  # (B, T, K·H) float32 features
    if s.device == "cpu":  # per layer type the additive masks of the query tiles, at their widest (CUDA: flex)
        inputs += len(set(cfg.layer_types)) * widest_tiles_bytes(b, nq, t, 2 if s.bf16 else 4)
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
        passes["forward_peak"], passes["saved"] + loss, passes["backward_peak"] + grads
    )
    est.notes["drafter step"] = (
        f"features + masks, then forward {passes['forward_peak'] / 2**30:.3f} / loss over saved "
        f"{(passes['saved'] + loss) / 2**30:.3f} / backward + gradients "
        f"{(passes['backward_peak'] + grads) / 2**30:.3f} GiB "
        + ("(traced shape-only at small shapes, scaled)" if traced else "(the drafter's activations left out)")
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
    "interpolate",
    "loss_working_set",
    "scaled_drafter_step",
    "step_memory",
    "trace_drafter_step",
]
