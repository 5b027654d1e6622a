"""Which precision a CPU training run computes its drafter in (`dtype: auto`), chosen by timing both on this machine.

    precision, timings = choose_precision(drafter_cfg, StepShape(rows=1, tokens=1024, blocks=128), timer)
    # "bf16" or "fp32", {"fp32": ms per step, "bf16": ms per step} (empty when stored or forced)

bf16 autocast runs the drafter's matrix products (and the loss's LM-head products) in bf16 with fp32 weights, fp32
optimizer state and an fp32 loss. Whether that is faster on a CPU depends on its bf16 arithmetic (AVX512-BF16 and
AMX do it natively; elsewhere bf16 is converted around fp32 products and is slower) and on the step's shapes, so
`dtype: auto` on a CPU times one real step of each at the run's geometry (`timer`: `step_cost.time_drafter_step`, a
few seconds) and takes bf16 only when it is at least `MARGIN` faster: bf16 rounds, so a tie goes to fp32, the reference.
On CUDA `auto` is bf16 (tensor cores compute it natively).

A choice is kept in the user cache (`~/.cache/dflashkit/train_precision/<machine>.json`, keyed by the drafter's
geometry and the step's shape) and timed again after the choices' age limit (`cpu_products.choice`, default 7 days);
`dflashkit info` lists the stored ones. `DFLASHKIT_CHOICES=train_precision=fp32|bf16` replaces the measurement; an
explicit `dtype` in the config always wins. A run keeps its precision for life (the training state records it), so a
resumed run continues as it began. Ranks sum their timings before choosing, so every rank of a distributed run
computes alike. The mechanism (override, store, gate) is the one every measured choice uses (`cpu_products.choice`).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from dflashkit.cpu_products.choice import BF16_GATE as MARGIN
from dflashkit.cpu_products.choice import PRECISIONS, Choice, Store
from dflashkit.drafter.config import DrafterConfig
from dflashkit.train.memory import StepShape

TRAINING = Choice("train_precision", PRECISIONS, default="fp32", gate=MARGIN)


def geometry_key(cfg: DrafterConfig, shape: StepShape) -> str:
    """What a step's speed depends on: the drafter's widths and depth, its head, the loss's vocabulary, the shape."""
    head = cfg.draft_vocab_size or cfg.vocab_size
    return (
        f"{cfg.kind}:h{cfg.hidden_size}:l{cfg.num_hidden_layers}:a{cfg.num_attention_heads}/{cfg.num_key_value_heads}"
        f"x{cfg.head_dim}:i{cfg.intermediate_size}:f{cfg.num_features}:v{head}:bs{cfg.block_size}"
        f":{shape.rows}x{shape.tokens}x{shape.blocks}"
    )


def choose_precision(
    cfg: DrafterConfig,
    shape: StepShape,
    timer: Callable[[DrafterConfig, StepShape, bool], float],
    *,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
    store: Store | None = None,
    use_store: bool = True,
) -> tuple[str, dict[str, float]]:
    """(the precision a CPU run of drafter `cfg` at `shape` computes in, {precision: ms per step} when timed now).
    `timer(cfg, shape, bf16)` → seconds of one real step (`step_cost.time_drafter_step`); `all_reduce` sums timings
    over ranks; `store` the store (default this machine's), `use_store` False: neither read nor written."""
    return TRAINING.measure(
        geometry_key(cfg, shape),
        PRECISIONS,
        lambda p: timer(cfg, shape, p == "bf16"),
        all_reduce=all_reduce,
        store=(store or TRAINING.store()) if use_store else None,
    )


__all__ = ["MARGIN", "PRECISIONS", "TRAINING", "choose_precision", "geometry_key"]
