"""Model cards: the README.md every export writes beside the drafter's weights, as drafters published on model hubs
carry one — YAML front matter (`base_model`, `library_name`, `tags`), then what the drafter is, how it was trained,
the τ dflashkit measured and on what, and the exact commands that serve it and check the deployment.

    note = write_model_card(ModelCard(out=Path("export/vllm"), layout="vllm", cfg=cfg, source=Path("runs/x/final"),
                                      target="/models/Qwen3-8B"))          # "model card: export/vllm/README.md"
    evals = measured_in(["runs/eval"], drafter_fingerprints([cfg], [tensors]))   # `convert --eval DIR`

Only what is recorded is written: the target as named at export (else in the `eval` results or the run's
train_config.yaml) and its architecture from config.json `extra`; the recipe from `extra` (data, longest training
context, warm start), the weights' `step` metadata and the run's train_config.yaml; τ from `eval` / `simulate`
results whose drafter fingerprint is this drafter's. What each engine does with the layout comes from
export/engines.py and the head's facts (llama.cpp's `--spec-type`, drafts a round); nothing branches on a kind.

Where the card goes: `README.md` beside the weights (inside an exported directory; in a GGUF file's directory)
unless a README.md there is not this output's own card (a user's README, another GGUF's card): then
`NAME.README.md` beside it (NAME: the GGUF file's stem, or the directory's name). A re-export rewrites its own card.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from dflashkit.drafter.checkpoint import CONFIG_NAME, WEIGHTS_NAME, load_config, weight_files
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads import head_of
from dflashkit.errors import ConfigError, TargetError
from dflashkit.export.engines import EngineVerdict, engine_verdicts
from dflashkit.export.serving import SERVING_FORMAT
from dflashkit.io_utils import atomic_write_text
from dflashkit.shell import shell_line

CARD_NAME = "README.md"
MARK = "<!-- dflashkit model card of {name} -->"  # a card dflashkit wrote (and may rewrite) for output NAME
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the embedded default target, as the hub names it
# layout → (front matter library_name, what the card calls it)
LAYOUTS = {
    "zlab": ("sglang", "z-lab's layout (what z-lab's DFlashDraftModel and SGLang read)"),
    "vllm": ("vllm", "vLLM's serving layout (`method: dflash` loads it as it is)"),
    "speculators": ("speculators", "the speculators layout (vllm-project/speculators; vLLM reads it)"),
    "deepspec": ("deepspec", "DeepSpec's layout (its `Qwen3DSparkModel` loads it, the target's tables included)"),
    "gguf": ("gguf", "a GGUF file for llama.cpp's `dflash` architecture"),
}
ZLAB_READERS = ("z-lab", "SGLang")  # engines.py rows about z-lab's config layout
VLLM_METHOD = (
    "dflash"  # vLLM 'loads' a drafter only through its DFlash model (engines.py: GPU-only kinds are unverified)
)
VLLM_URL, LLAMA_SERVER_URL = "http://127.0.0.1:8000", "http://127.0.0.1:8080"  # the servers' default addresses
# train_config.yaml keys a card shows (the rest are logging and device settings)
RECIPE_KEYS = (
    "target",
    "features",
    "tokens",
    "online",
    "init_from",
    "loss",
    "labels",
    "position_weights",
    "lr",
    "epochs",
    "max_steps",
    "time_budget_minutes",
    "max_tokens",
    "batch_rows",
    "grad_accum",
    "seed",
)


@dataclass
class Measured:
    """One results.json (as `evaluate.report.load_results` returns it) and the name its drafter has there."""

    doc: dict[str, Any]
    drafter: str


@dataclass
class ModelCard:
    """What an export knows: the output (a directory or a .gguf file), its layout, the drafter as written, the
    checkpoint it came from, the target as named (`target`: HF directory / name / 'default'; `target_gguf`: the GGUF
    llama.cpp runs) and the evaluations of this drafter."""

    out: Path
    layout: str
    cfg: DrafterConfig
    source: Path
    target: str | None = None
    target_gguf: str | None = None
    evals: list[Measured] = field(default_factory=list)


@dataclass
class _Target:
    spec: str | None  # for dflashkit's --target
    hf: str | None  # what vLLM serves
    gguf: str | None  # what llama.cpp runs
    base_model: str | None


# ---------------------------------------------------------------------------------------------- writing
def card_path(out: Path) -> Path:
    """README.md beside the weights, unless one there is not this output's own card: then NAME.README.md."""
    out = Path(out)
    folder = out.parent if out.suffix == ".gguf" else out
    name = out.stem if out.suffix == ".gguf" else out.name
    readme = folder / CARD_NAME
    if not readme.exists():
        return readme
    try:
        mine = MARK.format(name=name) in readme.read_text(errors="replace")
    except OSError:
        mine = False
    return readme if mine else folder / f"{name}.{CARD_NAME}"


def write_model_card(card: ModelCard) -> str:
    """Write the card (atomically) where `card_path` says; returns the note the export prints."""
    path = card_path(card.out)
    atomic_write_text(path, render(card))
    kept = "" if path.name == CARD_NAME else f" ({CARD_NAME} there is not this export's card: kept)"
    return f"model card: {path}{kept}"


def card_of_export(out: Path, *, source: Path, target: str | None, evals: Sequence[Measured] = ()) -> ModelCard:
    """The card of a directory `export_checkpoint` wrote (the serving layout, or dflashkit's own), read back."""
    cfg = load_config(out)
    layout = SERVING_FORMAT if cfg.extra.get("layout") == SERVING_FORMAT else "zlab"  # serving_config records it
    return ModelCard(out=Path(out), layout=layout, cfg=cfg, source=Path(source), target=target, evals=list(evals))


def render(card: ModelCard) -> str:
    """The card's text: front matter, then the drafter, its training, τ, serving and checking."""
    recipe, recipe_file = _train_config(card.source)
    t = _target(card, recipe)
    head = head_of(card.cfg)
    rows = _engine_rows(card)
    served = _serve_commands(card, t, rows)
    front = {"base_model": t.base_model} if t.base_model else {}
    front |= {
        "library_name": LAYOUTS[card.layout][0],
        "pipeline_tag": "text-generation",
        "tags": ["dflashkit", "speculative-decoding", "draft-model", card.cfg.kind, card.layout],
    }
    name = card.out.stem if card.layout == "gguf" else card.out.name
    arch = card.cfg.extra.get("target_architecture")
    about = f"`{t.spec}`" if t.spec else "its target (not recorded with this drafter)"
    about += f" ({arch}, {card.cfg.num_target_layers} decoder layers)" if arch else ""
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False, allow_unicode=True).strip(),
        "---",
        MARK.format(name=name),
        "",
        f"# {name}: a {head.format.title} drafter",
        "",
        f"A {head.format.title} speculative-decoding drafter for {about}, in {LAYOUTS[card.layout][1]}, written by "
        f"dflashkit from `{card.source}`. The target verifies every drafted token, so the output is the target's "
        "own; the drafter only changes how many tokens each target step commits (τ).",
        "",
        *_drafter_lines(card.cfg),
        *_training_lines(card, recipe, recipe_file),
        *_tau_lines(card, t),
        *_serving_lines(rows, served, t),
        *_check_lines(card, t, served),
    ]
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------- sections
def _drafter_lines(cfg: DrafterConfig) -> list[str]:
    head = head_of(cfg)
    n = head.drafts_per_round(cfg.block_size)
    if cfg.learned_mask_embedding:
        mask = f"learned embedding (engines substitute it at token id {cfg.mask_token_id})"
    else:
        mask = f"token row {cfg.mask_token_id} of the target's embeddings"
    why = cfg.extra.get("mask_reason")
    vocab = (
        f"{cfg.draft_vocab_size} of the target's {cfg.vocab_size} tokens"
        if cfg.draft_vocab_size is not None
        else f"full ({cfg.vocab_size} tokens)"
    )
    rows = [
        ("kind", f"{head.format.title} (`{cfg.kind}`)"),
        ("layers", str(cfg.num_hidden_layers)),
        ("block size", f"{cfg.block_size} ({n} drafts a round)"),
        ("target_layer_ids", f"{list(cfg.target_layer_ids)} (outputs of the target's decoder layers)"),
        ("mask", mask + (f"; {why}" if why else "")),
        ("draft vocabulary", vocab),
        ("hidden size", str(cfg.hidden_size)),
        *((f, f"{v}") for f, v in cfg.head_fields().items()),
    ]
    return ["## Drafter", "", "| | |", "| --- | --- |", *(f"| {k} | {_cell(v)} |" for k, v in rows), ""]


def _training_lines(card: ModelCard, recipe: dict[str, Any], recipe_file: Path | None) -> list[str]:
    """What the checkpoint records of its training (nothing else)."""
    from dflashkit.drafter.warm_start import describe

    extra, out = card.cfg.extra, []
    step = _step(card.source)
    if step is not None:
        out.append(f"- optimiser steps: {step} (the weights' metadata)")
    data = extra.get("data")
    if isinstance(data, dict) and data:
        out.append("- data: " + ", ".join(f"{k} {json.dumps(v)}" for k, v in data.items()))
    if extra.get("train_context") is not None:
        out.append(f"- longest training context: {extra['train_context']} tokens")
    warm = describe(extra.get("warm_start"))
    if warm:
        out.append(f"- warm start: {warm}")
    shown = [k for k in RECIPE_KEYS if recipe.get(k) is not None]
    if shown:
        out.append(f"- run settings (`{recipe_file}`):")
        out += [f"  - {k}: `{json.dumps(recipe[k])}`" for k in shown]
    if not out:
        out = [
            "Not recorded: the checkpoint holds no training record (config.json `extra`, `step`, train_config.yaml)."
        ]
    return ["## Training", "", *out, ""]


def _tau_lines(card: ModelCard, t: _Target) -> list[str]:
    head = ["## Acceptance (τ)", "", "τ: tokens committed per target verification, the target's own token included."]
    if not card.evals:
        drafter = card.out if card.layout in ("zlab", "vllm") else card.source  # layouts `eval` loads
        eval_dir = Path(card.source).parent / "eval"
        command = shell_line(
            "dflashkit",
            "eval",
            "--target",
            t.spec or "TARGET",
            "--drafter",
            drafter,
            "--dataset",
            "mtbench",
            "--out",
            eval_dir,
            *_thinking(card.cfg),
        )
        return [
            *head,
            "",
            "Not measured here: run",
            "",
            "```bash",
            command,
            "```",
            "",
            f"and export again with `--eval {shell_line(eval_dir)}` to record the result here.",
            "",
        ]
    out = [*head, ""]
    for m in card.evals:
        out += _measured_lines(m)
    return out


def _measured_lines(m: Measured) -> list[str]:
    doc = m.doc
    ds, settings, tgt = doc.get("dataset") or {}, doc.get("settings") or {}, doc.get("target") or {}
    temperature = (settings.get("sampling") or {}).get("temperature", 0.0)
    simulated = doc.get("kind") == "simulate"
    what = "`dflashkit simulate` (teacher-forced on greedy target transcripts)" if simulated else "`dflashkit eval`"
    lines = [
        f"### {ds.get('name', 'dataset not recorded')}: {ds.get('n_prompts', '?')} prompts, "
        f"{settings.get('max_new_tokens', '?')} new tokens, temperature {temperature}",
        "",
        "| method | τ (micro) | τ (macro) | tok/s | speedup vs AR | greedy = AR |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for method, st in doc["results"][m.drafter].items():
        lines.append(
            f"| {method} | {_num(st.get('tau_micro'))} | {_num(st.get('tau_macro'))} | {_num(st.get('tok_s'), 1)} | "
            f"{_num(st.get('speedup_vs_ar'), 2, '×')} | {_num(st.get('greedy_equal_fraction'), 3)} |"
        )
    machine = _machine(doc.get("machine"))
    lines += [
        "",
        f"Measured by {what} on the target `{tgt.get('source', 'not recorded')}` ({tgt.get('dtype', '?')} on "
        f"{tgt.get('device', '?')}); machine: {machine}; results: `{doc.get('_path', '?')}` (drafter "
        f"`{m.drafter}`).",
        "",
    ]
    return lines


def _serving_lines(rows: list[EngineVerdict], served: list[_Served], t: _Target) -> list[str]:
    lines = ["## Serving", "", "| engine | verdict | why |", "| --- | --- | --- |"]
    lines += [f"| {v.engine} | {v.verdict} | {_cell(v.why) or '—'} |" for v in rows]
    lines += [
        "",
        "loads: runs this very drafter; converts: after the `dflashkit convert` shown; degrades: loads but runs "
        "another drafter (acceptance falls, output unchanged); refuses: the engine's own limit; unverified: "
        "dflashkit does not run it.",
        "",
    ]
    for s in served:
        lines += [f"### {s.engine}", "", "```bash", *s.commands, "```", ""]
    words = {w for s in served for c in s.commands for w in c.split()}
    for placeholder, known, what in (("TARGET", t.hf, "model"), ("TARGET.gguf", t.gguf, "GGUF file")):
        if not known and placeholder in words:
            lines += [f"`{placeholder}`: the target's {what} (not recorded with this drafter).", ""]
    return lines


def _engine_rows(card: ModelCard) -> list[EngineVerdict]:
    """Each engine's verdict on this output (engines.py for the directory layouts it judges)."""
    if card.layout == "gguf":
        return [EngineVerdict("llama.cpp", "loads")]
    if card.layout == "deepspec":
        back = shell_line("dflashkit", "convert", card.out, "DIR", "--target", "TARGET")
        return [
            EngineVerdict("DeepSpec", "loads", "`Qwen3DSparkModel.from_pretrained` on this directory"),
            EngineVerdict("others", "converts", f"import it back first (`{back}`), then convert DIR for them"),
        ]
    from safetensors import safe_open

    files = {p.name for p in card.out.iterdir()}
    keys: set[str] = set()
    for f in weight_files(card.out):
        with safe_open(str(f), framework="pt") as handle:
            keys.update(handle.keys())
    raw = json.loads((card.out / CONFIG_NAME).read_text())
    rows = engine_verdicts(card.cfg, files=files, keys=keys, raw=raw)
    if card.layout == "speculators":  # z-lab's and SGLang's loaders read z-lab's config, not this one
        rows = [v for v in rows if v.engine not in ZLAB_READERS] + [EngineVerdict("speculators", "loads")]
    return rows


@dataclass
class _Served:
    engine: str
    commands: list[str]  # the conversion, when one is needed, then the server
    drafter: Path  # what the server loads
    url: str  # the server's default address


def _serve_commands(card: ModelCard, t: _Target, rows: list[EngineVerdict]) -> list[_Served]:
    """The commands of the engines that load this output, or load it after the conversion shown."""
    head = head_of(card.cfg)
    n = head.drafts_per_round(card.cfg.block_size)
    verdicts = {v.engine: v.verdict for v in rows}
    out = []
    vllm = {v for e, v in verdicts.items() if e.startswith("vLLM")}
    if vllm & {"loads", "converts"}:
        served, steps = card.out, []
        if "loads" not in vllm:
            served = card.out.with_name(f"{card.out.name}-vllm")
            steps.append(
                shell_line("dflashkit", "convert", card.out, served, "--to", "vllm", "--target", t.spec or "TARGET")
            )
        spec = json.dumps({"method": VLLM_METHOD, "model": str(served), "num_speculative_tokens": n})
        steps.append(shell_line("vllm", "serve", t.hf or "TARGET", "--speculative-config", spec))
        out.append(_Served("vLLM", steps, served, VLLM_URL))
    if verdicts.get("llama.cpp") in ("loads", "converts"):
        gguf, steps = card.out, []
        if verdicts["llama.cpp"] == "converts":
            gguf = card.out.with_name(f"{card.out.name}.gguf")
            steps.append(
                shell_line("dflashkit", "convert", card.out, gguf, "--to", "gguf", "--target", t.gguf or "TARGET.gguf")
            )
        flags = ("--spec-type", head.format.llamacpp_spec_type, "--spec-draft-n-max", n)
        steps.append(shell_line("llama-server", "-m", t.gguf or "TARGET.gguf", "-md", gguf, *flags))
        out.append(_Served("llama.cpp", steps, gguf, LLAMA_SERVER_URL))
    return out


def _check_lines(card: ModelCard, t: _Target, served: list[_Served]) -> list[str]:
    """serve-check against each served engine at its default address."""
    if not served:
        return []
    drafter = card.source if card.layout == "gguf" else card.out  # a directory dflashkit loads
    target = ("--target", t.spec or "TARGET")
    commands = [
        shell_line(
            "dflashkit", "serve-check", drafter, *target, "--server", s.url,
            *(["--served-drafter", s.drafter] if s.drafter != drafter else []), *_thinking(card.cfg),
        )
        for s in served
    ]  # fmt: skip
    return [
        "## Checking a deployment",
        "",
        "`dflashkit serve-check` compares the running server's speculative counters with this drafter's acceptance "
        "on the server's own output and names the cause of a gap (each engine at its default address):",
        "",
        "```bash",
        *commands,
        "```",
        "",
    ]


# ---------------------------------------------------------------------------------------------- records
def _target(card: ModelCard, recipe: dict[str, Any]) -> _Target:
    """The target as named at export, else as the evaluations or the run's settings record it."""
    from dflashkit.target.default import DEFAULT_ALIASES, default_target_dir, gguf_path

    recorded = [(m.doc.get("target") or {}).get("source") for m in card.evals] + [recipe.get("target")]
    named = card.target or next((str(r) for r in recorded if r), None)
    if named is None:
        return _Target(card.target_gguf, None, card.target_gguf, card.target_gguf)
    if named.lower() in DEFAULT_ALIASES or Path(named) == default_target_dir():
        try:
            gguf = card.target_gguf or str(gguf_path())
        except TargetError:
            gguf = card.target_gguf
        return _Target("default", str(default_target_dir()), gguf, DEFAULT_HUB_ID)
    if named.endswith(".gguf"):
        return _Target(named, None, card.target_gguf or named, named)
    return _Target(named, named, card.target_gguf, named)


def _train_config(source: Path) -> tuple[dict[str, Any], Path | None]:
    """The run's train_config.yaml: in the checkpoint, or in the checkpoint `latest` names beside it (a run's
    final/ or best/); ({}, None) when neither exists."""
    from dflashkit.train.state import CONFIG_YAML, LATEST_NAME

    source = Path(source)
    candidates = [source / CONFIG_YAML]
    pointer = source.parent / LATEST_NAME
    if pointer.is_file():
        candidates.append(source.parent / pointer.read_text().strip() / CONFIG_YAML)
    for path in candidates:
        if path.is_file():
            try:
                raw = yaml.safe_load(path.read_text())
            except (yaml.YAMLError, UnicodeDecodeError, OSError):
                continue
            if isinstance(raw, dict):
                return raw, path
    return {}, None


def _step(source: Path) -> str | None:
    """The optimiser step dflashkit's trainer records in the weights' metadata (None: not recorded)."""
    from safetensors import SafetensorError, safe_open

    path = Path(source) / WEIGHTS_NAME
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as handle:
            return (handle.metadata() or {}).get("step")
    except (SafetensorError, OSError):
        return None


def _thinking(cfg: DrafterConfig) -> list[str]:
    """--thinking MODE when the drafter's data records one (eval and serve-check must render prompts so)."""
    mode = (cfg.extra.get("data") or {}).get("thinking")
    return ["--thinking", str(mode)] if mode else []


def _machine(m: Any) -> str:
    if not isinstance(m, dict) or not m.get("cpu"):
        return "not recorded in results.json"
    flags = f" ({', '.join(m['flags'])})" if m.get("flags") else ""
    return f"{m['cpu']}{flags}, {m.get('blas', '?')}, torch {m.get('torch', '?')}, {m.get('threads', '?')} threads"


def _num(x: Any, digits: int = 2, suffix: str = "") -> str:
    return "—" if x is None else f"{x:.{digits}f}{suffix}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------------------------------------- --eval
def drafter_fingerprints(cfgs: Iterable[DrafterConfig], tensor_sets: Iterable[dict[str, torch.Tensor]]) -> set[str]:
    """`eval`'s fingerprint of the drafter each config × tensors makes (built on the meta device: nothing copied)."""
    from dflashkit.drafter.model import DFlashDrafter
    from dflashkit.evaluate.stats import drafter_fingerprint

    tensor_sets = list(tensor_sets)
    out = set()
    for cfg in cfgs:
        for tensors in tensor_sets:
            with torch.device("meta"):
                drafter = DFlashDrafter(cfg)
            drafter.load_state_dict(tensors, strict=False, assign=True)  # rotary buffers: derived, not fingerprinted
            out.add(drafter_fingerprint(drafter))
    return out


def measured_in(paths: Sequence[str | Path], fingerprints: set[str]) -> list[Measured]:
    """The evaluations of this drafter in `eval` / `simulate` output directories (or results.json files; a
    `--temperatures` directory gives one per temperature): the drafter there whose fingerprint is one of
    `fingerprints`. A results.json that measured other drafters only is refused, naming them."""
    from dflashkit.evaluate.report import load_results

    out = []
    for path in paths:
        for results in _results_files(Path(path)):
            doc = load_results(results)
            drafters = doc.get("drafters") or {}
            names = [n for n in doc["results"] if (drafters.get(n) or {}).get("fingerprint") in fingerprints]
            if not names:
                seen = ", ".join(
                    f"{n} ({(drafters.get(n) or {}).get('fingerprint', 'no fingerprint')})" for n in doc["results"]
                )
                raise ConfigError(
                    f"--eval {path}: {results} measured {seen or 'no drafter'}, not this drafter "
                    f"({', '.join(sorted(fingerprints))}): evaluate this checkpoint (`dflashkit eval --drafter "
                    f"CKPT …`) and pass that output directory"
                )
            out.append(Measured(doc, names[0]))
    return out


def _results_files(path: Path) -> list[Path]:
    if path.is_dir() and not (path / "results.json").is_file():
        found = sorted(
            path.glob("*/results.json"),
            key=lambda p: [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", str(p))],
        )
        if found:
            return found
    return [path]


__all__ = [
    "CARD_NAME",
    "LAYOUTS",
    "Measured",
    "ModelCard",
    "card_of_export",
    "card_path",
    "drafter_fingerprints",
    "measured_in",
    "render",
    "write_model_card",
]
