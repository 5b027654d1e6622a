"""The arithmetic of a training step and the time it takes: FLOPs from the shapes, a rate to turn them into
seconds — assumed for a named GPU, or measured on the machine at hand (`calibrate`).

    cost = step_cost(drafter_cfg, target_shape, StepShape(rows=1, tokens=3072, blocks=512), online=True)
    cost.flops                    # {"drafter": …, "loss": …, "target forward": …}
    gpu_rate("H100").seconds(cost)           # computed: peak bf16 FLOP/s × an assumed utilisation
    calibrate(drafter_cfg).seconds(cost)     # measured: this CPU's rate from real steps of a drafter

The drafter's forward and backward are counted by running them on fake tensors under PyTorch's FLOP counter
(every head's layers counted as they run; at small shapes, interpolated to the step's: `drafter_flops`), plus the
attention products the fused kernels hide from it (4·Nq·S·hd per head forward, twice that backward, over S = T + Nq
keys, or the keys flex attention visits). The loss: the LM head over the rows that carry one (forward and the
states' gradient), the target's forward in online training: 2 FLOPs per active parameter per token plus its
attention.

A measured rate is FLOPs per second of real training steps of the drafter on this machine (`calibrate`: several
shapes, the fastest of a few steps each, their median rate), so what a step does besides its products (masks,
softmax, optimizer) is folded into the rate; bench/plan_accuracy.py checks how well it predicts other shapes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads import head_of
from dflashkit.train.memory import StepShape, fake_step, interpolate

# Dense bf16 tensor-core peaks (FLOP/s, vendor sheets) and memory in GiB as the driver reports it (nvidia-smi's
# MiB / 1024) of the GPUs people train drafters on.
GPUS: dict[str, tuple[float, float]] = {
    "H100": (989e12, 79.6),
    "H200": (989e12, 140.4),
    "B200": (2250e12, 178.4),
    "A100": (312e12, 80.0),
    "L40S": (362e12, 45.0),
    "RTX4090": (165e12, 24.0),
}
# The fraction of that peak a drafter's training step reaches: small matmuls (a drafter of 5 layers) and the
# loss's softmax keep it well below large-model pretraining's ~40-50 %; an assumption, stated in every plan.
GPU_UTILISATION = 0.30


@dataclass
class StepCost:
    """FLOPs of one micro-batch (per rank) by part."""

    flops: dict[str, float] = field(default_factory=dict)

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())


@dataclass(frozen=True)
class Rate:
    """How fast a device turns a step's FLOPs into seconds, and where the figures come from: the training step's
    rate, and the target's forward (inference: no backward, large products) at its own rate when measured."""

    flops_per_s: float
    forward_flops_per_s: float | None = None
    source: str = ""

    def seconds(self, cost: StepCost) -> float:
        forward = cost.flops.get("target forward", 0.0)
        rest = cost.total_flops - forward
        return rest / self.flops_per_s + forward / (self.forward_flops_per_s or self.flops_per_s)


def gpu_rate(name: str, utilisation: float = GPU_UTILISATION) -> Rate:
    """The assumed rate of one GPU of `name` (a key of GPUS)."""
    peak, _ = GPUS[name]
    return Rate(
        flops_per_s=peak * utilisation,
        source=f"assumed: {name} dense bf16 peak {peak / 1e12:,.0f} TFLOP/s × {utilisation:.0%} utilisation",
    )


def _attention_flops(cfg: DrafterConfig, shape: StepShape, visible_keys: float | None = None) -> float:
    """Forward + backward FLOPs of the drafter's attention products: over every [context | block] key (CPU: its
    query tiles skip most, and a calibrated rate counted the same way absorbs that), over the `visible_keys` a query
    sees on average with flex attention's block masks (CUDA)."""
    nq = shape.blocks * cfg.block_size
    keys = shape.tokens + nq if visible_keys is None else visible_keys
    forward = 4 * shape.rows * cfg.num_attention_heads * nq * keys * cfg.head_dim  # QKᵀ and PV
    return 3.0 * forward * cfg.num_hidden_layers  # backward: twice the forward


def drafter_flops(cfg: DrafterConfig, shape: StepShape) -> float:
    """FLOPs the counter sees in the drafter's forward + backward, run on fake tensors. Every product runs over the
    rows' context (T) or queries (Nq), attention's over queries × keys, so the count is B·(a·T + b·Nq + c·Nq·T +
    d·Nq²): it is counted at four small shapes of one row and interpolated (`memory.interpolate`), the same cost at
    any size and no tensor past int64."""
    from torch.utils.flop_counter import FlopCounterMode

    def terms(s: StepShape) -> tuple[int, ...]:
        nq = s.blocks * cfg.block_size
        return (s.tokens, nq, nq * s.tokens, nq * nq)

    traced = [StepShape(1, 64, 2), StepShape(1, 128, 2), StepShape(1, 64, 3), StepShape(1, 64, 4)]
    counts = _FLOP_COUNTS.get(repr(cfg))
    if counts is None:
        counts = []
        for small in traced:
            with fake_step(cfg, small) as step, FlopCounterMode(display=False) as counter:
                hidden = step.forward()  # (B, Nq, H)
                hidden.backward(torch.empty_like(hidden))
            counts.append([int(counter.get_total_flops())])
        _FLOP_COUNTS[repr(cfg)] = counts
    return float(interpolate(terms, traced, counts, StepShape(1, shape.tokens, shape.blocks))[0] * shape.rows)


# The counts at the small shapes, by drafter config: a plan prices several shapes of one drafter.
_FLOP_COUNTS: dict[str, list[list[int]]] = {}


def step_cost(
    cfg: DrafterConfig, target: Any, shape: StepShape, *, online: bool = False, visible_keys: float | None = None
) -> StepCost:
    """FLOPs of one micro-batch: drafter forward + backward, loss, and the target's forward online.
    `visible_keys`: the keys a block query sees on average where the attention skips masked blocks (CUDA)."""
    cost = StepCost()
    counted = drafter_flops(cfg, shape)
    cost.flops["drafter"] = counted + _attention_flops(cfg, shape, visible_keys)
    vocab = cfg.draft_vocab_size or cfg.vocab_size
    m = shape.rows * shape.blocks * (cfg.block_size - head_of(cfg).first_draft_slot)  # rows carrying a loss
    cost.flops["loss"] = 2 * 2.0 * m * cfg.hidden_size * vocab  # logits, and the states' gradient through W
    if online:
        cost.flops["target forward"] = target_forward_flops(target, shape.rows, shape.tokens)
    return cost


def target_forward_flops(target: Any, rows: int, tokens: int) -> float:
    """FLOPs of the target's forward over `rows` rows of `tokens`: 2 per active parameter per token, plus the
    causal attention products of its full-attention layers (half of 4·T²·heads·head_dim each)."""
    n = rows * tokens
    attention = 4 * target.num_attention_heads * target.head_dim * n * tokens / 2
    full = sum(1 for kind in target.layer_types if kind != "linear_attention")
    return 2.0 * target.num_active_parameters * n + attention * full


def time_drafter_step(
    cfg: DrafterConfig, shape: StepShape, *, steps: int = 3, seed: int = 0, bf16: bool = False
) -> float:
    """Seconds of one real training step of the drafter on this machine over random rows (one document each):
    anchors, blocks and masks as training builds them, forward, loss over the draft vocabulary, backward, AdamW —
    the fastest of `steps` after one untimed step (the least disturbed by other work). `bf16`: the forward and the
    loss's products under bf16 autocast, as a bf16 run computes them."""
    from dflashkit.drafter.model import DFlashDrafter
    from dflashkit.train.blocks import attention_masks, build_blocks
    from dflashkit.train.losses import LossSpec, block_loss, decay_weights
    from dflashkit.train.optimizer_choice import make_adamw

    g = torch.Generator().manual_seed(seed)
    b, t, bs = shape.rows, shape.tokens, cfg.block_size
    drafter = DFlashDrafter(cfg).train()
    vocab = cfg.draft_vocab_size or cfg.vocab_size  # the head the loss runs over
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.02  # (V, H)
    features = torch.randn(b, t, cfg.num_features * cfg.hidden_size, generator=g)  # (B, T, K·H)
    ids = torch.randint(0, vocab, (b, t), generator=g)  # (B, T) labels inside the draft vocabulary
    positions = torch.arange(t).expand(b, t)  # (B, T)
    anchors = torch.linspace(0, t - bs - 1, shape.blocks).long().expand(b, shape.blocks)  # (B, Nb)
    optimizer = make_adamw(drafter.parameters(), "foreach", lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        blocks = build_blocks(
            ids,
            torch.zeros_like(ids),
            positions,
            torch.ones_like(ids, dtype=torch.bool),
            block_size=bs,
            anchors=anchors,
        )
        masks = attention_masks(cfg, blocks, torch.bfloat16 if bf16 else torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            embeds = drafter.block_embeddings(blocks.first_tokens, embed, bs)  # (B, Nq, H)
            hidden = drafter(
                features, embeds, context_positions=blocks.context_positions,
                block_positions=blocks.block_positions, attention_mask=masks, block_len=bs,
            )  # fmt: skip
            labels = blocks.labels.reshape(-1, bs)  # (B·Nb, bs)
            states = hidden.reshape(-1, bs, cfg.hidden_size)
            loss = block_loss(states, embed[:vocab], labels, LossSpec(weights=decay_weights(bs))).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t0)
    return min(times)


def precision_timer(cfg: DrafterConfig, shape: StepShape, bf16: bool) -> float:
    """Seconds of one step in fp32 or bf16, as `precision_choice.choose_precision` times the two (two steps each)."""
    return time_drafter_step(cfg, shape, steps=2, bf16=bf16)


def time_target_forward(target: Any, tokens: int, *, repeats: int = 2, seed: int = 0) -> float:
    """Seconds of the target's forward over one row of `tokens` tokens, as online features run it (the drafter's
    layers hooked, logits formed, no gradient): the fastest of `repeats` after one untimed pass."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (1, tokens), generator=g)  # (1, T)
    layers = list(range(1, target.num_layers - 2, max(1, (target.num_layers - 3) // 5)))[:5]
    times = []
    with torch.no_grad():
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            target.forward(ids, layer_ids=layers, logits=True)
            if i:
                times.append(time.perf_counter() - t0)
    return min(times)


def calibrate(
    cfg: DrafterConfig, shapes: list[StepShape], *, target: Any = None, target_shape: Any = None, steps: int = 3
) -> tuple[Rate, list[dict[str, Any]]]:
    """This machine's rates, measured: real drafter steps at each of `shapes` (the median of their FLOPs per
    second), and with a loaded `target` (and its `target_shape`) its forward over the largest shape's row, whose
    FLOPs per second price the target's forward in online training. Steps run in the precision a CPU run of the
    largest shape takes (`precision_choice`). Returns the rate and one record per timing."""
    from dflashkit.cpu_products.machine import machine_line
    from dflashkit.train.precision_choice import choose_precision

    precision = choose_precision(cfg, max(shapes, key=lambda s: s.rows * s.tokens * s.blocks), precision_timer)[0]
    records = []
    for shape in shapes:
        cost = step_cost(cfg, None, shape)
        seconds = time_drafter_step(cfg, shape, steps=steps, bf16=precision == "bf16")
        records.append({"what": "drafter step", "shape": dict(shape.__dict__), "flops": cost.total_flops,
                        "precision": precision, "s": seconds})  # fmt: skip
    rates = sorted(r["flops"] / r["s"] for r in records)
    forward_rate = None
    if target is not None:
        tokens = max(s.tokens for s in shapes)
        flops = target_forward_flops(target_shape, 1, tokens)
        seconds = time_target_forward(target, tokens)
        records.append({"what": "target forward", "tokens": tokens, "flops": flops, "s": seconds})
        forward_rate = flops / seconds
    rate = Rate(
        flops_per_s=rates[len(rates) // 2],
        forward_flops_per_s=forward_rate,
        source=f"measured: real {precision} steps of {len(shapes)} shapes"
        + (" and the target's forward" if forward_rate else "")
        + f" on {machine_line()}",
    )
    return rate, records


__all__ = [
    "GPUS",
    "GPU_UTILISATION",
    "Rate",
    "StepCost",
    "calibrate",
    "drafter_flops",
    "gpu_rate",
    "precision_timer",
    "step_cost",
    "target_forward_flops",
    "time_drafter_step",
    "time_target_forward",
]
