"""`TrainConfig`: every knob of a training run, read from YAML plus `key=value` overrides.

    cfg = TrainConfig.load("configs/smollm2.yaml", ["lr=3e-4", "drafter.num_hidden_layers=3"])

Unknown keys raise ConfigError naming the key and listing the valid ones. `drafter` is a dict of overrides passed
to `drafter.defaults.default_drafter_config(target, **drafter)` (e.g. num_hidden_layers, block_size, target_layer_ids);
override one entry with `drafter.KEY=VALUE` or the whole dict with `drafter={...}`.

Resume compatibility: a run restarted in an existing `out` directory continues from its latest checkpoint. The
fields in `RESUME_LOCKED` (architecture, data, batch geometry, optimiser, labels/loss) must not change then;
`check_resume_compatible` names the field and both values; a locked field that a checkpoint predates counts as its
default there (so adding a field keeps older runs resumable). Run-length and bookkeeping fields (epochs, max_steps,
time budget, save/eval/log cadence, devices, compile) may change; a changed schedule length re-shapes the cosine
from the current step on (so only an unchanged config reproduces an uninterrupted run exactly).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from dflashkit.errors import ConfigError

# Fields that define what is trained and how: changing one between a checkpoint and its resume is an error.
RESUME_LOCKED = (
    "target",
    "features",
    "tokens",
    "online",
    "drafter",
    "init_from",
    "max_tokens",
    "packing",
    "batch_rows",
    "grad_accum",
    "seed",
    "labels",
    "loss",
    "gamma",
    "max_anchors",
    "val_fraction",
    "val_samples",
    "lr",
    "min_lr_ratio",
    "warmup_ratio",
    "weight_decay",
    "adam_betas",
    "noise_std",
    "noise_schedule",
    "fsdp",
    "topk",
    "topk_ce_weight",
)

_FLOAT_FIELDS = (
    "lr",
    "min_lr_ratio",
    "warmup_ratio",
    "weight_decay",
    "grad_clip",
    "gamma",
    "noise_std",
    "val_fraction",
    "time_budget_minutes",
    "schedule_minutes",
    "topk_ce_weight",
)
DEFAULT_ONLINE_TOPK = 32  # loss: topk with online features and topk: null — entries per position
_CHOICES = {
    "loss": ("ce", "kl", "topk"),
    "labels": ("data", "target"),
    "noise_schedule": ("constant", "cosine"),
    "dtype": ("auto", "fp32", "bf16"),
    "packing": ("bfd", "greedy"),
}


@dataclass
class TrainConfig:
    """A DFlash training run. Paths are relative to the working directory."""

    # ---- data and models
    features: str | None = None  # directory written by `dflashkit capture` (offline features)
    tokens: str | None = None  # tokens.jsonl from `dflashkit prepare` (with online: true)
    online: bool = False  # compute target features on the fly from `tokens`
    target: str = "default"  # model dir, .gguf, or "default" (embedded SmolLM2-135M-Instruct)
    trust_remote_code: bool = False
    drafter: dict[str, Any] = field(default_factory=dict)  # overrides for default_drafter_config
    init_from: str | None = None  # start from these drafter weights (z-lab checkpoint) instead of random
    out: str = "runs/dflash"
    # ---- batch geometry
    max_tokens: int = 3072  # tokens per packed row
    packing: str = "bfd"  # "bfd" best-fit-decreasing, "greedy" in seeded order
    batch_rows: int = 1  # rows per micro-batch per rank
    grad_accum: int = 1  # micro-batches per optimizer step
    max_anchors: int = 512  # blocks per document, resampled every epoch
    # ---- objective
    loss: str = "ce"  # "ce" hard labels, "kl" to the target's final-layer distribution (runs
    # the target every step), "topk" KL to its stored top-k log-probs
    # (`dflashkit capture --topk K`), renormalised over the k entries
    topk: int | None = None  # loss: topk — entries used per position: None = all captured ones
    # (online: DEFAULT_ONLINE_TOPK); fewer keeps the largest of a capture
    topk_ce_weight: float = 0.0  # loss: topk — α in (1 − α)·KL_topk + α·CE(hard label)
    labels: str = "data"  # "data" tokens, or "target" = the target's final-layer argmax
    gamma: float | None = None  # decay of slot weights; None → 7 for bs 16, 5 for 10, 4 for 8
    noise_std: float = 0.0  # Gaussian noise on the fc inputs (target features) only
    noise_schedule: str = "constant"  # "constant" or "cosine" (decays to 0 over the run)
    # ---- optimiser
    lr: float = 6e-4
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    epochs: int = 6
    max_steps: int | None = None  # overrides epochs: the schedule spans exactly this many steps
    time_budget_minutes: float | None = None  # stop cleanly (checkpoint + final/) once exceeded
    schedule_minutes: float | None = None  # warmup + cosine span this much training time (step times summed
    # over sessions) instead of steps; the run completes when it is
    # spent (max_steps, if set, still caps it; epochs do not)
    # ---- validation, logging, checkpoints
    val_fraction: float = 0.0
    val_samples: int | None = None  # held-out sample count (overrides val_fraction)
    eval_every: int = 0  # steps between validation passes (0: only at the end)
    keep_best: bool = False  # also export the drafter of the validation pass with the highest val τ to
    # OUT/best (needs held-out samples and eval_every; guards long runs on
    # little data against overfitting: final is still written)
    save_every: int = 500
    keep_checkpoints: int = 3  # newest step checkpoints kept (0 keeps all)
    log_every: int = 1
    rolling_window: int = 100  # steps in the rolling loss percentiles
    tensorboard: bool = True
    progress: bool = True
    # ---- execution
    seed: int = 0
    dtype: str = "auto"  # auto: fp32 on CPU, bf16 autocast on CUDA
    drafter_device: str = "auto"  # auto: cuda:LOCAL_RANK when available, else cpu
    target_device: str = "auto"  # auto: the drafter's device
    compile: bool = False
    fsdp: bool = False  # shard the drafter with FSDP2 (distributed runs)
    num_workers: int = 0  # DataLoader workers for offline features (online needs 0)
    loss_chunk_size: int | None = None  # blocks per LM-head chunk in the loss (None: automatic)

    # ------------------------------------------------------------------ construction
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config") -> TrainConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a mapping of training options, got {type(raw).__name__}")
        valid = cls.field_names()
        unknown = sorted(set(raw) - set(valid))
        if unknown:
            raise ConfigError(f"{source}: unknown training option(s) {unknown}; valid options: {valid}")
        raw = dict(raw)
        for name in _FLOAT_FIELDS:  # YAML 1.1 reads `2e-3` (no dot) as a string
            if isinstance(raw.get(name), str):
                try:
                    raw[name] = float(raw[name])
                except ValueError:
                    raise ConfigError(f"{source}: {name} must be a number, got {raw[name]!r}") from None
        cfg = cls(**raw)
        cfg.validate(source=source)
        return cfg

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
        """YAML file (optional) + `key=value` overrides (values parsed as YAML; `drafter.KEY=VALUE` sets one)."""
        raw: dict[str, Any] = {}
        source = "overrides"
        if path is not None:
            path = Path(path)
            source = str(path)
            if not path.is_file():
                raise ConfigError(f"{path}: training config not found")
            try:
                raw = yaml.safe_load(path.read_text()) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{path}: not valid YAML ({e})") from None
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}: not valid UTF-8 (byte offset {e.start}); expected a YAML file") from None
            if not isinstance(raw, dict):
                raise ConfigError(f"{path}: expected a mapping of training options")
        raw = apply_overrides(raw, overrides)
        return cls.from_dict(raw, source=source)

    def validate(self, *, source: str = "config") -> None:
        """Raise ConfigError naming the field and what was expected."""
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(f"{source}: {name} = {getattr(self, name)!r}; expected one of {list(choices)}")
        positive = ("max_tokens", "batch_rows", "grad_accum", "max_anchors", "epochs", "log_every", "rolling_window")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{source}: {name} must be a positive integer, got {v!r}")
        for name in ("save_every", "eval_every", "keep_checkpoints", "num_workers", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"{source}: {name} must be an integer ≥ 0, got {v!r}")
        if self.max_steps is not None and (not isinstance(self.max_steps, int) or self.max_steps < 1):
            raise ConfigError(f"{source}: max_steps must be a positive integer or null, got {self.max_steps!r}")
        for name in ("lr", "warmup_ratio", "weight_decay", "grad_clip", "noise_std", "val_fraction", "min_lr_ratio"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"{source}: {name} must be a number ≥ 0, got {v!r}")
        if self.lr <= 0:
            raise ConfigError(f"{source}: lr must be > 0, got {self.lr}")
        if self.keep_best and not (self.eval_every and (self.val_fraction or self.val_samples)):
            raise ConfigError(
                f"{source}: keep_best needs validation passes: set eval_every > 0 and val_samples "
                f"(or val_fraction) > 0 (got eval_every {self.eval_every}, val_samples "
                f"{self.val_samples}, val_fraction {self.val_fraction})"
            )
        if self.warmup_ratio >= 1 or self.val_fraction >= 1 or self.min_lr_ratio > 1:
            raise ConfigError(f"{source}: warmup_ratio and val_fraction must be < 1, min_lr_ratio ≤ 1")
        if (
            not isinstance(self.topk_ce_weight, (int, float))
            or isinstance(self.topk_ce_weight, bool)
            or not 0 <= self.topk_ce_weight <= 1
        ):
            raise ConfigError(f"{source}: topk_ce_weight must be a number in [0, 1], got {self.topk_ce_weight!r}")
        if self.topk is not None and (not isinstance(self.topk, int) or isinstance(self.topk, bool) or self.topk < 1):
            raise ConfigError(f"{source}: topk must be a positive integer or null (all captured), got {self.topk!r}")
        if self.loss != "topk" and (self.topk is not None or self.topk_ce_weight):
            raise ConfigError(f"{source}: topk / topk_ce_weight only apply to loss: topk (loss is {self.loss!r})")
        if self.gamma is not None and (not isinstance(self.gamma, (int, float)) or self.gamma <= 0):
            raise ConfigError(f"{source}: gamma must be > 0 or null, got {self.gamma!r}")
        for name in ("time_budget_minutes", "schedule_minutes"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{source}: {name} must be > 0 or null, got {getattr(self, name)}")
        if not isinstance(self.drafter, dict):
            raise ConfigError(f"{source}: drafter must be a mapping of drafter config overrides, got {self.drafter!r}")
        if not (isinstance(self.adam_betas, (list, tuple)) and len(self.adam_betas) == 2):
            raise ConfigError(f"{source}: adam_betas must be a list of two numbers, got {self.adam_betas!r}")
        if self.features is not None and self.tokens is not None and self.online:
            raise ConfigError(f"{source}: set either features (offline) or tokens with online: true, not both")
        if self.tokens is not None and self.features is None and not self.online:
            raise ConfigError(
                f"{source}: tokens given without features: set online: true to compute target "
                f"features on the fly, or run `dflashkit capture` and set features"
            )
        if self.online and self.num_workers:
            raise ConfigError(f"{source}: online features run the target in the main process; set num_workers: 0")

    # ------------------------------------------------------------------ output
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def summary(self) -> str:
        """A few lines for the CLI: data, model, schedule, output."""
        data = f"features {self.features}" if self.features else f"tokens {self.tokens} (online)"
        stop = (
            f"max_steps {self.max_steps}"
            if self.max_steps
            else "no step limit"
            if self.schedule_minutes
            else f"{self.epochs} epochs"
        )
        budget = f", time budget {self.time_budget_minutes} min" if self.time_budget_minutes else ""
        if self.schedule_minutes:
            budget += f", schedule over {self.schedule_minutes:g} min of training time"
        return "\n".join(
            [
                f"  data        {data}; rows of ≤ {self.max_tokens} tokens, {self.batch_rows} row(s) × "
                f"{self.grad_accum} accum per rank",
                f"  target      {self.target}   drafter overrides {self.drafter or '{}'}",
                f"  objective   {self.loss}{self._topk_summary()} on {self.labels} labels, "
                f"γ {self.gamma or 'default'}, "
                f"≤ {self.max_anchors} anchors/doc"
                + (f", fc noise {self.noise_std} ({self.noise_schedule})" if self.noise_std else ""),
                f"  optimiser   AdamW lr {self.lr}, warmup {self.warmup_ratio}, clip {self.grad_clip}, {stop}{budget}",
                f"  output      {self.out}  (save every {self.save_every}, eval every {self.eval_every or 'end'})",
            ]
        )

    def _topk_summary(self) -> str:
        if self.loss != "topk":
            return ""
        k = f"top-{self.topk}" if self.topk else f"top-{DEFAULT_ONLINE_TOPK}" if self.online else "captured top-k"
        return f" (KL to the target's {k}, renormalised; CE weight {self.topk_ce_weight:g})"


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply `key=value` / `drafter.key=value` strings to a raw config dict (values parsed as YAML)."""
    out = dict(raw)
    out["drafter"] = dict(out.get("drafter") or {})
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
        key, value = item.split("=", 1)
        key = key.strip()
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from None
        if key.startswith("drafter."):
            out["drafter"][key.split(".", 1)[1]] = parsed
        else:
            out[key] = parsed
    if not out["drafter"] and "drafter" not in raw:
        out.pop("drafter")
    return out


def check_resume_compatible(saved: dict[str, Any], now: TrainConfig, *, where: str) -> None:
    """Raise ConfigError when a locked field differs between the checkpoint's config and this run's."""
    current = now.to_dict()
    defaults = TrainConfig().to_dict()
    for name in RESUME_LOCKED:
        old, new = saved.get(name, defaults[name]), current.get(name)  # a field the checkpoint predates
        if name == "drafter":
            keys = sorted(set(old or {}) | set(new or {}))
            for k in keys:
                if (old or {}).get(k) != (new or {}).get(k):
                    raise ConfigError(
                        f"cannot resume {where}: drafter.{k} was {(old or {}).get(k)!r} in the checkpoint but is "
                        f"{(new or {}).get(k)!r} now; use a new `out` directory to train a different drafter"
                    )
            continue
        if isinstance(old, tuple):
            old = list(old)
        if old != new:
            raise ConfigError(
                f"cannot resume {where}: {name} was {old!r} in the checkpoint but is {new!r} now; "
                f"revert it or use a new `out` directory"
            )


__all__ = ["DEFAULT_ONLINE_TOPK", "RESUME_LOCKED", "TrainConfig", "apply_overrides", "check_resume_compatible"]
