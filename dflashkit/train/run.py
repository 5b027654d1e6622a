"""The live training run: `setup_run(cfg)` builds everything a training loop holds and returns it as a `Run`.

    run = setup_run(TrainConfig.load("configs/smollm2.yaml"))   # resumes from run.out/latest when it exists

What it builds, in order: the process group (torchrun or one process), the target (frozen embeddings + LM head,
or the whole target for online features / KL), the drafter (fresh, `init_from`, or resumed after checking that
the config still matches), the feature source and its packed rows (train / validation split), the DDP / FSDP2
wrapper, AdamW with the cosine schedule (`schedule.py`), the measured precision and compile choices
(`precision_choice.py`, `compile_choice.py`; `Run.step_module` is what a step's forward runs), the metrics logger.
Files of a run directory are described in `state.py`; the loop that drives a `Run` is `loop.py`.
"""

from __future__ import annotations

import contextlib
import gc
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dflashkit.cpu_products.compile_choice import EAGER, CompileTrial
from dflashkit.drafter.capture_needs import capture_layer_ids, capture_target_lse
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads import HEADS, head_of
from dflashkit.drafter.heads.dspark_loss import dspark_slot_weights
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.drafter.tiled_attention import compile_ready
from dflashkit.errors import ConfigError, DataError
from dflashkit.io_utils import remove_stale_temps
from dflashkit.target.devices import resolve_device
from dflashkit.train.distributed import DistContext, drop_reducer, read_env
from dflashkit.train.losses import DISTRIBUTION_KINDS, decay_weights, draft_slot_weights
from dflashkit.train.metrics import MetricsLogger, RollingStats
from dflashkit.train.optimizer_choice import choose_adamw_impl, make_adamw
from dflashkit.train.packing import (
    PackedRows,
    plan_rows,
    sample_lengths,
    split_indices,
    steps_per_epoch,
    supervision_problem,
)
from dflashkit.train.schedule import cosine_with_warmup
from dflashkit.train.state import TrainState, latest_checkpoint, load_checkpoint_state, load_saved_config, restore_rng
from dflashkit.train.target_lse import RowLogSumExp
from dflashkit.validation import field_types


class DrafterStep(nn.Module):
    """What DDP / FSDP / torch.compile wrap: block embeddings (target table, frozen) + the drafter forward."""

    def __init__(self, drafter: DFlashDrafter, embed_weight: torch.Tensor) -> None:
        super().__init__()
        self.drafter = drafter
        self.embed_weight = [embed_weight]  # a list: neither a parameter nor a buffer (never synced/saved)

    def forward(
        self,
        features: torch.Tensor,
        first_tokens: torch.Tensor,
        context_positions: torch.Tensor,
        block_positions: torch.Tensor,
        masks: dict[str, Any],
    ) -> torch.Tensor:
        bs = self.drafter.config.block_size
        embeds = self.drafter.block_embeddings(first_tokens, self.embed_weight[0], bs)  # (B, Nb·bs, H)
        return self.drafter(
            features,
            embeds,
            context_positions=context_positions,
            block_positions=block_positions,
            attention_mask=masks,
            block_len=bs,
        )  # (B, Nb·bs, H)


def open_feature_source(cfg: Any, target: Any, drafter_config: DrafterConfig) -> Any:
    """The configured feature source: captured features (`features`) or online ones (`tokens`, online: true).
    With loss: topk, captured features must hold the top-k log-probs (a DataError naming the directory and the
    fix otherwise) and online ones compute them (`topk`, default DEFAULT_ONLINE_TOPK entries)."""
    from dflashkit.data.samples import read_tokens
    from dflashkit.features.captured import CapturedFeatures
    from dflashkit.features.online import OnlineFeatures
    from dflashkit.train.config import DEFAULT_ONLINE_TOPK

    ids = capture_layer_ids(drafter_config)  # its own layers (+ the final one where its head's loss reads it)
    if cfg.features is None and cfg.tokens is None:
        raise ConfigError(
            "no training data: set features (a `dflashkit capture` directory) or tokens "
            "(tokens.jsonl from `dflashkit prepare`) with online: true"
        )
    if cfg.features is not None:
        return CapturedFeatures(
            cfg.features,
            expect_target=target,
            expect_layer_ids=ids,
            require_topk=(cfg.topk or 1) if cfg.loss == "topk" else 0,
        )
    samples, _ = read_tokens(cfg.tokens)
    topk = (cfg.topk or DEFAULT_ONLINE_TOPK) if cfg.loss == "topk" else 0
    # DSpark with a reduced draft vocabulary reads the log-sum-exp of the target's logits (formed here anyway)
    lse = capture_target_lse(drafter_config, target)
    return OnlineFeatures(target, samples, layer_ids=ids, store_topk=min(topk, target.vocab_size), store_target_lse=lse)


# Drafter fields a resumed checkpoint must match even when the config does not name them: those that follow the
# target (a checkpoint of another target's drafter). Fields the config leaves to dflashkit's defaults do not count:
# a default that changed between versions must not stop a run from resuming its own checkpoint.
_FOLLOW_THE_TARGET = ("hidden_size", "vocab_size", "num_target_layers", "target_layer_ids", "mask_token_id")


def _check_same_drafter(saved: DrafterConfig, wanted: DrafterConfig, where: str, asked: set[str]) -> None:
    """The checkpoint's drafter has every field the config asks for (`asked`: its `drafter:` keys) and the
    target's coupling."""
    old, new = saved.to_dict(), wanted.to_dict()  # flat: a head's fields by the names `asked` uses
    for name in field_types(DrafterConfig):  # as the doors check them: a head's fields first
        if name == "extra" or (name not in asked and name not in _FOLLOW_THE_TARGET):
            continue
        a, b = old[name], new[name]
        if a != b:
            raise ConfigError(
                f"cannot resume {where}: the checkpoint's drafter has {name} = {a!r} but this "
                f"config builds {b!r}; use a new `out` directory"
            )


@dataclass
class Run:
    """Everything the training loop holds. `drafter` is the plain module; `module` is what runs (wrapped)."""

    cfg: Any
    dist: DistContext
    device: torch.device
    out: Path
    target: Any
    embed: torch.Tensor  # (V, H) frozen, on device
    lm_head: torch.Tensor  # (V, H) frozen, on device
    drafter: DFlashDrafter
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    rows: PackedRows
    val_rows: PackedRows | None
    steps_per_epoch: int
    total_steps: int
    state: TrainState
    logger: MetricsLogger
    rolling: RollingStats
    weights: torch.Tensor  # (bs,) slot weights
    autocast_dtype: torch.dtype | None
    compile_trial: CompileTrial | None = None  # whether a step runs compiled (train.compile_choice); None: eager
    info: dict[str, Any] = field(default_factory=dict)
    stop_reason: str | None = None
    target_lse: RowLogSumExp = field(default_factory=RowLogSumExp)  # DSpark: the target's log-sum-exp per row
    _compiled: nn.Module | None = field(default=None, repr=False)

    def autocast(self) -> Any:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    @property
    def step_module(self) -> nn.Module:
        """What a training step's forward runs: `module`, or its compiled form where the compile choice says so
        (compiled once, at the first step that runs it)."""
        if self.compile_trial is None or self.compile_trial.current == EAGER:
            return self.module
        if self._compiled is None:
            compile_ready()  # tiled attention runs eagerly inside the compiled graph
            self._compiled = torch.compile(self.module, dynamic=True)
        return self._compiled

    @property
    def fsdp(self) -> bool:
        return bool(self.cfg.fsdp)

    @contextlib.contextmanager
    def no_sync(self) -> Any:
        """Skip the gradient all-reduce / reduce-scatter on accumulation micro-batches (DDP, FSDP2)."""
        if isinstance(self.module, DDP):
            with self.module.no_sync():
                yield
        elif self.fsdp:
            self.module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.module.set_requires_gradient_sync(True)
        else:
            yield

    def gather_state(self) -> tuple[DFlashDrafter, dict[str, Any]]:
        """(drafter to save, optimizer state dict). Collective under FSDP: every rank must call it; the full
        tensors land on rank 0 (other ranks get an unusable drafter and an empty dict)."""
        if not self.fsdp:
            return self.drafter, self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(self.module, options=opts)  # keys "drafter.…"
        optim = get_optimizer_state_dict(self.module, self.optimizer, options=opts)
        drafter = DFlashDrafter(self.drafter.config) if self.dist.is_main else self.drafter
        if self.dist.is_main:
            drafter.load_state_dict({k.removeprefix("drafter."): v for k, v in full.items()}, strict=True)
        return drafter, optim

    def close(self) -> None:
        """Close the logger and end the process group — in an order that cannot deadlock.

        DDP's C++ Reducer holds a reference to the gloo process group. Destroyed after
        `destroy_process_group()`, the Reducer is the group's last owner: its destructor (run with the GIL held)
        joins a gloo worker thread that needs the GIL to free its last work item — a hang at exit. So the
        wrapper goes first, while the group is alive, and only then the group.
        """
        self.logger.close()
        wrapper = weakref.ref(self.module)
        self.module, self._compiled = self.drafter, None
        gc.collect()  # DDP/FSDP wrappers sit in reference cycles
        alive = wrapper()
        if alive is not None:  # someone still holds the wrapper: free its Reducer at least
            drop_reducer(alive)
            del alive
            gc.collect()
        self.dist.close()


def _record_data_info(cfg: Any, source: Any, drafter_config: DrafterConfig) -> None:
    """Carry how the training tokens were prepared (thinking mode, turns, template kwargs) into the drafter's
    config, so eval, simulate and doctor can refuse or flag another mode (`dflashkit.data.thinking`)."""
    from dflashkit.data.thinking import data_info

    manifest = getattr(source, "manifest", None)
    info = dict(manifest.data) if manifest is not None else data_info(cfg.tokens)
    if info:
        drafter_config.extra["data"] = info
        if info.get("chat_template_kwargs"):
            drafter_config.extra["chat_template_kwargs"] = info["chat_template_kwargs"]


def setup_run(cfg: Any, *, dataset: Any = None, target: Any = None) -> Run:
    """Build a `Run` from a TrainConfig (resuming from `cfg.out/latest` when it exists)."""
    from dflashkit.target.model import Target

    cfg.validate()
    device = resolve_device(cfg.drafter_device, read_env()[2])
    dist = DistContext.from_env(use_cuda=device.type == "cuda")
    if cfg.fsdp and not dist.distributed:
        raise ConfigError(
            "fsdp: true shards the drafter over ranks; launch with torchrun (≥ 2 processes) or set fsdp: false"
        )
    out = Path(cfg.out)
    if dist.is_main:  # temp checkpoint dirs of killed runs or failed (disk-full) saves
        for d in (out / "checkpoints", out):
            remove_stale_temps(d, log=lambda msg: print(f"[dflashkit train] {msg}", flush=True))
    if target is None:
        tdev = device if cfg.target_device == "auto" else torch.device(cfg.target_device)
        target = Target.load(cfg.target, device=tdev, trust_remote_code=cfg.trust_remote_code)
    drafter, blob, ckpt = _drafter_to_train(cfg, target, out, dist)
    check_kind_fits(cfg, drafter.config)
    drafter = drafter.to(device=device, dtype=torch.float32).train()
    source = dataset if dataset is not None else open_feature_source(cfg, target, drafter.config)
    _record_data_info(cfg, source, drafter.config)
    data = _plan_data(cfg, source, dist.world_size)
    # the longest context a training block reads (blocks never see another document): doctor, eval and simulate
    # warn beyond it (drafter.context_reach)
    drafter.config.extra["train_context"] = int(data.info["longest_context"])
    keep_target = cfg.online or cfg.loss in DISTRIBUTION_KINDS or head_of(drafter.config).training_needs_target
    embed, lm_head = _frozen_tables(target, device, own=not keep_target)
    core, module = _wrap(cfg, drafter, embed, dist, device)
    optimizer, scheduler, state = _optimizer(cfg, drafter, core, data.total, blob, dist.world_size, dist.all_reduce)
    logger = MetricsLogger(
        out, enabled=dist.is_main, tensorboard=cfg.tensorboard, resume_step=state.step if blob is not None else None
    )
    state.precision = _precision(cfg, drafter.config, device, state, fresh=blob is None, dist=dist)
    use_bf16 = state.precision == "bf16"
    trial = _compile_trial(cfg, drafter.config, device, state, data, dist)
    info = {
        **data.info,
        "resumed_from": str(ckpt) if ckpt is not None else None,
        "parameters": drafter.num_parameters(),
        "world_size": dist.world_size,
        "device": str(device),
    }
    if dist.is_main:
        _announce(cfg, info, data, state, ckpt)
    if not keep_target:  # its modules sit in reference cycles: free its weights now, not at some later collection
        target = None
        gc.collect()
    return Run(
        cfg=cfg,
        dist=dist,
        device=device,
        out=out,
        target=target,
        embed=embed,
        lm_head=lm_head,
        drafter=drafter,
        module=module,
        optimizer=optimizer,
        scheduler=scheduler,
        rows=data.rows,
        val_rows=data.val_rows,
        steps_per_epoch=data.steps_per_epoch,
        total_steps=data.total,
        state=state,
        logger=logger,
        rolling=RollingStats(cfg.rolling_window, state.recent_losses),
        weights=slot_weights(cfg, drafter.config).to(device),
        autocast_dtype=torch.bfloat16 if use_bf16 else None,
        compile_trial=trial,
        info=info,
    )


def _frozen_tables(target: Any, device: torch.device, *, own: bool) -> tuple[Tensor, Tensor]:
    """(embedding table, LM head) of the target on `device`, the same tensor when tied. `own`: in memory of their
    own — a weight read from a safetensors file shares the file's buffer with every other weight, and would keep
    the whole target in memory after it is dropped (offline training needs only these two tables)."""

    def moved(w: Tensor) -> Tensor:
        out = w.detach().to(device)
        return out.clone() if own and out.data_ptr() == w.data_ptr() else out

    embed = moved(target.embed_weight)
    return embed, embed if target.lm_head_weight is target.embed_weight else moved(target.lm_head_weight)


def slot_weights(cfg: Any, drafter_config: DrafterConfig) -> torch.Tensor:
    """(bs,) the base slot weights of the loss (and of its normaliser): DSpark's exp(−k/γ) (γ 4), D-PACE's
    draft-slot marks (DSpark: every slot; its L1 and confidence terms keep exp(−k/4)), or DFlash's exp(−(k−1)/γ)."""
    bs, every_slot = drafter_config.block_size, head_of(drafter_config).first_draft_slot == 0
    if cfg.position_weights == "dpace":
        return torch.ones(bs) if every_slot else draft_slot_weights(bs)
    return dspark_slot_weights(bs, cfg.gamma) if every_slot else decay_weights(bs, cfg.gamma)


def metric_slots(drafter_config: DrafterConfig) -> int:
    """Entries of the per-slot metric vectors: the block size, + 1 for DSpark (entry 0: the given token)."""
    return head_of(drafter_config).metric_slots(drafter_config.block_size)


def check_kind_fits(cfg: Any, drafter_config: DrafterConfig) -> None:
    """Refuse training settings the drafter's head cannot take, naming the field and why: an option of another
    head's objective set to anything but its default (it would be ignored; a saved config repeating the default is
    fine), and whatever the head's own checks refuse (`Head.train_checks`: an objective of all-zero weights, …)."""
    own, defaults = head_of(drafter_config), type(cfg)()
    for head in HEADS.values():
        for name in head.train_fields if head is not own else ():
            given, default = head.train_options(cfg), head.train_options(defaults)
            if name in cfg.sources and getattr(given, name) != getattr(default, name):
                raise ConfigError(
                    f"{cfg.sources[name]}: {name} belongs to the objective of kind={head.kind} drafters; this drafter "
                    f"is kind={own.kind} (set drafter.kind={head.kind}, or drop {name})"
                )
    own.train_checks(cfg, drafter_config)


def _drafter_to_train(
    cfg: Any, target: Any, out: Path, dist: DistContext
) -> tuple[DFlashDrafter, dict[str, Any] | None, Path | None]:
    """(drafter, saved training state or None, checkpoint it came from or None): resumed from `out/latest` after
    checking that the config still matches, else `init_from`, else freshly initialised with `cfg.seed`."""
    from dflashkit.drafter.checkpoint import load_drafter, with_head
    from dflashkit.drafter.defaults import default_drafter_config
    from dflashkit.target.model import check_drafter_fits
    from dflashkit.train.config import check_resume_compatible

    wanted = default_drafter_config(target, **cfg.drafter)
    ckpt = latest_checkpoint(out)
    blob = None
    if ckpt is not None:
        check_resume_compatible(load_saved_config(ckpt), cfg, where=f"from {ckpt}")
        blob = load_checkpoint_state(ckpt)
        if blob["state"]["world_size"] != dist.world_size:
            raise ConfigError(
                f"cannot resume from {ckpt}: world_size was {blob['state']['world_size']} but is "
                f"{dist.world_size} now (the global batch would change)"
            )
        drafter = load_drafter(ckpt)
        if cfg.init_from is None:
            _check_same_drafter(drafter.config, wanted, f"from {ckpt}", set(cfg.drafter))
    elif cfg.init_from is not None:
        drafter = load_drafter(cfg.init_from)
        kind = cfg.drafter.get("kind", drafter.config.kind)
        if kind != drafter.config.kind:  # warm start of another head on the checkpoint's backbone
            fields = {f: cfg.drafter[f] for f in head_of(kind).fields if f in cfg.drafter}
            drafter = with_head(drafter, drafter.config.replace(kind=kind, **fields), cfg.seed)
    else:
        if wanted.draft_vocab_size is not None:
            raise ConfigError(
                f"drafter.draft_vocab_size = {wanted.draft_vocab_size}: a draft vocabulary is built from data — "
                f"make the drafter with `dflashkit init-drafter OUT draft_vocab_size={wanted.draft_vocab_size} "
                f"--draft-vocab-from TOKENS` and train it with init_from=OUT"
            )
        torch.manual_seed(cfg.seed)
        drafter = DFlashDrafter(wanted)
    check_drafter_fits(drafter.config, target, source="drafter")
    if cfg.loss in DISTRIBUTION_KINDS and drafter.config.draft_vocab_size is not None:
        raise ConfigError(
            f"loss: {cfg.loss} compares with the target's whole distribution and needs the full vocabulary; this "
            f"drafter has a reduced draft vocabulary (draft_vocab_size {drafter.config.draft_vocab_size}) — use "
            f"loss: ce"
        )
    return drafter, blob, ckpt


@dataclass
class _DataPlan:
    """Packed training / validation rows and the step counts they imply."""

    rows: PackedRows
    val_rows: PackedRows | None
    steps_per_epoch: int
    total: int  # optimizer steps of the schedule (10⁹ = until schedule_minutes are spent)
    unbounded: bool  # a time-based schedule without max_steps
    fill: float
    info: dict[str, Any]


def _plan_data(cfg: Any, source: Any, world_size: int) -> _DataPlan:
    """Split the samples into train / validation, pack them into rows, and count the steps."""
    lengths = sample_lengths(source)
    train_idx, val_idx = split_indices(
        len(lengths), val_fraction=cfg.val_fraction, val_samples=cfg.val_samples, seed=cfg.seed
    )
    plan = plan_rows({i: lengths[i] for i in train_idx}, max_tokens=cfg.max_tokens, seed=cfg.seed, strategy=cfg.packing)
    problem = supervision_problem(source, plan)  # e.g. max_tokens shorter than every prompt: a loss of 0
    if problem:
        raise DataError(problem)
    val_plan = (
        plan_rows({i: lengths[i] for i in val_idx}, max_tokens=cfg.max_tokens, seed=cfg.seed, strategy=cfg.packing)
        if val_idx
        else None
    )
    rows = PackedRows(source, plan)
    val_rows = PackedRows(source, val_plan) if val_plan is not None and len(val_plan) else None
    spe = steps_per_epoch(len(rows), batch_rows=cfg.batch_rows, grad_accum=cfg.grad_accum, world_size=world_size)
    # a time-based schedule without max_steps runs until its training time is spent (epochs do not cap it)
    unbounded = cfg.schedule_minutes is not None and cfg.max_steps is None
    total = cfg.max_steps if cfg.max_steps is not None else (10**9 if unbounded else cfg.epochs * spe)
    info = {
        "samples": len(lengths),
        "train_samples": len(train_idx),
        "val_samples": len(val_idx),
        "rows": len(rows),
        "val_rows": len(val_rows) if val_rows is not None else 0,
        "truncated": plan.truncated,
        "longest_context": min(max((lengths[i] for i in train_idx), default=0), cfg.max_tokens),
        "fill": plan.fill,
        "steps_per_epoch": spe,
        "total_steps": total,
    }
    return _DataPlan(
        rows=rows, val_rows=val_rows, steps_per_epoch=spe, total=total, unbounded=unbounded, fill=plan.fill, info=info
    )


def _wrap(
    cfg: Any, drafter: DFlashDrafter, embed: torch.Tensor, dist: DistContext, device: torch.device
) -> tuple[DrafterStep, nn.Module]:
    """(the plain step module, what runs): FSDP2-sharded, DDP-wrapped or plain (compiled or not: `Run.step_module`)."""
    core = DrafterStep(drafter, embed)
    module: nn.Module = core
    if cfg.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in drafter.layers:  # one all-gather per decoder layer; fc/norms/mask vector at the root
            fully_shard(layer)
        fully_shard(core)
    elif dist.distributed:
        module = DDP(core, device_ids=[device.index] if device.type == "cuda" else None)
    return core, module


def _optimizer(
    cfg: Any,
    drafter: DFlashDrafter,
    core: nn.Module,
    total: int,
    blob: dict[str, Any] | None,
    world_size: int,
    all_reduce: Callable[[Tensor], Tensor],
) -> tuple[torch.optim.Optimizer, Any, TrainState]:
    """AdamW + warmup/cosine LambdaLR, and the training state — restored from `blob` when resuming."""
    state = TrainState(world_size=world_size) if blob is None else TrainState(**blob["state"])
    impl = _adamw_impl(cfg, drafter, state, fresh=blob is None, all_reduce=all_reduce)
    state.optimizer_impl = impl
    optimizer = make_adamw(
        drafter.parameters(), impl, lr=cfg.lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay
    )
    warmup = max(1, math.ceil(cfg.warmup_ratio * total)) if cfg.warmup_ratio > 0 else 0
    lr_fn = cosine_with_warmup(total, warmup, cfg.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_fn)
    if blob is None:
        return optimizer, scheduler, state
    if cfg.fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(
            core, optimizer, optim_state_dict=blob["optimizer"], options=StateDictOptions(full_state_dict=True)
        )
    else:
        optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    # The saved lr came from the saved schedule; a changed run length (epochs/max_steps) re-shapes the
    # cosine, so take the next lr from the current one (the same value when nothing changed).
    for group, base in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = base * lr_fn(scheduler.last_epoch)
    restore_rng(blob["rng"])
    return optimizer, scheduler, state


def _adamw_impl(
    cfg: Any, drafter: DFlashDrafter, state: TrainState, *, fresh: bool, all_reduce: Callable[[Tensor], Tensor]
) -> str:
    """AdamW's implementation for this run: a named one; on resume under `auto` the run's own; else measured
    (`choose_adamw_impl`; FSDP's sharded parameters: foreach)."""
    if cfg.optimizer_impl != "auto":
        return cfg.optimizer_impl
    if not fresh:
        return state.optimizer_impl
    if cfg.fsdp:
        return "foreach"
    impl, timings = choose_adamw_impl(list(drafter.parameters()), all_reduce=all_reduce)
    if timings:
        print(
            "[dflashkit train] AdamW: "
            + ", ".join(f"{k} {v:.1f} ms/step" for k, v in timings.items())
            + f" on this machine → {impl}",
            flush=True,
        )
    return impl


def _precision(
    cfg: Any, drafter_config: DrafterConfig, device: torch.device, state: TrainState, *, fresh: bool, dist: Any
) -> str:
    """The run's precision: a named `dtype`; bf16 autocast on CUDA; on a CPU the run's own when resuming (a state
    that records none trained in fp32), else measured (`choose_precision`) at the run's geometry."""
    if cfg.dtype != "auto":
        return cfg.dtype
    if device.type == "cuda":
        return "bf16"
    if not fresh:
        return state.precision or "fp32"
    from dflashkit.train.memory import StepShape
    from dflashkit.train.memory_check import blocks_per_row
    from dflashkit.train.precision_choice import TRAINING, choose_precision
    from dflashkit.train.step_cost import precision_timer

    shape = StepShape(rows=cfg.batch_rows, tokens=cfg.max_tokens, blocks=blocks_per_row(cfg))
    reduce = dist.all_reduce if dist.distributed else None
    choice, timings = choose_precision(drafter_config, shape, precision_timer, all_reduce=reduce)
    if dist.is_main:
        if timings:
            why = ", ".join(f"{k} {v:.0f} ms" for k, v in timings.items()) + " a step on this machine"
        else:
            forced = TRAINING.override()
            why = TRAINING.why(forced) if forced else "timed before on this machine (dflashkit info)"
        print(f"[dflashkit train] precision: {why} → {choice}", flush=True)
    return choice


def _compile_trial(
    cfg: Any, drafter_config: DrafterConfig, device: torch.device, state: TrainState, data: _DataPlan, dist: Any
) -> CompileTrial:
    """Whether this run's steps run compiled (`compile_choice.start_trial`): settled now, or timed in its first
    steps against the training time it has left (steps left × a step, within `schedule_minutes` and
    `time_budget_minutes`)."""
    from dflashkit.train.compile_choice import compile_key, start_trial
    from dflashkit.train.memory import StepShape
    from dflashkit.train.memory_check import blocks_per_row

    def remaining_s(step_s: float) -> float:  # at the gate, on every rank at once (ranks read no store)
        left = math.inf if data.unbounded else (data.total - state.step) * step_s
        if cfg.schedule_minutes is not None:
            elapsed = torch.tensor([state.elapsed_s], dtype=torch.float64, device=device)
            elapsed = float(dist.all_reduce(elapsed, op="max")) if dist.distributed else state.elapsed_s
            left = min(left, 60 * cfg.schedule_minutes - elapsed)
        if cfg.time_budget_minutes is not None:
            left = min(left, 60 * cfg.time_budget_minutes)
        return max(0.0, left)

    wrap = ("fsdp" if cfg.fsdp else "ddp") + f"x{dist.world_size}" if dist.distributed else "plain"
    # a step's work: its micro-batches, and the target's forward and objective where the run computes them
    wrap += f":ga{cfg.grad_accum}:{'online' if cfg.online else 'offline'}:{cfg.loss}"
    shape = StepShape(rows=cfg.batch_rows, tokens=cfg.max_tokens, blocks=blocks_per_row(cfg))
    key = compile_key(drafter_config, shape, precision=state.precision, device=device, wrap=wrap)
    trial = start_trial(cfg.compile, key, remaining_s, distributed=dist.distributed, write=dist.is_main)
    if dist.is_main:
        said = trial.message or "timing the first eager steps (compile: auto)"
        print(f"[dflashkit train] torch.compile: {said}", flush=True)
    return trial


def _announce(cfg: Any, info: dict[str, Any], data: _DataPlan, state: TrainState, ckpt: Path | None) -> None:
    print(
        f"[dflashkit train] {info['train_samples']} samples → {info['rows']} rows (fill {data.fill:.0%}, "
        f"{info['truncated']} truncated to {cfg.max_tokens} tokens), {info['val_samples']} held out; "
        f"{data.steps_per_epoch} steps/epoch, "
        + (f"steps until {cfg.schedule_minutes:g} min of training" if data.unbounded else f"{data.total} steps")
        + f"; drafter {info['parameters']:,} params on {info['device']}"
        + (f"; resuming from {ckpt} at step {state.step}" if ckpt is not None else ""),
        flush=True,
    )


__all__ = ["DrafterStep", "Run", "open_feature_source", "setup_run"]
