"""What a plan hands the user: the training YAML, the commands in order, and plan.json / plan.md / train.yaml.

    write_plan(plan, "plans/qwen3-8b")   # → plan.json, plan.md, train.yaml; returns their paths

The YAML is a `TrainConfig` (checked by loading it back before it is written), so the commands run as printed:
prepare (regenerate with the target), capture when the chosen layout is offline, train (torchrun on several GPUs),
eval. A warm start (`from_drafter`) sets `init_from` and fewer epochs, and evaluates the base drafter first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflashkit.io_utils import atomic_write_text
from dflashkit.shell import shell_line

WARM_START_EPOCHS = 2


def _paths(plan: Any) -> dict[str, str]:
    name = plan.name
    return {
        "data": f"data/{name}",
        "tokens": f"data/{name}/tokens.jsonl",
        "features": f"features/{name}",
        "run": f"runs/{name}",
        "eval": f"eval/{name}",
    }


def _offline(plan: Any) -> bool:
    choice = plan.sections.get("memory", {}).get("_choice")
    return bool(choice) and not choice[1]


def plan_yaml(plan: Any) -> dict[str, Any]:
    """The training config of the plan (every value a `TrainConfig` field)."""
    req, cfg, paths = plan.request, plan.drafter, _paths(plan)
    memory = plan.sections["memory"]
    choice = memory.get("_choice") or ("online", True, "single")
    drafter = {
        k: v
        for k, v in plan.sections["drafter"]["config"].items()
        if k not in ("hidden_size", "vocab_size", "num_target_layers")
    }
    if drafter.get("layer_types") == ["full_attention"] * cfg.num_hidden_layers:
        drafter.pop("layer_types")
    if "layer_types" not in drafter:
        drafter.pop("sliding_window", None)
    if req.from_drafter:
        drafter = {}  # init_from brings its own config
    out: dict[str, Any] = {"target": req.target}
    if req.trust_remote_code:
        out["trust_remote_code"] = True
    if choice[1]:
        out.update(tokens=paths["tokens"], online=True)
    else:
        out.update(features=paths["features"], online=False)
    out.update(out=paths["run"], drafter=drafter)
    if req.from_drafter:
        out["init_from"] = req.from_drafter
    out.update(
        max_tokens=req.seq_len,
        batch_rows=1,
        grad_accum=1 if plan.request.hardware.count > 1 else 4,
        max_anchors=int(memory["max_anchors"]["value"]),
        loss="ce",
        lr=6.0e-4 if not req.from_drafter else 3.0e-4,
        warmup_ratio=0.04,
        grad_clip=1.0,
        epochs=req.epochs or (WARM_START_EPOCHS if req.from_drafter else 6),
        fsdp=choice[2] == "fsdp",
        val_fraction=0.01,
        save_every=1000,
        dtype="auto",
    )
    return out


def plan_commands(plan: Any) -> list[tuple[str, str]]:
    """(what it does, the command) in the order to run them; on GPUs every step runs on them (vLLM data parallel
    over the GPUs, torchrun for capture and training). Every argument is quoted for the shell (`shell_line`)."""
    req, paths, hw = plan.request, _paths(plan), plan.request.hardware
    n = int(plan.sections["data"]["samples"]["value"])
    data = str(plan.sections["data"]["conversations"]["value"]).removesuffix(" (yours)")
    device = ["--device", "cuda"] if hw.count else []
    remote = ["--trust-remote-code"] if req.trust_remote_code else []
    thinking = ["--thinking", "off"] if thinking_template(req.target) else []
    target = ["--target", req.target]
    out: list[tuple[str, str]] = []
    if req.from_drafter:
        out.append(
            (
                "how much the base model's drafter accepts on the fine-tune (the number to beat)",
                shell_line(
                    "dflashkit", "eval", *target, *device, *remote, "--drafter", f"base={req.from_drafter}",
                    "--dataset", "mtbench", "--limit", 20, *thinking, "--out", f"{paths['eval']}-base",
                ),
            )
        )  # fmt: skip
    server: list[str | int] = []
    if hw.count:
        parallel = ["--data-parallel-size", hw.count] if hw.count > 1 else []
        out.append(
            (
                "serve the target for regeneration on every GPU (or SGLang; docs/data.md)",
                shell_line("vllm", "serve", req.target, "--port", 8000, *parallel, *remote),
            )
        )
        server = ["--server", "http://127.0.0.1:8000", "--concurrency", 256]
    out.append(
        (
            "regenerate the replies with the target and tokenise them",
            shell_line(
                "dflashkit", "prepare", *target, *remote, "--data", data, "--limit", n, "--max-new-tokens",
                req.max_new_tokens, "--out", paths["data"], *thinking, *server,
            ),
        )
    )  # fmt: skip
    launch = ["torchrun", "--standalone", "--nproc_per_node", hw.count, "-m", "dflashkit"] if hw.count > 1 else []
    launch = launch or ["dflashkit"]
    if _offline(plan):
        from dflashkit.drafter.capture_needs import capture_layer_ids

        ids = ",".join(str(i) for i in capture_layer_ids(plan.drafter))
        out.append(
            (
                "capture the target's features once (the layout chosen is offline)",
                shell_line(
                    *launch, "capture", *target, *device, *remote, "--tokens", paths["tokens"], "--out",
                    paths["features"], "--layer-ids", ids, "--dtype", "bf16",
                ),
            )
        )  # fmt: skip
    out.append(("train the drafter (re-running resumes)", shell_line(*launch, "train", Path(req.out) / "train.yaml")))
    out.append(
        (
            "measure it: τ per category, speedup, greedy equality",
            shell_line(
                "dflashkit", "eval", *target, *device, *remote, "--drafter", f"{plan.name}={paths['run']}/final",
                "--dataset", "mtbench", *thinking, "--out", paths["eval"],
            ),
        )
    )  # fmt: skip
    return out


def thinking_template(target: str) -> bool:
    """Whether the target directory's chat template has a thinking switch (`enable_thinking`)."""
    path = Path(target)
    directory = path.parent if path.name == "config.json" else path
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        file = directory / name
        if file.is_file() and "enable_thinking" in file.read_text(encoding="utf-8", errors="replace"):
            return True
    return False


def _fmt(fig: Any) -> str:
    if isinstance(fig, dict) and "basis" in fig:
        value = fig["value"]
        if isinstance(value, float):
            text = f"{value:,.1f}" if abs(value) >= 100 else f"{value:,.3g}"
        else:
            text = f"{value:,}" if isinstance(value, int) else str(value)
        unit = f" {fig['unit']}" if fig.get("unit") else ""
        why = f" — {fig['why']}" if fig.get("why") else ""
        return f"{text}{unit} *({fig['basis']}{why})*"
    return str(fig)


def render_markdown(plan: Any) -> str:
    """plan.md: every section as a table of figures with their basis, then the YAML and the commands."""
    import yaml

    req = plan.request
    lines = [
        f"# Plan: a DFlash drafter for {req.target}",
        "",
        f"Hardware: {req.hardware.describe()}. Every figure says its basis: *computed* (from config.json and "
        f"dflashkit's code), *assumed* (the assumption named), *measured* (on this machine), *given* (by you).",
        "",
    ]
    for title, section in plan.sections.items():
        lines += [f"## {title.capitalize()}", "", "| | |", "| --- | --- |"]
        for key, value in section.items():
            if key.startswith("_"):
                continue
            if key == "layouts":
                for name, lay in value.items():
                    mark = "fits" if lay["fits"] else "does not fit"
                    parts = ", ".join(f"{k} {v:g}" for k, v in lay["parts GiB"].items())
                    lines.append(f"| {name} | {lay['peak GiB']:g} GiB per device, {mark} *(computed: {parts})* |")
                continue
            if key == "why":
                value = "; ".join(value)
            cell = _fmt(value).replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {key} | {cell} |")
        lines.append("")
    lines += ["## Training config (train.yaml)", "", "```yaml", yaml.safe_dump(plan.yaml, sort_keys=False).rstrip()]
    lines += ["```", "", "## Commands", ""]
    for i, (what, cmd) in enumerate(plan.commands, 1):
        lines += [f"{i}. {what}:", "", "   ```bash", f"   {cmd}", "   ```", ""]
    return "\n".join(lines)


def summary(plan: Any, paths: dict[str, Path]) -> str:
    """The terminal view: the drafter, data, memory per layout, time, then the commands and the files written."""
    t, d, mem, tm = plan.target, plan.drafter, plan.sections["memory"], plan.sections["time"]
    data = plan.sections["data"]
    lines = [
        f"target    {t.architecture}: {t.num_layers} layers, hidden {t.hidden_size}, vocab {t.vocab_size:,}, "
        f"{t.num_parameters / 1e9:.2f} B parameters ({t.source})",
        f"hardware  {plan.request.hardware.describe()}",
        f"drafter   {d.kind}: {d.num_hidden_layers} layers, {d.num_attention_heads} heads × {d.head_dim} "
        f"({d.num_key_value_heads} KV), MLP {d.intermediate_size}, block {d.block_size}, target layers "
        f"{d.target_layer_ids}, {plan.sections['drafter']['parameters']['value'] / 1e6:,.1f} M parameters",
        f"data      {data['samples']['value']:,} samples ({data['samples']['basis']}), "
        f"~{data['tokens']['value'] / 1e6:,.1f} M tokens; regeneration ~{data['regeneration time']['value']:g} h",
    ]
    disk = plan.sections["disk"]["offline capture, bf16"]["value"]
    lines.append(f"disk      offline capture (bf16): {disk:,.1f} GB; online: none")
    for name, lay in mem["layouts"].items():
        lines.append(f"memory    {name:<15} {lay['peak GiB']:8.2f} GiB per device  {'fits' if lay['fits'] else '-'}")
    chosen = mem["chosen"] or "none fits: fewer anchors, shorter rows or more memory"
    lines.append(f"chosen    {chosen} (max_anchors {mem['max_anchors']['value']})")
    lines.append(
        f"time      {tm['seconds per micro-batch']['value']:g} s per micro-batch, {tm['steps per epoch']['value']:,} "
        f"steps per epoch, ~{tm['training hours']['value']:g} h for {tm['epochs']['value']} epochs "
        f"({tm['rate']['why']})"
    )
    lines += ["", "commands:"]
    lines += [f"  # {what}\n  {cmd}" for what, cmd in plan.commands]
    lines += ["", "written: " + ", ".join(str(p) for p in paths.values())]
    return "\n".join(lines)


def plan_json(plan: Any) -> dict[str, Any]:
    sections = {k: {n: v for n, v in s.items() if not n.startswith("_")} for k, s in plan.sections.items()}
    return {
        "format": "dflashkit.plan/1",
        "request": {
            **{k: v for k, v in plan.request.__dict__.items() if k != "hardware"},
            "hardware": plan.request.hardware.__dict__,
        },
        "sections": sections,
        "train_yaml": plan.yaml,
        "commands": [{"what": w, "command": c} for w, c in plan.commands],
    }


def write_plan(plan: Any, out_dir: str | Path) -> dict[str, Path]:
    """Write plan.json, plan.md and train.yaml (loaded back as a TrainConfig first) into `out_dir`."""
    import yaml

    from dflashkit.train.config import TrainConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(plan.yaml, sort_keys=False)
    paths = {"yaml": out / "train.yaml", "json": out / "plan.json", "md": out / "plan.md"}
    atomic_write_text(paths["yaml"], text)
    TrainConfig.load(str(paths["yaml"]), []).validate()  # the YAML is a config train accepts
    atomic_write_text(paths["json"], json.dumps(plan_json(plan), indent=2, default=str) + "\n")
    atomic_write_text(paths["md"], render_markdown(plan) + "\n")
    return paths


__all__ = ["plan_commands", "plan_json", "plan_yaml", "render_markdown", "summary", "write_plan"]
