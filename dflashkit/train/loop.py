"""DFlash drafter training: setup → loop → save, resumable, single process or under torchrun (DDP / FSDP2).

    from dflashkit.train.config import TrainConfig
    from dflashkit.train.loop import train
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
(a slot left with none trains on its hard label). The alignment lives in `dflashkit.train.slot_targets`.
Noise (noise_std > 0) is added to the context features going into fc, never to labels or target logits.

Everything random is seeded per (seed, epoch, row) rather than drawn from a global stream, so a resumed run
reproduces an uninterrupted one exactly and a step is the same for any number of ranks. Checkpoints, the
`latest` pointer and `final/` are described in `state.py`; the step's inputs and loss in `step.py`; validation
and keep_best in `validation.py`; metrics in `metrics.py`.
"""

from __future__ import annotations

import contextlib
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

from dflashkit.errors import ConfigError, DFlashError
from dflashkit.output_dir import one_writer
from dflashkit.train.config import TrainConfig
from dflashkit.train.distributed import read_env
from dflashkit.train.losses import estimated_tau
from dflashkit.train.run import Run, metric_slots, setup_run
from dflashkit.train.schedule import cosine_at
from dflashkit.train.state import checkpoint_name, latest_checkpoint, save_checkpoint, save_final
from dflashkit.train.step import StepDraw, micro_batches, noise_std_at, prepare_inputs, step_loss
from dflashkit.train.validation import keep_if_best, validate


class TrainingDiverged(DFlashError):
    """The loss or the gradient norm became NaN/inf; the last good state was saved."""


@dataclass
class TrainResult:
    out_dir: Path
    step: int
    stopped: str  # completed | time_budget | interrupted | requested
    checkpoint: Path | None  # the last step checkpoint written
    final_dir: Path | None  # out/final (None when interrupted)
    best_dir: Path | None = None  # out/best (keep_best: the drafter of the best validation pass)
    best_val_tau: float | None = None
    best_val_step: int = 0
    train_metrics: dict[str, Any] = field(default_factory=dict)  # last step's record
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
    print(
        f"\n[dflashkit train] {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
        f"(send it again to abort without saving)",
        flush=True,
    )


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


def train(
    cfg: TrainConfig,
    *,
    dataset: Any = None,
    target: Any = None,
    callbacks: Sequence[Callable[[StepEnd], None]] = (),
    loss_hook: Callable[[int, Tensor], Tensor] | None = None,
) -> TrainResult:
    """Train (or resume, when `cfg.out` holds a checkpoint) a DFlash drafter; returns where it ended.

    dataset: a map-style feature source (`ds[i] -> Sample` with features) instead of cfg.features/tokens.
    target: an already loaded `Target` instead of loading cfg.target.
    callbacks: called with a `StepEnd` after each step (may call `.request_stop()` or raise).
    loss_hook: `(step, loss) -> loss` applied to each micro-batch loss before backward (tests inject NaN here).
    """
    cfg.validate()  # every value checked before the output directory is touched
    if dataset is None:
        cfg.check_inputs()
    if dataset is None and target is None:
        _check_memory(cfg)
    with one_writer(cfg.out, "dflashkit train", enabled=read_env()[1] == 0):  # rank 0 writes, so rank 0 holds it
        run = setup_run(cfg, dataset=dataset, target=target)
        try:
            with _stop_handlers():
                return _loop(run, callbacks, loss_hook)
        finally:
            run.close()


def _check_memory(cfg: TrainConfig) -> None:
    """Refuse, before anything loads, a run whose step will not fit its device (`train.memory_check`)."""
    from dflashkit.train.memory_check import fit_problem

    problem = fit_problem(cfg)
    if problem:
        raise ConfigError(f"train: {problem}")


def _save(run: Run) -> Path:
    """Collective: every rank calls it; rank 0 writes. Returns the checkpoint directory."""
    state = run.gather_state()
    path = run.out / "checkpoints" / checkpoint_name(run.state.step)
    if run.dist.is_main:
        drafter, optim = state
        path = save_checkpoint(
            run.out,
            drafter=drafter,
            optimizer=optim,
            scheduler=run.scheduler.state_dict(),
            state=run.state,
            config=run.cfg.to_dict(),
            keep=run.cfg.keep_checkpoints,
        )
    run.dist.barrier()
    return path


def _agreed_elapsed(run: Run) -> float:
    """Training seconds so far (step times over the first run and every resume), the largest over ranks so all agree."""
    t = torch.tensor([run.state.elapsed_s], dtype=torch.float64, device=run.device)
    return float(run.dist.all_reduce(t, op="max"))


_STOP_CODES = {None: 0, "requested": 1, "time_budget": 2, "interrupted": 3}


def _progress_bar(run: Run, schedule_s: float | None) -> Any:
    """tqdm over steps, or over seconds of training time for a time-based schedule."""
    from tqdm import tqdm

    shown = run.dist.is_main and run.cfg.progress
    if schedule_s is None:
        return tqdm(
            total=run.total_steps,
            initial=run.state.step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=not shown,
        )
    return tqdm(
        total=schedule_s,
        initial=min(run.state.elapsed_s, schedule_s),
        desc="train",
        unit="s",
        dynamic_ncols=True,
        disable=not shown,
        bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}{postfix}]",
    )


def _train_step(
    run: Run,
    batches: list[Any],
    epoch: int,
    elapsed: float,
    schedule_s: float | None,
    loss_hook: Callable[[int, Tensor], Tensor] | None,
    fetch_s: float = 0.0,
) -> dict[str, Any]:
    """One optimizer step over the `grad_accum` micro-batches `batches` (drawn in `fetch_s` seconds, counted in the
    step's time) on every rank; returns its metrics record."""
    cfg, dist, st = run.cfg, run.dist, run.state
    bs = metric_slots(run.drafter.config)
    t0 = time.monotonic() - fetch_s
    noise = noise_std_at(cfg, st.step, run.total_steps)
    inputs = [
        prepare_inputs(
            rb,
            run.drafter.config,
            StepDraw.from_config(
                cfg,
                epoch,
                step=st.step,
                progress=None if schedule_s is None else elapsed / schedule_s,
                noise_std=noise,
            ),
            device=run.device,
            build_masks=False,
        )
        for rb in batches
    ]
    # Normaliser: Σ slot weights over the whole global step, so every split yields the same gradient.
    wsum = sum(((x.labels != -100) * run.weights).sum().double() for x in inputs)
    wsum = dist.all_reduce(torch.as_tensor(wsum, dtype=torch.float64, device=run.device).clone())
    sums = torch.zeros(3 + 2 * bs, dtype=torch.float64, device=run.device)  # loss, tokens, slots≥1, corr, valid
    for m, (inp, rows) in enumerate(zip(inputs, batches, strict=True)):
        sync = run.no_sync() if m < len(inputs) - 1 else contextlib.nullcontext()
        with sync:
            out = step_loss(run, inp, rows, wsum.to(torch.float32))
            loss = loss_hook(st.step + 1, out.loss) if loss_hook is not None else out.loss
            (loss * dist.world_size).backward()  # DDP/FSDP average gradients over ranks: undo it
        head = torch.stack(
            [
                loss.detach().double(),
                torch.tensor(float(rows.num_tokens), device=sums.device, dtype=torch.float64),
                out.valid_counts[1:].sum().double(),
            ]
        )
        sums += torch.cat([head, out.correct_counts.double(), out.valid_counts.double()])
    dist.all_reduce(sums)
    params = [p for p in run.module.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    loss_value = float(sums[0])
    if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
        run.optimizer.zero_grad(set_to_none=True)
        path = _save(run)
        raise TrainingDiverged(
            f"non-finite {'loss' if not math.isfinite(loss_value) else 'gradient norm'} at step {st.step + 1} "
            f"(loss {loss_value}, grad norm {grad_norm}); the last good state (step {st.step}) is saved in "
            f"{path}. Lower lr, raise warmup_ratio, or check the features for inf/NaN."
        )
    clipped = cfg.grad_clip > 0 and grad_norm > cfg.grad_clip
    if schedule_s is not None:  # time-based warmup + cosine: the same elapsed time on every rank
        mult = cosine_at(elapsed / schedule_s, cfg.warmup_ratio, cfg.min_lr_ratio)
        for group, base in zip(run.optimizer.param_groups, run.scheduler.base_lrs, strict=True):
            group["lr"] = base * mult
    lr = run.optimizer.param_groups[0]["lr"]
    run.optimizer.step()
    _check_finite_weights(run, params, loss_value, grad_norm)
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
    acc = (sums[3 : 3 + bs] / sums[3 + bs :].clamp_min(1)).tolist()
    return {
        "step": st.step,
        "epoch": epoch,
        "split": "train",
        "loss": loss_value,
        "accuracy": acc,
        "tau": estimated_tau(acc),
        "lr": lr,
        "grad_norm": grad_norm,
        "clipped": bool(clipped),
        "clip_fraction": st.clipped_steps / st.step,
        "tokens": int(sums[1]),
        "tokens_per_s": float(sums[1]) / dt,
        "block_positions_per_s": float(sums[2]) / dt,
        "noise_std": noise,
        "step_s": dt,
        **run.rolling.summary("loss"),
    }


def _compile_aware_step(
    run: Run,
    batch_iter: Iterator[Any],
    epoch: int,
    elapsed: float,
    schedule_s: float | None,
    loss_hook: Callable[[int, Tensor], Tensor] | None,
) -> dict[str, Any]:
    """One step (`_train_step`) as the compile choice says, and the choice's trial advanced by its time (agreed over
    ranks). The micro-batches are drawn first, so a compiled step that raises (no C++ compiler for inductor, an op it
    cannot trace) runs again eagerly on the same ones (`CompileTrial.run_step`; a multi-rank run stops instead)."""
    t0 = time.monotonic()
    batches = [next(batch_iter) for _ in range(run.cfg.grad_accum)]
    fetch_s = time.monotonic() - t0
    trial = run.compile_trial
    if trial is None:
        return _train_step(run, batches, epoch, elapsed, schedule_s, loss_hook, fetch_s)

    def agree(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64, device=run.device)
        return float(run.dist.all_reduce(t, op="max"))

    fetched = [fetch_s]  # counted in the first attempt's time; an eager rerun after a failed compile has its own

    def attempt(_compiled: bool) -> dict[str, Any]:  # Run.step_module picks the compiled module or not
        return _train_step(run, batches, epoch, elapsed, schedule_s, loss_hook, fetched.pop() if fetched else 0.0)

    return trial.run_step(
        attempt,
        agree=agree,
        say=lambda msg: _say(run, f"torch.compile: {msg}"),
        keep=(DFlashError,),
        before_retry=lambda: run.optimizer.zero_grad(set_to_none=True),
        retry=not run.dist.distributed,
    )


def _say(run: Run, message: str) -> None:
    if run.dist.is_main:
        from tqdm import tqdm

        tqdm.write(f"[dflashkit train] {message}")


def _check_finite_weights(run: Run, params: list[Tensor], loss: float, grad_norm: float) -> None:
    """A finite loss and gradient can still step the weights to inf/NaN (a huge lr, an Adam state gone bad): stop
    then, on every rank, before anything of this step is saved — the last checkpoint on disk stays the last finite
    one, and no drafter of NaN tensors is ever exported."""
    bad = torch.zeros(1, device=run.device)
    with torch.no_grad():
        for p in params:
            local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2 shards: this rank's part
            if not torch.isfinite(local).all():
                bad.fill_(1)
                break
    if not float(run.dist.all_reduce(bad, op="max")):
        return
    st = run.state
    kept = latest_checkpoint(run.out) if run.dist.is_main else None
    raise TrainingDiverged(
        f"the drafter's weights became non-finite (inf/NaN) in the update of step {st.step + 1} (loss {loss:.4g}, "
        f"grad norm {grad_norm:.4g}, lr {run.optimizer.param_groups[0]['lr']:.3g}); nothing of that step is saved"
        + (f"; the last finite checkpoint is {kept}" if kept else "; no checkpoint was written before it")
        + ". Lower lr or raise warmup_ratio."
    )


def _due(steps: int, minutes: float | None, step: int, since_s: float) -> bool:
    """Whether a validation pass or checkpoint is due after `step`: every `steps` steps, or `minutes` of training
    time (agreed over ranks) since the last one."""
    return bool(steps and step % steps == 0) or (minutes is not None and since_s >= 60 * minutes)


def _stop_agreed(run: Run, t_session: float) -> bool:
    """Whether every rank stops after this step (time budget, a signal, a callback's request): the largest stop
    code over ranks wins, so all ranks leave the loop at the same step with the same reason."""
    budget = run.cfg.time_budget_minutes
    if budget is not None and time.monotonic() - t_session > budget * 60:
        run.stop_reason = run.stop_reason or "time_budget"
    if _STOP["reason"] is not None:
        run.stop_reason = run.stop_reason or _STOP["reason"]
    code = _STOP_CODES.get(run.stop_reason, 1)
    flag = int(run.dist.all_reduce(torch.tensor([code], device=run.device), op="max"))
    if flag and run.state.step < run.total_steps:
        run.stop_reason = {v: k for k, v in _STOP_CODES.items()}[flag]
        return True
    return False


def _loop(
    run: Run, callbacks: Sequence[Callable[[StepEnd], None]], loss_hook: Callable[[int, Tensor], Tensor] | None
) -> TrainResult:
    cfg, st = run.cfg, run.state
    schedule_s = 60 * cfg.schedule_minutes if cfg.schedule_minutes else None
    bar = _progress_bar(run, schedule_s)
    t_session, last_eval_step = time.monotonic(), -1
    record: dict[str, Any] = {}
    val: dict[str, Any] | None = None
    batch_iter, iter_epoch = None, -1
    # training seconds before this step (agreed by all ranks): the schedule's clock, and minute cadences' ones
    timed = schedule_s is not None or bool(cfg.save_every_minutes or cfg.eval_every_minutes)
    elapsed = _agreed_elapsed(run) if timed else 0.0
    marks = {"eval": elapsed, "save": elapsed}  # training seconds at the last validation and checkpoint
    spent = schedule_s is not None and elapsed >= schedule_s
    while st.step < run.total_steps and not spent:
        epoch, in_epoch = divmod(st.step, run.steps_per_epoch)
        if iter_epoch != epoch:
            batch_iter, iter_epoch = micro_batches(run, epoch, in_epoch), epoch
        record = _compile_aware_step(run, batch_iter, epoch, elapsed, schedule_s, loss_hook)
        if st.step % cfg.log_every == 0 or st.step == run.total_steps:
            run.logger.log(record)
        bar.set_postfix(
            **({} if schedule_s is None else {"step": st.step}),
            loss=f"{record['loss']:.3f}",
            tau=f"{record['tau']:.2f}",
            lr=f"{record['lr']:.2e}",
            refresh=False,
        )
        bar.update(1 if schedule_s is None else min(record["step_s"], max(0.0, schedule_s - bar.n)))
        if timed:
            elapsed = _agreed_elapsed(run)
        if _due(cfg.eval_every, cfg.eval_every_minutes, st.step, elapsed - marks["eval"]):
            val, last_eval_step, marks["eval"] = _validate_and_keep(run, epoch), st.step, elapsed
        if _due(cfg.save_every, cfg.save_every_minutes, st.step, elapsed - marks["save"]):
            _save(run)
            marks["save"] = elapsed
        for cb in callbacks:
            cb(StepEnd(step=st.step, metrics=record, run=run))
        if schedule_s is not None:
            spent = elapsed >= schedule_s
            if spent:
                break
        if _stop_agreed(run, t_session):
            break
    bar.close()
    stopped = run.stop_reason if st.step < run.total_steps and not spent else "completed"  # agreed by all ranks
    if run.val_rows is not None and last_eval_step != st.step and stopped != "interrupted":
        val = _validate_and_keep(run, max(0, st.step - 1) // run.steps_per_epoch)
    return _finish(run, stopped, record, val, t_session)


def _validate_and_keep(run: Run, epoch: int) -> dict[str, Any] | None:
    """A validation pass, logged, and keep_best's export when it is the best so far."""
    val = validate(run)
    if val is not None:
        run.logger.log({"step": run.state.step, "epoch": epoch, "split": "val", **val})
        keep_if_best(run, val)
    return val


def _finish(
    run: Run, stopped: str, record: dict[str, Any], val: dict[str, Any] | None, t_session: float
) -> TrainResult:
    """The last checkpoint, OUT/final (unless interrupted), and what the run returns."""
    st, dist = run.state, run.dist
    last_ckpt = _save(run)
    final = None
    if stopped != "interrupted":
        drafter = run.gather_state()[0]
        if dist.is_main:
            final = save_final(run.out, drafter, step=st.step)
        dist.barrier()
    if dist.is_main and stopped == "interrupted":
        print(
            f"[dflashkit train] stopped at step {st.step}; checkpoint {last_ckpt}. Run the same command again "
            f"to resume.",
            flush=True,
        )
    best = run.out / "best" if st.best_val_tau is not None else None
    return TrainResult(
        out_dir=run.out,
        step=st.step,
        stopped=stopped,
        checkpoint=last_ckpt,
        final_dir=final,
        best_dir=best,
        best_val_tau=st.best_val_tau,
        best_val_step=st.best_val_step,
        train_metrics=record,
        val_metrics=val,
        elapsed_s=time.monotonic() - t_session,
    )


__all__ = ["StepEnd", "TrainResult", "TrainingDiverged", "handle_stop_signal", "train"]
