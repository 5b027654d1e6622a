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

import dataclasses
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field

from dflashkit.drafter.heads import FLAT_TRAIN_SETTINGS, HEADS, TRAIN_SETTINGS, train_kind_fields
from dflashkit.errors import ConfigError
from dflashkit.target.devices import resolve_device
from dflashkit.validation import (
    FLATTENS,
    AdamBetas,
    Bool,
    CompileSetting,
    Expect,
    Fraction,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Seed,
    Text,
    UnitInterval,
    check_fields,
    choice,
    fail,
    field_types,
    flat_keywords,
    load_yaml,
    optional,
    parse_yaml_value,
)

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
    "position_weights",
    "dpace_alpha",
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
    "lk_eta",
    "lk_kl_scale",
    "lk_kl_decay",
    *(f.name for settings in TRAIN_SETTINGS for f in fields(settings)),  # a head's objective options
)

DEFAULT_ONLINE_TOPK = 32  # loss: topk with online features and topk: null — entries per position
_Device = Annotated[str, Field(min_length=1), Expect("a device: auto, cpu, cuda or cuda:N")]


def _cadence(steps: int, minutes: float | None) -> str:
    """'200 steps', '1 min', '200 steps or 1 min', or 'end' (the summary line of a checkpoint or validation cadence)."""
    parts = ([f"{steps} steps"] if steps else []) + ([f"{minutes:g} min"] if minutes else [])
    return " or ".join(parts) or "end"


# training option → the kind whose objective reads it; a head's options class → its kind
_HEAD_OPTIONS = train_kind_fields()
_KIND_OF = {h.train_settings: h.kind for h in HEADS.values() if h.train_settings is not None}
NESTED = "head_options"  # the field holding the heads' own options


def _default_head_options() -> dict[str, Any]:
    """Every head's training options at their defaults: kind → an instance of its `Head.train_settings`."""
    return {kind: settings() for settings, kind in _KIND_OF.items()}


def _nest_head_options(values: dict[str, Any]) -> dict[str, Any]:
    """`TrainConfig`'s keywords with the heads' flat options (`dspark_ce_weight=1.0`) folded into `head_options`: each
    head's instance — of a given mapping (copied), else its defaults — with the options given for it changed. Every
    head's are kept: which head trains is known only once the drafter is (`drafter.kind`, `init_from`, a resumed
    checkpoint), and the run refuses an option of another head there (`train.run.check_kind_fits`)."""
    given = values.get(NESTED) or {}
    options = {kind: given.get(kind, default) for kind, default in _default_head_options().items()}
    for kind in options:
        own = {name: values.pop(name) for name in list(values) if _HEAD_OPTIONS.get(name) == kind}
        options[kind] = dataclasses.replace(options[kind], **own)  # a copy: configs never share their options
    values[NESTED] = options
    return values


@flat_keywords(_nest_head_options)
@dataclass
class TrainConfig:
    """A DFlash training run. Paths are relative to the working directory. Every field's type is its check
    (`dflashkit.validation`); `validate()` runs them and the rules between fields. The options one drafter head
    alone reads (DSpark's loss weights, DFlash2's selector term) are its `Head.train_settings`, held nested in
    `head_options` (one instance per head); every door names them flat — this constructor
    (`TrainConfig(dspark_ce_weight=1.0)`), a YAML file, `key=value` overrides, `to_dict` and a checkpoint's
    train_config.yaml."""

    # Every head's own options: kind → an instance of its `Head.train_settings` (defaults where not given); its head
    # reads them as `head.train_options(cfg)`. Declared first: a head's options lead `to_dict` (the layout of a
    # checkpoint's train_config.yaml) and `field_types`.
    head_options: dict[str, Any] = field(
        default_factory=_default_head_options, metadata={FLATTENS: FLAT_TRAIN_SETTINGS}
    )
    # ---- data and models
    features: optional(Text, "no captured features") = None  # directory written by `dflashkit capture`
    tokens: optional(Text, "no tokens file") = None  # tokens.jsonl from `dflashkit prepare` (with online: true)
    online: Bool = False  # compute target features on the fly from `tokens`
    target: Text = "default"  # model dir, .gguf, or "default" (embedded SmolLM2-135M-Instruct)
    trust_remote_code: Bool = False  # allow code from the target's directory (off: nothing in a checkpoint runs)
    # drafter config fields over the target's default drafter (`dflashkit info`), e.g. num_hidden_layers, block_size
    drafter: Annotated[dict[str, Any], Expect("a mapping of drafter config fields")] = field(default_factory=dict)
    init_from: optional(Text, "a fresh drafter") = None  # start from these drafter weights instead of random
    out: Text = "runs/dflash"  # run directory: checkpoints, final/, metrics.jsonl; re-running resumes from it
    # ---- batch geometry
    max_tokens: PositiveInt = 3072  # tokens per packed row
    packing: choice("bfd", "greedy") = "bfd"  # "bfd" best-fit-decreasing, "greedy" in seeded order
    batch_rows: PositiveInt = 1  # rows per micro-batch per rank
    grad_accum: PositiveInt = 1  # micro-batches per optimizer step
    max_anchors: PositiveInt = 512  # blocks per document, resampled every epoch
    # ---- objective
    # "ce" hard labels; against the target's final-layer distribution (runs the target every step): "kl", "tv"
    # (total variation, 1 − acceptance rate), "nla" (−log acceptance rate), "lk_hybrid" (λ·KL + (1 − λ)·TV,
    # λ = exp(−lk_eta·acceptance), speculators), "lk_lambda" (the same with one λ = lk_kl_scale·exp(−lk_kl_decay·mean
    # acceptance) per batch, SpecForge); "topk" KL to its stored top-k log-probs (`dflashkit capture --topk K`)
    loss: choice("ce", "kl", "topk", "tv", "nla", "lk_hybrid", "lk_lambda") = "ce"
    # loss: topk — entries used per position: None = all captured ones (online: DEFAULT_ONLINE_TOPK)
    topk: optional(PositiveInt, "all captured") = None
    topk_ce_weight: UnitInterval = 0.0  # loss: topk — α in (1 − α)·KL_topk + α·CE(hard label)
    lk_eta: PositiveFloat = 3.0  # loss: lk_hybrid — η in λ = exp(−η·acceptance): larger turns to TV sooner
    lk_kl_scale: PositiveFloat = 1.0  # loss: lk_lambda — s in λ = s·exp(−d·mean acceptance) (SpecForge's kl_scale)
    lk_kl_decay: PositiveFloat = 1.0  # loss: lk_lambda — d (SpecForge's kl_decay)
    labels: choice("data", "target") = "data"  # "data" tokens, or "target" = the target's final-layer argmax
    # slot weights: "decay" exp(−(k−1)/γ) (original DFlash) or "dpace" (D-PACE: from the drafter's own confidence,
    # per block; loss: ce only)
    position_weights: choice("decay", "dpace") = "decay"
    dpace_alpha: UnitInterval = 0.5  # position_weights: dpace — floor α in q̃ = (1 − α)·exp(−CE) + α
    gamma: optional(PositiveFloat, "7 for block 16, 5 for 10, 4 for 8; DSpark 4") = None  # decay of slot weights
    noise_std: NonNegativeFloat = 0.0  # Gaussian noise on the fc inputs (target features) only
    noise_schedule: choice("constant", "cosine") = "constant"  # cosine decays to 0 over the run
    # ---- optimiser
    lr: PositiveFloat = 6e-4  # peak learning rate of AdamW
    min_lr_ratio: UnitInterval = 0.0  # cosine floor as a fraction of lr
    warmup_ratio: Fraction = 0.04  # linear warmup over this fraction of the schedule, then cosine
    weight_decay: NonNegativeFloat = 0.0  # AdamW's decoupled weight decay
    adam_betas: AdamBetas = field(default_factory=lambda: [0.9, 0.95])  # AdamW's (β1, β2)
    grad_clip: NonNegativeFloat = 1.0  # 0 = no clipping
    # AdamW's implementation: "auto" times fused and foreach on this machine at the start of a run (kept on resume;
    # `dflashkit.train.optimizer_choice`), or one of them / "default" (torch's own pick) named
    optimizer_impl: choice("auto", "fused", "foreach", "default") = "auto"
    epochs: PositiveInt = 6  # passes over the training rows (anchors resampled each epoch)
    max_steps: optional(PositiveInt, "by epochs") = None  # overrides epochs: the schedule spans this many steps
    time_budget_minutes: optional(PositiveFloat, "no budget") = None  # stop cleanly (checkpoint + final/)
    # warmup + cosine span this much training time (step times summed over resumed runs) instead of steps; the run
    # completes when it is spent (max_steps, if set, still caps it; epochs do not)
    schedule_minutes: optional(PositiveFloat, "by steps") = None
    # ---- validation, logging, checkpoints
    val_fraction: Fraction = 0.0  # fraction of samples held out for validation (val τ, loss)
    val_samples: optional(NonNegativeInt, "by val_fraction") = None  # held-out sample count
    eval_every: NonNegativeInt = 0  # steps between validation passes (0: only at the end)
    # also a validation pass after this many minutes of training time (step times summed) since the last: a
    # cadence that does not grow with the steps' speed
    eval_every_minutes: optional(PositiveFloat, "by steps only") = None
    # also export the drafter of the validation pass with the highest val τ to OUT/best (needs held-out samples
    # and eval_every; guards long runs on little data against overfitting: final is still written)
    keep_best: Bool = False
    save_every: NonNegativeInt = 500  # 0: only at the end
    # also a checkpoint after this many minutes of training time since the last (each save costs the same however
    # fast the steps are)
    save_every_minutes: optional(PositiveFloat, "by steps only") = None
    keep_checkpoints: NonNegativeInt = 3  # newest step checkpoints kept (0 keeps all)
    log_every: PositiveInt = 1  # steps between lines of metrics.jsonl
    rolling_window: PositiveInt = 100  # steps in the rolling loss percentiles
    tensorboard: Bool = True  # also write TensorBoard events to OUT/tb
    progress: Bool = True  # a progress bar on the terminal
    # ---- execution
    seed: Seed = 0  # seeds init, packing order and anchors (per epoch and row: a resume repeats them)
    dtype: choice("auto", "fp32", "bf16") = "auto"  # auto: bf16 autocast on CUDA; on CPU timed (precision_choice)
    drafter_device: _Device = "auto"  # auto: cuda:LOCAL_RANK when available, else cpu
    target_device: _Device = "auto"  # auto: the drafter's device
    # torch.compile the step; auto: where measured to pay, timed in a long run's first steps (train.compile_choice)
    compile: CompileSetting = "auto"
    fsdp: Bool = False  # shard the drafter with FSDP2 (distributed runs)
    num_workers: NonNegativeInt = 0  # DataLoader workers for offline features (online needs 0)
    loss_chunk_size: optional(PositiveInt, "automatic") = None  # blocks per LM-head chunk in the loss
    # where each value came from ("run.yaml:7", "override 'lr=3e-4'"); not a training option
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False, metadata={"internal": True})

    # ------------------------------------------------------------------ construction
    @classmethod
    def field_names(cls) -> list[str]:
        """Every option as the doors name it (a head's flat: `dspark_ce_weight`), the heads' first."""
        return list(field_types(cls))

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], *, source: str = "config", sources: dict[str, str] | None = None
    ) -> TrainConfig:
        """A validated config from a mapping of options; `sources` maps an option (or `drafter.KEY`) to where its
        value came from, `source` names the rest."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a mapping of training options, got {type(raw).__name__}")
        sources = dict(sources or {})
        where = _where(sources, source)
        check_fields(TrainConfig, raw, where, what="training option")
        cfg = cls(**raw, sources=sources)
        cfg.validate(source=source)
        return cfg

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
        """YAML file (optional) + `key=value` overrides (values parsed as YAML; `drafter.KEY=VALUE` sets one)."""
        raw: dict[str, Any] = {}
        sources: dict[str, str] = {}
        source = "command-line options"
        if path is not None:
            raw, lines = load_yaml(path)
            source = str(path)
            sources = {".".join(key): f"{path}:{line}" for key, line in lines.items()}
        raw, override_sources = apply_overrides(raw, overrides)
        sources.update(override_sources)
        return cls.from_dict(raw, source=source, sources=sources)

    def validate(self, *, source: str = "config") -> None:
        """Raise ConfigError for a field whose value its type refuses or that breaks a rule between fields:
        '{where}: {field} = {value}: expected {what}'."""
        from dflashkit.drafter.defaults import check_overrides
        from dflashkit.target.devices import device_problem

        where = _where(self.sources, source)
        check_fields(TrainConfig, self.to_dict(), where)
        check_overrides(self.drafter, lambda k: where(f"drafter.{k}"), prefix="drafter.")
        for name in ("drafter_device", "target_device"):
            why = device_problem(getattr(self, name), allow_auto=True)
            if why:
                raise fail(where(name), name, getattr(self, name), why.removeprefix("expected "))
        if self.keep_best and not (
            (self.eval_every or self.eval_every_minutes) and (self.val_fraction or self.val_samples)
        ):
            raise fail(
                where("keep_best"),
                "keep_best",
                True,
                f"validation passes with it: eval_every > 0 (or eval_every_minutes) and val_samples (or "
                f"val_fraction) > 0; got eval_every {self.eval_every}, val_samples {self.val_samples}, "
                f"val_fraction {self.val_fraction}",
            )
        if self.loss != "topk":
            for name in ("topk", "topk_ce_weight"):
                if getattr(self, name):
                    raise fail(
                        where(name),
                        name,
                        getattr(self, name),
                        f"unset: it only applies to loss: topk (loss is {self.loss!r})",
                    )
        if self.loss != "lk_hybrid" and self.lk_eta != 3.0:
            raise fail(
                where("lk_eta"),
                "lk_eta",
                self.lk_eta,
                f"unset: it only applies to loss: lk_hybrid (loss is {self.loss!r})",
            )
        for name in ("lk_kl_scale", "lk_kl_decay"):
            if self.loss != "lk_lambda" and getattr(self, name) != 1.0:
                raise fail(
                    where(name),
                    name,
                    getattr(self, name),
                    f"unset: it only applies to loss: lk_lambda (loss is {self.loss!r})",
                )
        if self.position_weights == "dpace":
            if self.loss != "ce":
                raise fail(
                    where("position_weights"),
                    "position_weights",
                    "dpace",
                    f"loss: ce — D-PACE weighs each slot by exp(−CE), the drafter's probability of the hard label, "
                    f"so it needs the cross-entropy loss (loss is {self.loss!r}); use position_weights: decay",
                )
            if self.gamma is not None:
                raise fail(
                    where("gamma"), "gamma", self.gamma, "unset: D-PACE replaces the decay (position_weights: dpace)"
                )
        elif self.dpace_alpha != 0.5:
            raise fail(
                where("dpace_alpha"),
                "dpace_alpha",
                self.dpace_alpha,
                "unset: it only applies to position_weights: dpace (position_weights is 'decay')",
            )
        if self.fsdp and self.optimizer_impl == "fused":
            raise fail(
                where("optimizer_impl"),
                "optimizer_impl",
                "fused",
                "auto, foreach or default with fsdp: true (the sharded drafter steps with the multi-tensor AdamW)",
            )
        if self.features is not None and self.tokens is not None and self.online:
            raise fail(where("online"), "online", True, "features (offline) or tokens with online: true, not both")
        if self.tokens is not None and self.features is None and not self.online:
            raise fail(
                where("tokens"),
                "tokens",
                self.tokens,
                "features as well, or online: true to compute target features on the fly (or run "
                "`dflashkit capture` and set features)",
            )
        if self.online and self.num_workers:
            raise fail(
                where("num_workers"),
                "num_workers",
                self.num_workers,
                "0 with online: true (online features run the target in the main process)",
            )

    def check_inputs(self) -> None:
        """The files this run reads exist (before its output directory is touched): features, tokens, init_from."""
        where = _where(self.sources, "config")
        for name, kind in (("features", "directory"), ("tokens", "file"), ("init_from", "directory")):
            value = getattr(self, name)
            if value is None:
                continue
            path = Path(value)
            ok = path.is_dir() if kind == "directory" else path.is_file()
            if not ok:
                found = "does not exist" if not path.exists() else f"is a {'file' if path.is_file() else 'directory'}"
                raise fail(where(name), name, value, f"an existing {kind} ({path} {found})")

    # ------------------------------------------------------------------ output
    def to_dict(self) -> dict[str, Any]:
        """Every option under its flat name: the heads' first (`FLAT_TRAIN_SETTINGS`' order), then the run's — the
        layout of a checkpoint's train_config.yaml, which a resumed run compares (`check_resume_compatible`)."""
        out = {k: v for s in FLAT_TRAIN_SETTINGS for k, v in asdict(self.head_options[_KIND_OF[s]]).items()}
        out.update((n, v) for n, v in asdict(self).items() if n not in ("sources", NESTED))
        return out

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
                f"{self._weights_summary()}, "
                f"≤ {self.max_anchors} anchors/doc"
                + (f", fc noise {self.noise_std} ({self.noise_schedule})" if self.noise_std else ""),
                f"  optimiser   AdamW lr {self.lr}, warmup {self.warmup_ratio}, clip {self.grad_clip}, {stop}{budget}",
                f"  output      {self.out}  (save every {_cadence(self.save_every, self.save_every_minutes)}, "
                f"eval every {_cadence(self.eval_every, self.eval_every_minutes)})",
            ]
        )

    def cpu_sizing_note(self, *, cuda_available: bool) -> str | None:
        """A line for a run on CPU that keeps the paper's GPU-sized batch geometry — `max_tokens` and `max_anchors`
        at their defaults, set neither by the config file nor by an override — where one step can take minutes;
        None when the run is on a GPU or both were chosen."""
        on_cpu = resolve_device(self.drafter_device, cuda_available=cuda_available).type == "cpu"
        unset = [n for n in CPU_SIZED if n not in self.sources]
        if not on_cpu or not unset:
            return None
        kept = ", ".join(f"{n} {getattr(self, n)}" for n in unset)
        sized = " ".join(f"{n}={v}" for n, v in CPU_SIZED.items())
        return (
            f"training on CPU with the GPU-sized default{'s' if len(unset) > 1 else ''} {kept} (the paper's "
            f"batch geometry): one step can take minutes here. configs/smollm2.yaml is sized for a CPU ({sized}); "
            f"or set {' '.join(f'{n}=…' for n in unset)}."
        )

    def _weights_summary(self) -> str:
        if self.position_weights == "dpace":
            return f"D-PACE position weights (α {self.dpace_alpha:g})"
        return f"γ {self.gamma or 'default'}"

    def _topk_summary(self) -> str:
        if self.loss != "topk":
            return ""
        k = f"top-{self.topk}" if self.topk else f"top-{DEFAULT_ONLINE_TOPK}" if self.online else "captured top-k"
        return f" (KL to the target's {k}, renormalised; CE weight {self.topk_ce_weight:g})"


# the batch geometry of configs/smollm2.yaml, the CPU config (tests check the two agree)
CPU_SIZED = {"max_tokens": 1024, "max_anchors": 64}


def apply_overrides(
    raw: dict[str, Any], overrides: list[str] | tuple[str, ...]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Apply `key=value` / `drafter.key=value` strings to a raw config dict (values parsed as YAML); returns the
    new dict and where each overridden option came from."""
    out = dict(raw)
    drafter = out.get("drafter")
    if drafter is not None and not isinstance(drafter, dict):
        drafter = None  # a wrong type stays in `out` for check_fields to name; drafter.KEY adds to a fresh mapping
    drafter = dict(drafter or {})
    sources: dict[str, str] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value (e.g. lr=3e-4 or drafter.block_size=8)")
        key, value = item.split("=", 1)
        key = key.strip()
        where = f"override {item!r}"
        parsed = parse_yaml_value(value, where)
        if key.startswith("drafter."):
            drafter[key.split(".", 1)[1]] = parsed
            out["drafter"] = drafter
        else:
            out[key] = parsed
            if key == "drafter" and isinstance(parsed, dict):
                drafter = dict(parsed)
        sources[key] = where
    return out, sources


def _where(sources: dict[str, str], default: str) -> Callable[[str], str]:
    """Field name (or drafter.KEY) → where its value came from."""
    return lambda name: sources.get(name) or sources.get(name.split(".")[0]) or default


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


__all__ = [
    "CPU_SIZED",
    "DEFAULT_ONLINE_TOPK",
    "RESUME_LOCKED",
    "TrainConfig",
    "apply_overrides",
    "check_resume_compatible",
]
