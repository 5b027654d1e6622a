"""One optimizer step's work: rows → anchors, blocks, labels and masks (`prepare_inputs`), then the drafter
forward and its loss (`step_loss`); and the order in which a rank reads its rows (`micro_batches`).

Everything random is seeded per (seed, epoch, row) or (seed, epoch, step, row), never drawn from a global stream,
so a resumed run reproduces an uninterrupted one exactly and a step is the same for any number of ranks.
Noise (noise_std > 0) is added to the context features going into fc, never to labels or target logits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dflashkit.drafter.capture_needs import capture_target_lse
from dflashkit.drafter.heads import HeadObjective, TrainingTerms, head_of
from dflashkit.target.logsumexp import vocab_subset_logits
from dflashkit.train.blocks import BlockBatch, attention_masks, build_blocks, sample_anchors
from dflashkit.train.config import TrainConfig
from dflashkit.train.losses import (
    DISTRIBUTION_KINDS,
    LMHead,
    LossOutput,
    LossSpec,
    LossTarget,
    block_loss,
    dpace_weights,
)
from dflashkit.train.packing import RowBatch, collate_rows, epoch_order, mix_seed, step_rows
from dflashkit.train.run import Run
from dflashkit.train.slot_targets import (
    block_labels,
    draft_vocab_head,
    draft_vocab_topk,
    every_slot_labels,
    every_slot_target_index,
    kl_target_logits,
    topk_targets,
)


@dataclass
class StepInputs:
    features: Tensor  # (B, T, K·H) context features (noise added when on), on the drafter device
    blocks: BlockBatch  # on the drafter device
    labels: Tensor  # (B, Nb, bs) long, −100 invalid (DSpark: the token after each slot's, on a valid prefix)
    masks: dict[str, Any] | None  # additive attention mask per layer type (None: built when used)
    prev_tokens: Tensor | None = None  # DSpark: (B, Nb, bs) the previous token each slot's Markov head reads
    final_hidden: Tensor | None = None  # DSpark: (B, T, H) the target's final-layer output (its distribution)
    step: int = 0  # the optimizer step (0-based) these inputs belong to
    progress: float | None = None  # a time-based run: the fraction of its schedule spent (None: step-based)


@dataclass(frozen=True)
class StepDraw:
    """What one step's inputs are drawn with: the label mode (`labels`: data or target), anchors per document, the
    run's seed, the epoch, the optimizer step (0-based), the fraction of a time-based schedule spent (None:
    step-based) and the std of the fc-input noise."""

    labels: str
    max_anchors: int
    seed: int
    epoch: int
    step: int = 0
    progress: float | None = None
    noise_std: float = 0.0

    @classmethod
    def from_config(cls, cfg: TrainConfig, epoch: int, **step: Any) -> StepDraw:
        """The run's label mode, anchors per document and seed, with this step's epoch (and `step`, `progress`,
        `noise_std` as given)."""
        return cls(labels=cfg.labels, max_anchors=cfg.max_anchors, seed=cfg.seed, epoch=epoch, **step)


def row_anchors(rows: RowBatch, *, seed: int, epoch: int, max_anchors: int) -> list[Tensor]:
    """Anchor indices per row, drawn with a generator seeded by (seed, epoch, row id) → list of (n_i,) long."""
    out = []
    for i, rid in enumerate(rows.row_ids):
        g = torch.Generator().manual_seed(mix_seed(seed, "anchors", epoch, rid))
        out.append(sample_anchors(rows.doc_ids[i].cpu(), rows.loss_mask[i].cpu(), max_anchors=max_anchors, generator=g))
    return out


def noise_std_at(cfg: TrainConfig, step: int, total_steps: int) -> float:
    """fc-input noise std at `step` (0-based): constant, or a cosine from noise_std down to 0."""
    if cfg.noise_std <= 0:
        return 0.0
    if cfg.noise_schedule == "constant":
        return float(cfg.noise_std)
    return float(cfg.noise_std) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, total_steps))))


def fc_noise(
    features: Tensor, doc_ids: Tensor, std: float, *, seed: int, epoch: int, step: int, row_ids: Sequence[int]
) -> Tensor:
    """features (B, T, K·H) + N(0, std²) on real tokens, one generator per (seed, epoch, step, row)."""
    if std <= 0:
        return features
    noise = torch.empty_like(features)
    for i, rid in enumerate(row_ids):
        g = torch.Generator(device=features.device).manual_seed(mix_seed(seed, "noise", epoch, step, rid))
        noise[i] = torch.randn(features.shape[1:], generator=g, device=features.device, dtype=features.dtype)
    return features + noise * std * (doc_ids >= 0)[..., None].to(features.dtype)


def prepare_inputs(
    rows: RowBatch,
    drafter_config: Any,
    draw: StepDraw,
    *,
    device: torch.device | str = "cpu",
    mask_dtype: torch.dtype = torch.float32,
    build_masks: bool = True,
) -> StepInputs:
    """Rows (CPU) → blocks, labels and masks on `device`, drawn as `draw` says; noise only on the features.

    Masks are dense and made additive once here, in the attention dtype (`mask_dtype`), so every drafter layer
    shares one tensor instead of converting its own copy (and saving it for backward)."""
    labels, seed, epoch, step = draw.labels, draw.seed, draw.epoch, draw.step
    anchors = row_anchors(rows, seed=seed, epoch=epoch, max_anchors=draw.max_anchors)
    nb = max([1] + [int(a.numel()) for a in anchors])  # ≥ 1 block keeps shapes valid
    blocks = build_blocks(
        rows.input_ids,
        rows.doc_ids,
        rows.positions,
        rows.loss_mask,
        block_size=drafter_config.block_size,
        anchors=anchors,
        num_blocks=nb,
    )
    prev = final = None
    head = head_of(drafter_config)
    feats = rows.features.to(device, non_blocking=True)  # (B, T, K·H) (+ the final layer's H when the head reads it)
    if head.first_draft_slot == 0:  # every slot drafts the token after the one before it
        lab, prev = every_slot_labels(blocks, rows, labels)  # (B, Nb, bs) each
        prev = prev.to(device)
    else:
        lab = block_labels(blocks, rows, labels)  # (B, Nb, bs)
    if head.reads_final_layer:  # the target's final-layer output: read last, or one of the drafter's own layers
        h, width = drafter_config.hidden_size, drafter_config.num_features * drafter_config.hidden_size
        last = drafter_config.num_target_layers - 1
        j = drafter_config.target_layer_ids.index(last) if last in drafter_config.target_layer_ids else None
        final = feats[..., width:] if j is None else feats[..., j * h : (j + 1) * h]  # (B, T, H)
        feats = feats[..., :width]
    blocks = blocks.to(device)
    feats = fc_noise(
        feats, rows.doc_ids.to(device), draw.noise_std, seed=seed, epoch=epoch, step=step, row_ids=rows.row_ids
    )
    masks = attention_masks(drafter_config, blocks, mask_dtype) if build_masks else None
    return StepInputs(
        features=feats,
        blocks=blocks,
        labels=lab.to(device),
        masks=masks,
        prev_tokens=prev,
        final_hidden=final,
        step=step,
        progress=draw.progress,
    )


def step_loss(run: Run, inp: StepInputs, rows: RowBatch, normalizer: Tensor | float) -> LossOutput:
    """The drafter forward over every block of `inp` and its loss (`block_loss`), normalised by `normalizer`."""
    cfg = run.cfg
    masks = inp.masks
    if masks is None:
        masks = attention_masks(run.drafter.config, inp.blocks, run.autocast_dtype or torch.float32)
    # a validation pass (no gradient) runs eager: its inference graph would be a second compile for seconds of work
    module = run.step_module if torch.is_grad_enabled() else run.module
    with run.autocast():
        hidden = module(
            inp.features, inp.blocks.first_tokens, inp.blocks.context_positions, inp.blocks.block_positions, masks
        )  # (B, Nq, H)
    bs = inp.blocks.block_size
    head, labels = draft_vocab_head(run.drafter, run.lm_head, inp.labels)  # (V', H), (B, Nb, bs)
    prev = inp.prev_tokens if inp.prev_tokens is not None else block_predecessors(rows, inp.blocks)  # (B, Nb, bs)
    labels = labels.reshape(-1, bs)
    spec = LossSpec.from_config(cfg, weights=run.weights, normalizer=normalizer)
    target = LossTarget()
    if cfg.loss in DISTRIBUTION_KINDS:
        target = LossTarget(logits=kl_target_logits(run, rows, inp.blocks))
    elif cfg.loss == "topk":  # the stored top-k at index a+k−1, as draft ids (−1: dropped before renormalising)
        ids, lps = topk_targets(inp.blocks, rows, cfg.topk)  # (B, Nb, bs, K)
        ids = draft_vocab_topk(run.drafter, ids, run.lm_head.shape[0])
        target = LossTarget(
            topk_ids=ids.reshape(-1, bs, ids.shape[-1]), topk_logprobs=lps.reshape(-1, bs, lps.shape[-1])
        )

    def configured_loss(
        states: Tensor, lm_rows: Tensor, kind: str | None = None, extra: Tensor | None = None
    ) -> LossOutput:
        """The configured objective (or `kind`) over the step's labels for logits states·lm_rowsᵀ (with `extra`
        (V', r): states·[lm_rows ; extra]ᵀ, only extra trained)."""
        own = spec.with_kind(kind or cfg.loss)  # hard-label CE reads no target side (e.g. a head's CE term)
        with run.autocast():  # the LM-head products at the drafter's precision (on CUDA the head is bf16 already)
            return block_loss(states, LMHead(lm_rows, extra), labels, own, target if own.kind != "ce" else None)

    terms = TrainingTerms(
        drafter=run.drafter,
        hidden=hidden.reshape(-1, bs, hidden.shape[-1]),
        head_weight=head,
        labels=labels,
        prev_tokens=prev.reshape(-1, bs),
        weights=run.weights,
        normalizer=normalizer,
        step=inp.step,
        train_cfg=cfg,
        weights_of=lambda ce, counted: slot_weights(cfg, run.weights, ce, counted),
        embed_weight=run.embed,
        total_steps=run.total_steps,
        progress=inp.progress,
        backbone_loss=configured_loss,
        target_labels=inp.labels.reshape(-1, bs),
        # the target's distribution at each slot, where the head reads the target's final layer
        target_logits=None if inp.final_hidden is None else _target_logits(run, inp, rows, head),
    )
    own = run.drafter.head.objective(terms)
    if own is not None:
        return _head_objective_output(run, own)
    # a head's scaling of its logits, on W's rows
    out = configured_loss(terms.hidden, run.drafter.head.unary_weight(run.drafter.config, head))
    extra = run.drafter.head.training_loss(terms)
    return out if extra is None else dataclasses.replace(out, loss=out.loss + extra)


def _head_objective_output(run: Run, own: HeadObjective) -> LossOutput:
    """A head's own objective as the loop's LossOutput: per-slot accuracy from its counts, with the given token's
    entry first when every slot drafts (as DFlash's slot 0), so `estimated_tau` reads it as it reads DFlash's."""
    correct, counts = own.correct_counts, own.valid_counts  # (bs,) each
    weight_sum = own.weight_sum if own.weight_sum is not None else (run.weights.to(counts.device) * counts).sum()
    if run.drafter.head.first_draft_slot == 0:
        blocks = counts[:1]  # the given token: once per block whose first slot is live
        correct, counts = torch.cat([blocks, correct]), torch.cat([blocks, counts])
    accuracy = correct.float() / counts.clamp_min(1).float()
    return LossOutput(
        loss=own.loss, accuracy=accuracy, valid_counts=counts, correct_counts=correct, weight_sum=weight_sum.detach()
    )


def block_predecessors(rows: RowBatch, blocks: BlockBatch) -> Tensor:
    """(B, Nb, bs) long: the data token before each slot (index a + k − 1). Where a slot k ≥ 1 has a label,
    a + k − 1 ≥ a lies in the anchor's document; slot 0 reads the token before the anchor when that is in the
    anchor's document, else the anchor itself (a document's first token has no predecessor)."""
    t = rows.input_ids.shape[1]
    anchors = blocks.anchors.clamp(min=0).to(rows.input_ids.device)  # (B, Nb)
    idx = anchors[:, :, None] + torch.arange(blocks.block_size, device=anchors.device) - 1
    before = (anchors - 1).clamp(min=0)  # (B, Nb)
    same_doc = (anchors > 0) & (
        rows.doc_ids.to(anchors.device).gather(1, before) == blocks.block_doc_ids.to(anchors.device)
    )
    idx[:, :, 0] = torch.where(same_doc, before, anchors)
    idx = idx.clamp(0, t - 1)  # (B, Nb, bs)
    b, nb, bs = idx.shape
    return rows.input_ids.gather(1, idx.reshape(b, nb * bs)).view(b, nb, bs).to(blocks.anchors.device)


def slot_weights(cfg: TrainConfig, weights: Tensor, ce: Tensor, counted: Tensor) -> Tensor:
    """A head's own term's slot weights (N, bs) by the objective's rule: the fixed decay `weights`, or D-PACE's from
    that term's per-slot loss `ce` (detached) over the `counted` slots."""
    if cfg.position_weights == "dpace":
        return dpace_weights(ce, counted, cfg.dpace_alpha)
    return weights.to(ce.device)[None].expand_as(ce) * counted


def _target_logits(run: Run, inp: StepInputs, rows: RowBatch, head: Tensor) -> Any:
    """The target's distribution at each slot's index (a + k for slot k) as `TrainingTerms.target_logits` gives it:
    flattened slot ids (m,) → its logits from the target's final-layer output there (final norm and LM head, only
    for the slots asked, once per distinct position). With a reduced draft vocabulary (and a plain linear head) only
    the draft ids' logits are formed (`head`: their rows); the log-sum-exp over the whole vocabulary comes from the
    rows when the features carry it (captured with `--target-lse`), else from the run's per-row cache
    (`dflashkit.train.target_lse`)."""
    b, t, h_dim = inp.final_hidden.shape
    rows_bt = torch.arange(b, device=run.device)[:, None, None] * t + every_slot_target_index(inp.blocks)  # (B, Nb, bs)
    flat_final = inp.final_hidden.reshape(b * t, h_dim)
    flat_rows = rows_bt.reshape(-1)
    reduced = capture_target_lse(run.drafter.config, run.target)
    flat_lse = None
    if reduced:
        lse = None if rows.target_lse is None else rows.target_lse.to(inp.final_hidden.device)  # (B, T)
        if lse is None:
            lse = run.target_lse.rows(run.target, inp.final_hidden, rows.input_ids, rows.doc_ids)  # (B, T)
        flat_lse = lse.reshape(b * t)

    def target_logits(slots: Tensor) -> tuple[Tensor, ...]:  # flattened slot ids (m,)
        # slots of overlapping blocks share row positions (a+k): the target's head runs once per position
        positions, inverse = torch.unique(flat_rows[slots], return_inverse=True)
        sel = flat_final.index_select(0, positions)  # (U, H)
        if flat_lse is None:
            # at the target's precision: float32 features meet a bf16 target's head on CUDA
            return run.target.verifier_logits(sel[None].to(run.target.dtype))[0].float(), inverse  # (U, V)
        logits = vocab_subset_logits(run.target, sel, head).to(head.device)  # (U, V') a subset of the lse's logits
        return logits, flat_lse.index_select(0, positions), inverse  # (U, V'), (U,)

    return target_logits


class _IndexedRows(torch.utils.data.Dataset):
    def __init__(self, rows: Any) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[int, Any]:
        return i, self.rows[i]


def _collate_indexed(items: list[tuple[int, Any]]) -> RowBatch:
    return collate_rows([r for _, r in items], [i for i, _ in items])


def micro_batches(run: Run, epoch: int, first_step: int) -> Iterator[RowBatch]:
    """This rank's micro-batches from step `first_step` of `epoch` to the end of the epoch, in order; loaded by
    `num_workers` DataLoader workers (prefetching) or in the main process when 0 (online features)."""
    cfg, dist = run.cfg, run.dist
    order = epoch_order(len(run.rows), seed=cfg.seed, epoch=epoch)
    plan = [
        ids
        for s in range(first_step, run.steps_per_epoch)
        for ids in step_rows(
            order, s, batch_rows=cfg.batch_rows, grad_accum=cfg.grad_accum, rank=dist.rank, world_size=dist.world_size
        )
    ]
    if cfg.num_workers == 0:
        return (collate_rows([run.rows[i] for i in ids], ids) for ids in plan)
    loader = torch.utils.data.DataLoader(
        _IndexedRows(run.rows),
        batch_sampler=plan,
        collate_fn=_collate_indexed,
        num_workers=cfg.num_workers,
        pin_memory=run.device.type == "cuda",
    )
    return iter(loader)


__all__ = [
    "StepDraw",
    "StepInputs",
    "fc_noise",
    "micro_batches",
    "noise_std_at",
    "prepare_inputs",
    "row_anchors",
    "step_loss",
]
