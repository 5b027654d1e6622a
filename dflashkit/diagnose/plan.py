"""A recipe and a budget for a target and its hardware, before a run: `make_plan(request)` → `Plan`.

    plan = make_plan(PlanRequest(target="/models/Qwen3-8B", hardware=Hardware.parse("8xH100")))
    plan.sections["memory"]      # per-GPU peak of each layout (online / offline × DDP / FSDP) and the one chosen
    write_plan(plan, "plans/qwen3-8b")   # plan.json, plan.md, train.yaml (dflashkit.diagnose.plan_files)

Everything comes from the target's config.json (the text model built on fake tensors, no weights read) and the
models of dflashkit's own stages — the drafter dflashkit builds (`DrafterConfig.for_target`), what capture writes
(`features.footprint`), the memory of a training step (`train.memory`), its FLOPs and a rate (`train.step_cost`).
Every figure carries its basis: "computed" (from the config and the code), "assumed" (a stated assumption) or
"measured" (on this machine: `calibrate=True`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads import HEADS
from dflashkit.errors import ConfigError
from dflashkit.train.memory_check import HEADROOM

# Regenerated samples of the public recipes: the DFlash paper trained its Qwen3 drafters on ~800k; the public
# small-target recipes (SpecForge, speculators examples on ShareGPT/UltraChat-size sets) use ~100k.
PAPER_SAMPLES = 800_000
SMALL_TARGET_SAMPLES = 100_000
LARGE_TARGET_PARAMETERS = 7e9
# A regenerated conversation's tokens (prompt + reply) and the reply's share: ShareGPT-like chats at
# max_new_tokens 2048 (assumed; `avg_tokens` / `supervised_fraction` change them).
AVG_TOKENS = 1_000
SUPERVISED_FRACTION = 0.6
# Batch serving throughput of vLLM / SGLang for an 8B target on one H100-class GPU (assumed), scaled by
# 8B / active parameters; on a CPU the in-process HF generate (SmolLM2-135M: ~11 tokens/s on 2 cores).
SERVER_TOKENS_PER_S_8B = 2_000.0
CPU_TOKENS_PER_S_135M = 11.0
# Targets whose context reaches this far get z-lab's Qwen3.6 drafter layout: sliding-window layers but the last.
LONG_CONTEXT = 131_072
DRAFTER_WINDOW = 2048
# A CPU run's sizes (configs/smollm2.yaml, docs/pipeline.md "Sizing a run for a CPU"; the quickstart's data).
CPU_SIZES = {"seq_len": 1024, "max_anchors": 64, "avg_tokens": 400, "max_new_tokens": 192, "samples": 500}
GPU_SIZES = {"seq_len": 3072, "max_anchors": 512, "avg_tokens": AVG_TOKENS, "max_new_tokens": 2048}
# The built-in conversations (`prepare --data sharegpt`): larger plans name a JSONL file of the user's.
SHAREGPT_CONVERSATIONS = 17_000
# An assumed CPU rate when the plan is not calibrated (FLOP/s for the whole machine).
CPU_ASSUMED_FLOPS = 50e9


@dataclass(frozen=True)
class Hardware:
    """GPUs (`count` × `gpu`, `gpu_mem_gib` each), or this machine's CPU (`count` 0)."""

    count: int = 0
    gpu: str | None = None
    gpu_mem_gib: float | None = None

    @classmethod
    def parse(cls, spec: str | None, gpu_mem_gib: float | None = None) -> Hardware:
        """ "8xH100", "H200", "2xA100" (GPUS names), or None: this CPU. `gpu_mem_gib` overrides the memory."""
        from dflashkit.train.step_cost import GPUS

        if not spec:
            if gpu_mem_gib is not None:
                return cls(count=1, gpu=None, gpu_mem_gib=gpu_mem_gib)
            return cls()
        m = re.fullmatch(r"(?:(\d+)\s*[x×]\s*)?([A-Za-z0-9]+)", spec.strip())
        name = m.group(2).upper() if m else ""
        if not m or name not in GPUS or (m.group(1) is not None and int(m.group(1)) < 1):
            raise ConfigError(
                f"--gpus {spec!r}: expected N×NAME (e.g. 8xH100) with NAME one of {', '.join(GPUS)} "
                f"(another GPU: --gpu-mem GiB, with --gpus 1xH100 for its speed class)"
            )
        count = int(m.group(1) or 1)
        return cls(count=count, gpu=name, gpu_mem_gib=gpu_mem_gib if gpu_mem_gib else GPUS[name][1])

    @property
    def device(self) -> str:
        return "cuda" if self.count else "cpu"

    def describe(self) -> str:
        if not self.count:
            from dflashkit.cpu_products.machine import machine_line

            return f"this machine's CPU ({machine_line()})"
        return f"{self.count} × {self.gpu or 'GPU'} ({self.gpu_mem_gib:g} GiB each)"


@dataclass(frozen=True)
class PlanRequest:
    """What a plan is asked for: the target, the hardware and the run's main choices (None: the plan picks)."""

    target: str
    hardware: Hardware = field(default_factory=Hardware)
    samples: int | None = None
    seq_len: int | None = None  # tokens per packed row: 3072 on GPUs (the paper), 1024 on a CPU
    kind: str = "dflash"
    from_drafter: str | None = None
    avg_tokens: int | None = None  # tokens per regenerated conversation (assumed 1,000; a CPU plan's 400)
    gen_tokens_per_s: float | None = None
    max_new_tokens: int | None = None  # the reply cap for regeneration (a CPU plan: the quickstart's 192)
    max_anchors: int | None = None  # blocks per document: 512 on GPUs (the paper), 64 on a CPU
    epochs: int | None = None
    calibrate: bool = False
    data: str | None = None  # prepare's --data (default: sharegpt when it holds enough conversations)
    trust_remote_code: bool = False
    name: str | None = None  # the run's name in paths (default: the target directory's name)
    out: str = "plan"  # where plan.json, plan.md and train.yaml go (the commands name train.yaml there)


@dataclass
class Plan:
    request: PlanRequest
    target: Any  # TargetShape
    drafter: DrafterConfig
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    yaml: dict[str, Any] = field(default_factory=dict)
    commands: list[tuple[str, str]] = field(default_factory=list)  # (what it does, the command)

    @property
    def name(self) -> str:
        if self.request.name:
            return self.request.name
        if self.request.target == "default":
            return "smollm2"
        path = Path(self.request.target)
        stem = path.parent.name if path.name == "config.json" else path.name
        return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-").lower() or "target"


def figure(value: Any, basis: str, why: str = "", unit: str = "") -> dict[str, Any]:
    """One figure of a plan: its value, unit, basis ("computed", "assumed", "measured") and why."""
    return {"value": value, "unit": unit, "basis": basis, "why": why}


# ---------------------------------------------------------------------------------------------- drafter
def plan_drafter(shape: Any, request: PlanRequest) -> tuple[DrafterConfig, list[str]]:
    """The drafter for `shape` and the rules that chose it (or `from_drafter`'s own config, checked to fit)."""
    if request.from_drafter:
        return _base_drafter(shape, request.from_drafter)
    if request.kind not in HEADS:
        raise ConfigError(f"--kind {request.kind!r}: expected one of {', '.join(HEADS)}")
    small = shape.hidden_size < 1024
    overrides: dict[str, Any] = {"kind": request.kind, "num_hidden_layers": 5, "block_size": 16}
    why = [
        "5 layers, block size 16: z-lab's published drafters (the DFlash paper: 5 layers beat 3)",
        "target layer ids round(1 + j·(L−4)/(K−1)), K = 5: z-lab's rule (layers 1 … L−3)",
    ]
    if shape.hidden_size >= 2048:
        why.append(
            "32 heads × 128, 8 KV heads, the target's MLP width: z-lab's drafters for Qwen3-8B and Qwen3.6-27B "
            "(the drafter's own attention geometry, never the target's)"
        )
    else:
        why.append(
            f"{'8 × 64 (4 KV)' if small else '16 × 128 (4 KV)'} heads, MLP 3 × hidden: dflashkit's geometry for "
            f"hidden {shape.hidden_size} (drafter/config.py default_geometry)"
        )
    if (shape.max_position_embeddings or 0) >= LONG_CONTEXT:
        n = overrides["num_hidden_layers"]
        overrides["layer_types"] = ["sliding_attention"] * (n - 1) + ["full_attention"]
        overrides["sliding_window"] = DRAFTER_WINDOW
        why.append(
            f"sliding window {DRAFTER_WINDOW} on all layers but the last: a long-context target "
            f"({shape.max_position_embeddings:,} positions), z-lab's Qwen3.6-27B drafter layout (docs/studies.md "
            f'"Context length")'
        )
    cfg = DrafterConfig.for_target(
        hidden_size=shape.hidden_size,
        vocab_size=shape.vocab_size,
        num_target_layers=shape.num_layers,
        target_intermediate_size=shape.intermediate_size,
        mask_token_id=0,  # placeholder: the real choice needs the tokenizer (made when the drafter is built)
        **overrides,
    )
    cfg.validate()
    return cfg, why


def _base_drafter(shape: Any, path: str) -> tuple[DrafterConfig, list[str]]:
    from dflashkit.drafter.checkpoint import load_config

    cfg = load_config(path)
    for name, want in (
        ("hidden_size", shape.hidden_size),
        ("vocab_size", shape.vocab_size),
        ("num_target_layers", shape.num_layers),
    ):
        if getattr(cfg, name) != want:
            raise ConfigError(
                f"--from-drafter {path}: its {name} is {getattr(cfg, name)} but the target's is {want}; a warm start "
                f"needs a drafter of the same base model"
            )
    return cfg, [f"the geometry of {path} (warm start: init_from keeps every weight's shape)"]


# ---------------------------------------------------------------------------------------------- data
def plan_data(shape: Any, request: PlanRequest) -> dict[str, Any]:
    """Samples, tokens, regeneration time and the thinking mode."""
    hw = request.hardware
    large = shape.num_parameters >= LARGE_TARGET_PARAMETERS
    if request.samples:
        samples = figure(request.samples, "given")
    elif request.from_drafter:
        samples = figure(
            SMALL_TARGET_SAMPLES // 2, "assumed",
            "a warm start from the base model's drafter: regenerate a smaller set with the fine-tune",
        )  # fmt: skip
    elif not hw.count:
        samples = figure(
            CPU_SIZES["samples"], "assumed",
            "a CPU run's scale (the quickstart's): regeneration in process runs at a few tokens per second",
        )  # fmt: skip
    elif large:
        samples = figure(PAPER_SAMPLES, "assumed", "the DFlash paper's ~800k regenerated samples (Qwen3 drafters)")
    else:
        samples = figure(
            SMALL_TARGET_SAMPLES, "assumed", "~100k: the public recipes for small targets (ShareGPT-size sets)"
        )
    n = int(samples["value"])
    tokens = n * request.avg_tokens
    reply = tokens * SUPERVISED_FRACTION
    active = max(shape.num_active_parameters, 1)
    if request.gen_tokens_per_s:
        rate = figure(request.gen_tokens_per_s, "given", unit="tokens/s per GPU" if hw.count else "tokens/s")
    elif hw.count:
        rate = figure(
            round(min(20_000.0, max(100.0, SERVER_TOKENS_PER_S_8B * 8e9 / active))), "assumed",
            f"vLLM / SGLang batch serving: ~{SERVER_TOKENS_PER_S_8B:,.0f} tokens/s per GPU for an 8B target, "
            f"scaled by 8B / active parameters", "tokens/s per GPU",
        )  # fmt: skip
    else:
        rate = figure(
            round(CPU_TOKENS_PER_S_135M * 135e6 / active, 2), "assumed",
            "in-process generation on this CPU: SmolLM2-135M ~11 tokens/s, scaled by 135M / active parameters",
            "tokens/s",
        )  # fmt: skip
    hours = reply / (float(rate["value"]) * max(hw.count, 1)) / 3600
    data = request.data or ("sharegpt" if n <= SHAREGPT_CONVERSATIONS else None)
    source = (
        figure(data, "given" if request.data else "rule", "prepare --data")
        if data
        else figure(
            "conversations.jsonl (yours)",
            "rule",
            f"the built-in ShareGPT holds ~{SHAREGPT_CONVERSATIONS:,} conversations, fewer than {n:,}: pass "
            "--data FILE.jsonl (docs/data.md)",
        )
    )
    return {
        "conversations": source,
        "samples": samples,
        "tokens": figure(tokens, "assumed", f"{request.avg_tokens:,} tokens per regenerated conversation", "tokens"),
        "reply tokens": figure(round(reply), "assumed", f"{SUPERVISED_FRACTION:.0%} of them the target's reply"),
        "regeneration rate": rate,
        "regeneration time": figure(round(hours, 2), "computed", "reply tokens / rate / GPUs", "hours"),
        "thinking": figure(
            "off unless you serve with thinking on",
            "rule",
            "train in the mode you serve: a drafter trained without <think> accepts little with it, and the other "
            'way round (docs/data.md "Thinking mode")',
        ),
    }


# ---------------------------------------------------------------------------------------------- memory, time
def blocks_per_row(request: PlanRequest, max_anchors: int) -> int:
    """Blocks of a typical packed row: documents per row × min(max_anchors, a document's reply tokens)."""
    docs = max(1, request.seq_len // max(1, request.avg_tokens))
    per_doc = min(max_anchors, max(1, int(min(request.avg_tokens, request.seq_len) * SUPERVISED_FRACTION) - 1))
    return min(docs * per_doc, request.seq_len - 1)


def layouts(hw: Hardware) -> list[tuple[str, bool, str]]:
    """(name, online, parallel layout) of the layouts worth comparing on `hw`, in order of preference."""
    if hw.count <= 1:
        return [("online", True, "single"), ("offline", False, "single")]
    return [
        ("online, DDP", True, "ddp"),
        ("online, FSDP", True, "fsdp"),
        ("offline, DDP", False, "ddp"),
        ("offline, FSDP", False, "fsdp"),
    ]


def plan_memory(plan: Plan, max_anchors: int) -> dict[str, Any]:
    """Per-device peak of a training step for every layout, which fit, and the one chosen."""
    from dflashkit.train.memory import MemorySettings, StepShape, step_memory
    from dflashkit.validation import memory_available

    hw, request = plan.request.hardware, plan.request
    shape = StepShape(rows=1, tokens=request.seq_len, blocks=blocks_per_row(request, max_anchors))
    budget = hw.gpu_mem_gib * 2**30 if hw.count else float(memory_available())
    out: dict[str, Any] = {
        "step shape": figure(
            dict(
                rows=shape.rows,
                tokens=shape.tokens,
                blocks=shape.blocks,
                queries=shape.blocks * plan.drafter.block_size,
            ),
            "computed",
            f"a packed row of {request.seq_len} tokens, max_anchors {max_anchors} per document",
        ),
        "device memory": figure(round(budget / 2**30, 1), "given" if hw.count else "measured", unit="GiB"),
        "layouts": {},
    }
    chosen = None
    for name, online, layout in layouts(hw):
        settings = MemorySettings(
            device=hw.device, layout=layout, world=max(hw.count, 1), online=online,
            target_dtype_bytes=2 if hw.count else 4,
        )  # fmt: skip
        est = step_memory(plan.drafter, plan.target, shape, settings)
        capture = None if online else _capture_peak(plan, hw)
        fits = est.peak <= budget * (1 - HEADROOM) and (capture is None or capture <= budget * (1 - HEADROOM))
        out["layouts"][name] = {
            "peak GiB": round(est.peak / 2**30, 2),
            "fits": fits,
            "parts GiB": {k: round(v / 2**30, 3) for k, v in {**est.parts, **est.phases}.items()},
            "basis": "computed",
        }
        if capture is not None:
            out["layouts"][name]["parts GiB"]["capture (its own run)"] = round(capture / 2**30, 3)
        if fits and chosen is None:
            chosen = (name, online, layout)
    out["chosen"] = chosen[0] if chosen else None
    out["_choice"] = chosen
    out["_shape"] = shape
    return out


def _capture_peak(plan: Plan, hw: Hardware) -> int:
    """The device's peak while capture runs the target over a row-long sample (offline features need it once)."""
    from dflashkit.drafter.capture_needs import capture_layer_ids
    from dflashkit.features.capture import CaptureSettings
    from dflashkit.features.footprint import capture_memory

    settings = CaptureSettings(layer_ids=tuple(capture_layer_ids(plan.drafter)), dtype="bf16")
    mem = capture_memory(plan.target, settings=settings, tokens=plan.request.seq_len, dtype_bytes=2 if hw.count else 4)
    return mem.device if hw.count else mem.peak


def fitting_anchors(plan: Plan) -> int | None:
    """The largest max_anchors (512, 256, … 16) whose step fits some layout, or None."""
    anchors = int(plan.request.max_anchors or 512)
    while anchors >= 16:
        if plan_memory(plan, anchors)["chosen"]:
            return anchors
        anchors //= 2
    return None


def plan_time(plan: Plan, memory: dict[str, Any], rate: Any) -> dict[str, Any]:
    """Steps, step time and hours per epoch for the chosen layout; capture time when offline."""
    from dflashkit.train.step_cost import step_cost, target_forward_flops

    request, hw = plan.request, plan.request.hardware
    choice = memory["_choice"]
    online = bool(choice and choice[1])
    shape = memory["_shape"]
    visible = None
    if hw.count:  # flex attention skips masked blocks: a query sees its document's context before it, its block
        visible = (1 - SUPERVISED_FRACTION / 2) * min(request.avg_tokens, request.seq_len) + plan.drafter.block_size
    cost = step_cost(plan.drafter, plan.target, shape, online=online, visible_keys=visible)
    step_s = rate.seconds(cost)
    basis, why = rate.source.split(": ", 1)
    tokens = int(plan.sections["data"]["tokens"]["value"])
    world = max(hw.count, 1)
    grad_accum = plan.yaml.get("grad_accum", 1)
    rows = math.ceil(tokens / (request.seq_len * 0.95))  # packing fills ~95 % of a row
    steps = math.ceil(rows / (world * grad_accum))
    epochs = int(plan.yaml.get("epochs", 6))
    out = {
        "rate": figure(round(rate.flops_per_s / 1e12, 3), basis, why, "TFLOP/s"),
        "target forward rate": figure(
            round((rate.forward_flops_per_s or rate.flops_per_s) / 1e12, 3),
            basis,
            "the target's own forward" if rate.forward_flops_per_s else "the step's rate",
            "TFLOP/s",
        ),
        "FLOPs per micro-batch": figure(
            {k: f"{v:.3g}" for k, v in cost.flops.items()}, "computed", "drafter traced on fake tensors"
        ),
        "seconds per micro-batch": figure(round(step_s, 3), basis, why, "s"),
        "steps per epoch": figure(
            steps, "computed", f"{rows:,} packed rows / ({world} ranks × {grad_accum} micro-batches)"
        ),
        "hours per epoch": figure(round(steps * grad_accum * step_s / 3600, 2), "computed", unit="hours"),
        "epochs": figure(epochs, "given")
        if request.epochs
        else figure(epochs, "rule", "the paper's 6 (2 for a warm start)"),
    }
    out["training hours"] = figure(round(epochs * out["hours per epoch"]["value"], 2), "computed", unit="hours")
    if not online:
        samples = int(plan.sections["data"]["samples"]["value"])
        fwd = target_forward_flops(plan.target, samples, request.avg_tokens)
        rate_fwd = rate.forward_flops_per_s or rate.flops_per_s
        out["capture hours"] = figure(
            round(fwd / (rate_fwd * world) / 3600, 2), "computed",
            f"the target's forward over every token once, {world} process(es) (torchrun splits the shards)", "hours",
        )  # fmt: skip
    return out


def _rate(plan: Plan) -> Any:
    from dflashkit.train.step_cost import Rate, gpu_rate

    hw = plan.request.hardware
    if hw.count:
        return gpu_rate(hw.gpu or "H100")
    if plan.request.calibrate:
        rate, records = calibrate_for(plan)
        plan.sections["calibration"] = {"records": records, "source": rate.source}
        return rate
    return Rate(
        flops_per_s=CPU_ASSUMED_FLOPS, source=f"assumed: {CPU_ASSUMED_FLOPS / 1e9:.0f} GFLOP/s (run --calibrate)"
    )


def calibrate_for(plan: Plan) -> tuple[Any, list[dict[str, Any]]]:
    """This CPU's rates from real steps of the plan's drafter at its own row (and at half of it), and from the
    target's forward when its weights are here (a CPU plan trains where the target is)."""
    from dflashkit.train.memory import StepShape
    from dflashkit.train.step_cost import calibrate

    full = plan.sections["memory"]["_shape"]
    half = StepShape(rows=1, tokens=max(64, full.tokens // 2), blocks=max(1, full.blocks // 2))
    target = None
    if _has_weights(plan.request.target):
        from dflashkit.target.model import Target

        target = Target.load(plan.request.target, trust_remote_code=plan.request.trust_remote_code)
    return calibrate(plan.drafter, [half, full], target=target, target_shape=plan.target)


def _has_weights(target: str) -> bool:
    if target == "default":
        return True
    path = Path(target)
    directory = path.parent if path.name == "config.json" else path
    return any(directory.glob("*.safetensors")) or any(directory.glob("*.bin"))


# ---------------------------------------------------------------------------------------------- the plan
def resolved(request: PlanRequest) -> PlanRequest:
    """`request` with the sizes it left open set for its hardware (GPU_SIZES, or CPU_SIZES on this machine)."""
    sizes = GPU_SIZES if request.hardware.count else CPU_SIZES
    out = replace(request, **{k: v for k, v in sizes.items() if k != "samples" and getattr(request, k) is None})
    if out.seq_len < 64:
        raise ConfigError(f"--seq-len {out.seq_len}: expected at least 64 tokens per packed row")
    if out.from_drafter and out.kind != PlanRequest.kind:  # a kind asked for beside a base drafter
        raise ConfigError(
            f"--kind {out.kind} with --from-drafter: a warm start keeps the base drafter's kind (drop --kind)"
        )
    return out


def make_plan(request: PlanRequest) -> Plan:
    """The whole plan: target, drafter, data, features (disk, memory), time, training YAML and commands."""
    from dflashkit.diagnose.plan_files import plan_commands, plan_yaml
    from dflashkit.drafter.capture_needs import capture_layer_ids
    from dflashkit.features.footprint import token_bytes
    from dflashkit.target.shape import read_target_shape
    from dflashkit.train.memory import drafter_parameters

    request = resolved(request)
    shape = read_target_shape(request.target, trust_remote_code=request.trust_remote_code)
    cfg, why = plan_drafter(shape, request)
    plan = Plan(request=request, target=shape, drafter=cfg)
    plan.sections["target"] = _target_section(shape)
    plan.sections["drafter"] = {
        "config": {k: getattr(cfg, k) for k in _DRAFTER_FIELDS if getattr(cfg, k, None) is not None},
        "parameters": figure(drafter_parameters(cfg), "computed", "built on the meta device"),
        "why": why,
        "draft vocabulary": figure(
            cfg.draft_vocab_size or shape.vocab_size,
            "given" if cfg.draft_vocab_size else "rule",
            "the base drafter's"
            if cfg.draft_vocab_size
            else "the target's whole vocabulary; a reduced one (the N most "
            "frequent reply tokens) is built from the data: `dflashkit init-drafter OUT draft_vocab_size=N "
            "--draft-vocab-from data/…/tokens.jsonl`, then `init_from: OUT` (docs/drafters.md; it pays most on a CPU: "
            'docs/studies.md "Draft vocabulary")',
            "tokens",
        ),
        "mask token": figure(
            "chosen when the drafter is built",
            "rule",
            "a spare embedding row when the target has one (z-lab), else an unused special token, else a learned "
            "vector (docs/drafters.md)",
        ),
    }
    plan.sections["data"] = plan_data(shape, request)
    tokens = int(plan.sections["data"]["tokens"]["value"])
    per_token = {
        d: token_bytes(hidden_size=shape.hidden_size, num_layers=len(capture_layer_ids(cfg)), dtype=d).total
        for d in ("bf16", "fp32")
    }
    disk = {
        f"offline capture, {dtype}": figure(
            round(n * tokens / 1e9, 1),
            "computed",
            f'{n:,} bytes per token × {tokens:,} tokens (docs/data.md "Offline or online features")',
            "GB",
        )
        for dtype, n in per_token.items()
    }
    disk["online features"] = figure(0, "rule", "nothing stored: the target runs in every step", "GB")
    anchors = fitting_anchors(plan) or request.max_anchors
    memory = plan_memory(plan, anchors)
    memory["max_anchors"] = figure(
        anchors, "computed" if anchors != request.max_anchors else "rule",
        "the largest power of two whose step fits" if anchors != request.max_anchors
        else ("the paper's 512 per document" if request.hardware.count else "a CPU run's 64 (docs/pipeline.md)"),
    )  # fmt: skip
    plan.sections["memory"] = memory
    plan.sections["disk"] = disk
    plan.yaml = plan_yaml(plan)
    plan.sections["time"] = plan_time(plan, memory, _rate(plan))
    plan.commands = plan_commands(plan)
    return plan


_DRAFTER_FIELDS = (
    "kind", "num_hidden_layers", "block_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "target_layer_ids", "layer_types", "sliding_window", "hidden_size", "vocab_size",
    "num_target_layers",
)  # fmt: skip


def _target_section(shape: Any) -> dict[str, Any]:
    fields_ = (
        "architecture", "model_type", "hidden_size", "num_layers", "vocab_size", "intermediate_size",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "num_experts",
        "experts_per_token", "vision_language", "dtype",
    )  # fmt: skip
    out: dict[str, Any] = {name: getattr(shape, name) for name in fields_}
    kinds = sorted(set(shape.layer_types))
    out["layer types"] = {k: shape.layer_types.count(k) for k in kinds}
    out["parameters"] = figure(shape.num_parameters, "computed", "the text model built on the meta device")
    out["active parameters"] = figure(shape.num_active_parameters, "computed", "per token")
    out["source"] = shape.source
    return out


__all__ = ["Hardware", "Plan", "PlanRequest", "blocks_per_row", "figure", "make_plan", "plan_drafter"]
