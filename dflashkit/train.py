"""DFlash drafter training: setup → loop → save, resumable, single process or under torchrun (DDP / FSDP2).

    from dflashkit.train import train
    from dflashkit.train_config import TrainConfig
    result = train(TrainConfig.load("configs/smollm2.yaml", ["max_steps=100"]))
    # or: dflashkit train configs/smollm2.yaml max_steps=100
    # or: torchrun --nproc_per_node 2 $(which dflashkit) train configs/smollm2.yaml

One optimizer step: the next rows of the epoch (rows packed by `packing`), per row a fresh anchor sample seeded by
(seed, epoch, row) → `build_blocks` → the training mask per layer type → drafter forward over all blocks →
`block_loss` (same-position labels, decayed slot weights, normalised by the slot-weight sum of the whole global
step so any split over micro-batches and ranks gives the same gradient) → backward → clip → AdamW → cosine LR.

Labels ("same position"): slot k of the block at anchor a predicts the token AT index a+k.
    labels="data":   input_ids[a+k]
    labels="target": target_tokens[a+k−1], the target's final-layer argmax at index a+k−1, i.e. the target's
                     own prediction for the token at a+k (Sample.target_tokens[i] predicts position i+1).
Objectives (`loss`): "ce" on those labels; "kl" to the target's full distribution at a+k−1 (runs the target every
step); "topk": (1 − topk_ce_weight)·KL(q ‖ p_draft) + topk_ce_weight·CE(label), q = the target's top-k at a+k−1
stored by `dflashkit capture --topk K` (or computed online), renormalised over its k entries — no target forward
during training. With a reduced draft vocabulary the top-k entries outside it are dropped before renormalising
(a slot left with none trains on its hard label). The alignment lives in `dflashkit.slot_targets`.
Noise (noise_std > 0) is added to the context features going into fc, never to labels or target logits.

Everything random is seeded per (seed, epoch, row) rather than drawn from a global stream, so a resumed run
reproduces an uninterrupted one exactly and a step is the same for any number of ranks. Checkpoints, the
`latest` pointer and `final/` are described in `train_state`; metrics in `metrics`.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dflashkit.blocks import BlockBatch, build_blocks, masks_for_layer_types, sample_anchors
from dflashkit.errors import DFlashError
from dflashkit.io_utils import atomic_write_text
from dflashkit.losses import block_loss, estimated_tau
from dflashkit.model import to_additive
from dflashkit.packing import RowBatch, collate_rows, epoch_order, mix_seed, step_rows
from dflashkit.slot_targets import (block_labels, draft_vocab_head, draft_vocab_topk, kl_target_logits,
                                    topk_targets)
from dflashkit.train_config import TrainConfig
from dflashkit.train_state import Run, checkpoint_name, cosine_at, save_checkpoint, save_final, setup_run


class TrainingDiverged(DFlashError):
    """The loss or the gradient norm became NaN/inf; the last good state was saved."""


@dataclass
class TrainResult:
    out_dir: Path
    step: int
    stopped: str                       # completed | time_budget | interrupted | requested
    checkpoint: Path | None            # the last step checkpoint written
    final_dir: Path | None             # out/final (None when interrupted)
    best_dir: Path | None = None       # out/best (keep_best: the drafter of the best validation pass)
    best_val_tau: float | None = None
    best_val_step: int = 0
    train_metrics: dict[str, Any] = field(default_factory=dict)   # last step's record
    val_metrics: dict[str, Any] | None = None
    elapsed_s: float = 0.0


@dataclass
class StepEnd:
    """Passed to callbacks after every optimizer step."""

    step: int
    metrics: dict[str, Any]
    run: Run

    def request_stop(self, reason: str = "requested") -> None:
        self.run.stop_reason = self.run.stop_reason or reason


# ---------------------------------------------------------------------------------------------- stop signal
_STOP: dict[str, str | None] = {"reason": None}


def handle_stop_signal(signum: int, frame: Any = None) -> None:
    """SIGINT/SIGTERM: finish the current step, save a checkpoint, exit; a second signal aborts at once."""
    if _STOP["reason"] is not None:
        raise KeyboardInterrupt
    _STOP["reason"] = "interrupted"
    print(f"\n[dflashkit train] {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
          f"(send it again to abort without saving)", flush=True)


@contextlib.contextmanager
def _stop_handlers():
    _STOP["reason"] = None
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handle_stop_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _STOP["reason"] = None


# ---------------------------------------------------------------------------------------------- step inputs
@dataclass
class StepInputs:
    features: Tensor        # (B, T, K·H) context features (noise added when on), on the drafter device
    blocks: BlockBatch      # on the drafter device
    labels: Tensor          # (B, Nb, bs) long, −100 invalid
    masks: dict[str, Any] | None   # additive attention mask per layer type (None: built when used)


def row_anchors(rows: RowBatch, *, seed: int, epoch: int, max_anchors: int) -> list[Tensor]:
    """Anchor indices per row, drawn with a generator seeded by (seed, epoch, row id) → list of (n_i,) long."""
    out = []
    for i, rid in enumerate(rows.row_ids):
        g = torch.Generator().manual_seed(mix_seed(seed, "anchors", epoch, rid))
        out.append(sample_anchors(rows.doc_ids[i].cpu(), rows.loss_mask[i].cpu(), max_anchors=max_anchors,
                                  generator=g))
    return out


def noise_std_at(cfg: TrainConfig, step: int, total_steps: int) -> float:
    """fc-input noise std at `step` (0-based): constant, or a cosine from noise_std down to 0."""
    if cfg.noise_std <= 0:
        return 0.0
    if cfg.noise_schedule == "constant":
        return float(cfg.noise_std)
    return float(cfg.noise_std) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, total_steps))))


def fc_noise(features: Tensor, doc_ids: Tensor, std: float, *, seed: int, epoch: int, step: int,
             row_ids: Sequence[int]) -> Tensor:
    """features (B, T, K·H) + N(0, std²) on real tokens, one generator per (seed, epoch, step, row)."""
    if std <= 0:
        return features
    noise = torch.empty_like(features)
    for i, rid in enumerate(row_ids):
        g = torch.Generator(device=features.device).manual_seed(mix_seed(seed, "noise", epoch, step, rid))
        noise[i] = torch.randn(features.shape[1:], generator=g, device=features.device, dtype=features.dtype)
    return features + noise * std * (doc_ids >= 0)[..., None].to(features.dtype)


def prepare_inputs(rows: RowBatch, *, drafter_config: Any, labels: str, max_anchors: int, seed: int, epoch: int,
                   step: int = 0, noise_std: float = 0.0, device: torch.device | str = "cpu",
                   mask_dtype: torch.dtype = torch.float32, build_masks: bool = True) -> StepInputs:
    """Rows (CPU) → blocks, labels and masks on `device`; noise only on the features.

    Masks are dense and made additive once here, in the attention dtype (`mask_dtype`), so every drafter layer
    shares one tensor instead of converting its own copy (and saving it for backward)."""
    anchors = row_anchors(rows, seed=seed, epoch=epoch, max_anchors=max_anchors)
    nb = max([1] + [int(a.numel()) for a in anchors])                  # ≥ 1 block keeps shapes valid
    blocks = build_blocks(rows.input_ids, rows.doc_ids, rows.positions, rows.loss_mask,
                          block_size=drafter_config.block_size, anchors=anchors, num_blocks=nb)
    lab = block_labels(blocks, rows, labels)                           # (B, Nb, bs)
    blocks = blocks.to(device)
    feats = rows.features.to(device, non_blocking=True)                # (B, T, K·H)
    feats = fc_noise(feats, rows.doc_ids.to(device), noise_std, seed=seed, epoch=epoch, step=step,
                     row_ids=rows.row_ids)
    masks = attention_masks(drafter_config, blocks, mask_dtype) if build_masks else None
    return StepInputs(features=feats, blocks=blocks, labels=lab.to(device), masks=masks)


def attention_masks(drafter_config: Any, blocks: BlockBatch, dtype: torch.dtype) -> dict[str, Any]:
    """Training mask per layer type: flex-attention BlockMasks on CUDA (sparse, no dense (Nq, T + Nq) tensor),
    additive (B, 1, Nq, T + Nq) tensors in the attention dtype elsewhere. Both are tested against the same
    naive reference (tests/test_blocks.py)."""
    if blocks.anchors.device.type == "cuda":
        return masks_for_layer_types(drafter_config, blocks, backend="flex")
    return {k: to_additive(m, dtype) for k, m in masks_for_layer_types(drafter_config, blocks).items()}


def _loss(run: Run, inp: StepInputs, rows: RowBatch, normalizer: Tensor | float):
    cfg = run.cfg
    masks = inp.masks
    if masks is None:
        masks = attention_masks(run.drafter.config, inp.blocks, run.autocast_dtype or torch.float32)
    with run.autocast():
        hidden = run.module(inp.features, inp.blocks.first_tokens, inp.blocks.context_positions,
                            inp.blocks.block_positions, masks)                # (B, Nq, H)
    bs = inp.blocks.block_size
    target = kl_target_logits(run, rows, inp.blocks) if cfg.loss == "kl" else None
    head, labels = draft_vocab_head(run.drafter, run.lm_head, inp.labels)
    soft: dict[str, Any] = {}
    if cfg.loss == "topk":   # the stored top-k at index a+k−1, as draft ids (−1: dropped before renormalising)
        ids, lps = topk_targets(inp.blocks, rows, cfg.topk)                        # (B, Nb, bs, K)
        ids = draft_vocab_topk(run.drafter, ids, run.lm_head.shape[0])
        soft = dict(topk_ids=ids.reshape(-1, bs, ids.shape[-1]), topk_logprobs=lps.reshape(-1, bs, lps.shape[-1]),
                    ce_weight=cfg.topk_ce_weight)
    return block_loss(hidden.reshape(-1, bs, hidden.shape[-1]), head, labels.reshape(-1, bs),
                      weights=run.weights, kind=cfg.loss, target_logits=target, chunk_size=cfg.loss_chunk_size,
                      normalizer=normalizer, **soft)


# ---------------------------------------------------------------------------------------------- data
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
    plan = [ids for s in range(first_step, run.steps_per_epoch)
            for ids in step_rows(order, s, batch_rows=cfg.batch_rows, grad_accum=cfg.grad_accum,
                                 rank=dist.rank, world_size=dist.world_size)]
    if cfg.num_workers == 0:
        return (collate_rows([run.rows[i] for i in ids], ids) for ids in plan)
    loader = torch.utils.data.DataLoader(_IndexedRows(run.rows), batch_sampler=plan, collate_fn=_collate_indexed,
                                         num_workers=cfg.num_workers, pin_memory=run.device.type == "cuda")
    return iter(loader)


# ---------------------------------------------------------------------------------------------- evaluation
def keep_if_best(run: Run, val: dict[str, Any] | None) -> Path | None:
    """keep_best: when this validation pass has the highest τ so far, export the drafter to OUT/best (+ best.json).

    Collective (the drafter is gathered on every rank); the validation metrics are all-reduced, so every rank takes
    the same branch. Returns OUT/best when written."""
    st = run.state
    if not run.cfg.keep_best or val is None or (st.best_val_tau is not None and val["tau"] <= st.best_val_tau):
        return None
    st.best_val_tau, st.best_val_step = float(val["tau"]), st.step
    drafter = run.gather_state()[0]
    path = None
    if run.dist.is_main:
        path = save_final(run.out, drafter, step=st.step, name="best")
        atomic_write_text(path / "best.json", json.dumps({"step": st.step, "val": val}, indent=1) + "\n")
    run.dist.barrier()
    return path


@torch.no_grad()
def evaluate(run: Run) -> dict[str, Any] | None:
    """Held-out loss, per-slot accuracy and estimated τ (fixed anchors, no noise), reduced over ranks."""
    if run.val_rows is None:
        return None
    cfg, dist = run.cfg, run.dist
    run.module.eval()
    bs = run.drafter.config.block_size
    sums = torch.zeros(2 + 2 * bs, dtype=torch.float64, device=run.device)   # Σwℓ, Σw, correct(bs), valid(bs)
    mine = list(range(dist.rank, len(run.val_rows), dist.world_size))
    for k in range(0, len(mine), cfg.batch_rows):
        ids = mine[k:k + cfg.batch_rows]
        rows = collate_rows([run.val_rows[i] for i in ids], ids)
        inp = prepare_inputs(rows, drafter_config=run.drafter.config, labels=cfg.labels,
                             max_anchors=cfg.max_anchors, seed=cfg.seed, epoch=-1, device=run.device,
                             mask_dtype=run.autocast_dtype or torch.float32)
        out = _loss(run, inp, rows, 1.0)
        sums += torch.cat([torch.stack([out.loss.double(), out.weight_sum.double()]),
                           out.correct_counts.double(), out.valid_counts.double()])
    dist.all_reduce(sums)
    run.module.train()
    acc = (sums[2:2 + bs] / sums[2 + bs:].clamp_min(1)).tolist()
    return {"loss": float(sums[0] / sums[1].clamp_min(1e-12)), "accuracy": acc, "tau": estimated_tau(acc),
            "supervised": int(sums[2 + bs + 1:].sum())}


# ---------------------------------------------------------------------------------------------- loop
def train(cfg: TrainConfig, *, dataset: Any = None, target: Any = None,
          callbacks: Sequence[Callable[[StepEnd], None]] = (),
          loss_hook: Callable[[int, Tensor], Tensor] | None = None) -> TrainResult:
    """Train (or resume, when `cfg.out` holds a checkpoint) a DFlash drafter; returns where it ended.

    dataset: a map-style feature source (`ds[i] -> Sample` with features) instead of cfg.features/tokens.
    target: an already loaded `Target` instead of loading cfg.target.
    callbacks: called with a `StepEnd` after each step (may call `.request_stop()` or raise).
    loss_hook: `(step, loss) -> loss` applied to each micro-batch loss before backward (tests inject NaN here).
    """
    run = setup_run(cfg, dataset=dataset, target=target)
    try:
        with _stop_handlers():
            return _loop(run, callbacks, loss_hook)
    finally:
        run.close()


def _save(run: Run) -> Path:
    """Collective: every rank calls it; rank 0 writes. Returns the checkpoint directory."""
    state = run.gather_state()
    path = run.out / "checkpoints" / checkpoint_name(run.state.step)
    if run.dist.is_main:
        drafter, optim = state
        path = save_checkpoint(run.out, drafter=drafter, optimizer=optim, scheduler=run.scheduler.state_dict(),
                               state=run.state, config=run.cfg.to_dict(), keep=run.cfg.keep_checkpoints)
    run.dist.barrier()
    return path


def _agreed_elapsed(run: Run) -> float:
    """Training seconds so far (step times over all sessions), the largest over ranks so all agree."""
    t = torch.tensor([run.state.elapsed_s], dtype=torch.float64, device=run.device)
    return float(run.dist.all_reduce(t, op="max"))


def _loop(run: Run, callbacks: Sequence[Callable[[StepEnd], None]],
          loss_hook: Callable[[int, Tensor], Tensor] | None) -> TrainResult:
    from tqdm import tqdm

    cfg, dist, st = run.cfg, run.dist, run.state
    bs = run.drafter.config.block_size
    params = [p for p in run.module.parameters() if p.requires_grad]
    schedule_s = 60 * cfg.schedule_minutes if cfg.schedule_minutes else None
    if schedule_s is None:
        bar = tqdm(total=run.total_steps, initial=st.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (dist.is_main and cfg.progress))
    else:  # a time-based schedule: progress in seconds of training time
        bar = tqdm(total=schedule_s, initial=min(st.elapsed_s, schedule_s), desc="train",
                   unit="s", dynamic_ncols=True, disable=not (dist.is_main and cfg.progress),
                   bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}{postfix}]")
    t_session, last_ckpt, last_eval_step = time.monotonic(), None, -1
    record: dict[str, Any] = {}
    val: dict[str, Any] | None = None
    batch_iter, iter_epoch = None, -1
    elapsed = _agreed_elapsed(run) if schedule_s is not None else 0.0   # training seconds before this step
    spent = schedule_s is not None and elapsed >= schedule_s
    while st.step < run.total_steps and not spent:
        t0 = time.monotonic()
        epoch, in_epoch = divmod(st.step, run.steps_per_epoch)
        if iter_epoch != epoch:
            batch_iter, iter_epoch = micro_batches(run, epoch, in_epoch), epoch
        noise = noise_std_at(cfg, st.step, run.total_steps)
        batches = [next(batch_iter) for _ in range(cfg.grad_accum)]
        inputs = [prepare_inputs(rb, drafter_config=run.drafter.config, labels=cfg.labels,
                                 max_anchors=cfg.max_anchors, seed=cfg.seed, epoch=epoch, step=st.step,
                                 noise_std=noise, device=run.device, build_masks=False) for rb in batches]
        # Normaliser: Σ slot weights over the whole global step, so every split yields the same gradient.
        wsum = sum(((x.labels != -100) * run.weights).sum().double() for x in inputs)
        wsum = dist.all_reduce(torch.as_tensor(wsum, dtype=torch.float64, device=run.device).clone())
        sums = torch.zeros(3 + 2 * bs, dtype=torch.float64, device=run.device)  # loss, tokens, slots≥1, corr, valid
        for m, (inp, rows) in enumerate(zip(inputs, batches)):
            sync = run.no_sync() if m < len(inputs) - 1 else contextlib.nullcontext()
            with sync:
                out = _loss(run, inp, rows, wsum.to(torch.float32))
                loss = loss_hook(st.step + 1, out.loss) if loss_hook is not None else out.loss
                (loss * dist.world_size).backward()     # DDP/FSDP average gradients over ranks: undo it
            head = torch.stack([loss.detach().double(), torch.tensor(float(rows.num_tokens), device=sums.device,
                                dtype=torch.float64), out.valid_counts[1:].sum().double()])
            sums += torch.cat([head, out.correct_counts.double(), out.valid_counts.double()])
        dist.all_reduce(sums)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        loss_value = float(sums[0])
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            run.optimizer.zero_grad(set_to_none=True)
            path = _save(run)
            raise TrainingDiverged(
                f"non-finite {'loss' if not math.isfinite(loss_value) else 'gradient norm'} at step {st.step + 1} "
                f"(loss {loss_value}, grad norm {grad_norm}); the last good state (step {st.step}) is saved in "
                f"{path}. Lower lr, raise warmup_ratio, or check the features for inf/NaN.")
        clipped = cfg.grad_clip > 0 and grad_norm > cfg.grad_clip
        if schedule_s is not None:  # time-based warmup + cosine: the same elapsed time on every rank
            mult = cosine_at(elapsed / schedule_s, cfg.warmup_ratio, cfg.min_lr_ratio)
            for group, base in zip(run.optimizer.param_groups, run.scheduler.base_lrs):
                group["lr"] = base * mult
        lr = run.optimizer.param_groups[0]["lr"]
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
        st.step += 1
        st.epoch, st.batch_in_epoch = divmod(st.step, run.steps_per_epoch)
        st.clipped_steps += int(clipped)
        st.tokens_seen += int(sums[1])
        dt = max(time.monotonic() - t0, 1e-9)
        st.elapsed_s += dt
        run.rolling.add(loss_value)
        st.recent_losses = list(run.rolling.values)
        acc = (sums[3:3 + bs] / sums[3 + bs:].clamp_min(1)).tolist()
        record = {"step": st.step, "epoch": epoch, "split": "train", "loss": loss_value, "accuracy": acc,
                  "tau": estimated_tau(acc), "lr": lr, "grad_norm": grad_norm, "clipped": bool(clipped),
                  "clip_fraction": st.clipped_steps / st.step, "tokens": int(sums[1]),
                  "tokens_per_s": float(sums[1]) / dt, "block_positions_per_s": float(sums[2]) / dt,
                  "noise_std": noise, "step_s": dt, **run.rolling.summary("loss")}
        if st.step % cfg.log_every == 0 or st.step == run.total_steps:
            run.logger.log(record)
        bar.set_postfix(**({} if schedule_s is None else {"step": st.step}), loss=f"{loss_value:.3f}",
                        tau=f"{record['tau']:.2f}", lr=f"{lr:.2e}", refresh=False)
        bar.update(1 if schedule_s is None else min(dt, max(0.0, schedule_s - bar.n)))
        if cfg.eval_every and st.step % cfg.eval_every == 0:
            val = evaluate(run)
            last_eval_step = st.step
            if val is not None:
                run.logger.log({"step": st.step, "epoch": epoch, "split": "val", **val})
                keep_if_best(run, val)
        if cfg.save_every and st.step % cfg.save_every == 0:
            last_ckpt = _save(run)
        for cb in callbacks:
            cb(StepEnd(step=st.step, metrics=record, run=run))
        if schedule_s is not None:
            elapsed = _agreed_elapsed(run)
            if elapsed >= schedule_s:
                spent = True
                break
        budget = cfg.time_budget_minutes
        if budget is not None and time.monotonic() - t_session > budget * 60:
            run.stop_reason = run.stop_reason or "time_budget"
        if _STOP["reason"] is not None:
            run.stop_reason = run.stop_reason or _STOP["reason"]
        codes = {None: 0, "requested": 1, "time_budget": 2, "interrupted": 3}
        flag = dist.all_reduce(torch.tensor([codes.get(run.stop_reason, 1)], device=run.device), op="max")
        if int(flag) and st.step < run.total_steps:
            run.stop_reason = {v: k for k, v in codes.items()}[int(flag)]
            break
    bar.close()
    stopped = run.stop_reason if st.step < run.total_steps and not spent else "completed"   # agreed by all ranks
    if run.val_rows is not None and last_eval_step != st.step and stopped != "interrupted":
        val = evaluate(run)
        if val is not None:
            run.logger.log({"step": st.step, "epoch": max(0, st.step - 1) // run.steps_per_epoch, "split": "val",
                            **val})
            keep_if_best(run, val)
    last_ckpt = _save(run)
    final = None
    if stopped != "interrupted":
        drafter = run.gather_state()[0]
        if dist.is_main:
            final = save_final(run.out, drafter, step=st.step)
        dist.barrier()
    if dist.is_main and stopped == "interrupted":
        print(f"[dflashkit train] stopped at step {st.step}; checkpoint {last_ckpt}. Run the same command again "
              f"to resume.", flush=True)
    best = run.out / "best" if st.best_val_tau is not None else None
    return TrainResult(out_dir=run.out, step=st.step, stopped=stopped, checkpoint=last_ckpt, final_dir=final,
                       best_dir=best, best_val_tau=st.best_val_tau, best_val_step=st.best_val_step,
                       train_metrics=record, val_metrics=val, elapsed_s=time.monotonic() - t_session)


__all__ = ["StepEnd", "StepInputs", "TrainResult", "TrainingDiverged", "block_labels", "draft_vocab_head",
           "draft_vocab_topk", "evaluate", "fc_noise", "keep_if_best", "handle_stop_signal", "kl_target_logits", "noise_std_at",
           "prepare_inputs", "row_anchors", "topk_targets", "train"]
