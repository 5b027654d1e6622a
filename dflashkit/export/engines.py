"""Which serving engines can load a drafter directory as it is, and why not — for `inspect` and `doctor`.

    verdicts = engine_verdicts(cfg, files={"config.json", "model.safetensors"}, keys={...}, raw=config_dict)
    for v in verdicts: print(v.line())         # "vLLM (GPU)  loads" / "vLLM (CPU)  refuses: …" / …
    export_problems(cfg)                       # why llama.cpp's dflash graph cannot run it ([] : it can)

Each verdict is one of:
  loads         the engine reads the directory and runs this very drafter (what `serve-check` verifies)
  converts      it runs this drafter after `dflashkit convert` (the command is named)
  degrades      it loads without an error but runs ANOTHER drafter (e.g. a learned mask replaced by a token row):
                acceptance falls, output stays identical — the silent failure this report exists for
  refuses       it cannot run this drafter (the reason is the engine's own limit)
  unverified    dflashkit does not run this engine (its layout is documented, no run backs it)
Facts come from the engines' sources (vLLM 0.32 `qwen3_dflash.py`, `qwen3_dspark.py`, `config/vllm.py`; llama.cpp
`dflash` loader through our GGUF export, export/gguf_export.py) and from runs of `serve-check`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflashkit.drafter.checkpoint import MASK_FILE
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads import head_of
from dflashkit.export.serving import mixed_layers, vllm_model_problems

VERDICTS = ("loads", "converts", "degrades", "refuses", "unverified")
TO_VLLM = "dflashkit convert DIR OUT --to vllm --target TARGET"


def export_problems(cfg: DrafterConfig, *, num_target_layers: int | None = None) -> list[str]:
    """Why llama.cpp's dflash loader/graph cannot run this drafter exactly (empty when it can)."""
    n_layers = num_target_layers or cfg.num_target_layers
    problems = []
    last = [i for i in cfg.target_layer_ids if i + 1 >= n_layers]
    if last:
        problems.append(
            f"target_layer_ids {last} read the output of the target's last decoder layer "
            f"({n_layers - 1}); llama.cpp extracts layer *inputs* (dflash.target_layers = id + 1), so "
            f"the last layer's output has no input to be read from"
        )
    if cfg.attention_bias:
        problems.append("attention_bias: true — llama.cpp's dflash layers load no q/k/v/o biases")
    if cfg.hidden_act != "silu":
        problems.append(
            f"hidden_act {cfg.hidden_act!r}: only 'silu' is exported (llama.cpp maps gelu variants "
            f"to one tanh-approximated GELU)"
        )
    causal = {cfg.layer_is_causal(i) for i in range(cfg.num_hidden_layers)}
    if len(causal) > 1:
        problems.append(
            "the drafter mixes causal (sliding) and bidirectional (full) block attention; llama.cpp "
            "has one causal switch for all draft layers (set is_causal to make them agree)"
        )
    return problems + head_of(cfg).format.gguf_problems(cfg)


@dataclass
class EngineVerdict:
    engine: str
    verdict: str  # one of VERDICTS
    why: str = ""

    def line(self) -> str:
        return f"{self.engine:<13} {self.verdict}" + (f": {self.why}" if self.why else "")


def _vllm_layout_problems(cfg: DrafterConfig, keys: set[str], raw: dict[str, Any]) -> list[str]:
    """What of this directory's layout makes vLLM refuse it (a reduced vocabulary in dflashkit's own layout)."""
    out = []
    if cfg.draft_vocab_size is not None:
        if "draft_to_target" in keys:
            out.append(
                "vLLM fails on the draft_to_target tensor ('no module or parameter named draft_to_target'); it "
                "reads a reduced vocabulary as d2t offsets + lm_head rows"
            )
        elif not {"d2t", "lm_head.weight"} <= keys:
            out.append("a reduced vocabulary needs d2t and lm_head.weight tensors")
        if raw.get("draft_vocab_size") != cfg.draft_vocab_size:
            out.append("vLLM reads draft_vocab_size only at the top level of config.json")
    return out


def engine_verdicts(
    cfg: DrafterConfig, *, files: set[str], keys: set[str], raw: dict[str, Any] | None = None
) -> list[EngineVerdict]:
    """One verdict per engine for a drafter directory holding `files` (names) with tensor `keys` and config
    `raw` (its config.json as read). What differs by kind comes from the head's format record (`Head.format`): the
    kinds vLLM runs only in its GPU model runner (`vllm_cpu_problem`, `vllm_gpu_layout`), a learned mask vLLM drops
    (`vllm_drops_learned_mask`), what z-lab's class lacks (`zlab_problem`), llama.cpp's `--spec-type`."""
    raw, fmt = raw or {}, head_of(cfg).format
    out: list[EngineVerdict] = []
    layout = _vllm_layout_problems(cfg, keys, raw)
    model = vllm_model_problems(cfg)
    dropped = cfg.learned_mask_embedding and fmt.vllm_drops_learned_mask
    mask_degrades = cfg.learned_mask_embedding and MASK_FILE not in files
    for engine, cpu in (("vLLM (GPU)", False), ("vLLM (CPU)", True)):
        refuse = [fmt.vllm_cpu_problem] if cpu and fmt.vllm_cpu_problem else list(model)
        if cpu and not fmt.vllm_cpu_problem and mixed_layers(cfg):
            refuse.append("vLLM's CPU runner (V1) refuses drafters mixing sliding and full attention layers")
        if refuse:
            out.append(EngineVerdict(engine, "refuses", "; ".join(refuse)))
        elif dropped:
            out.append(
                EngineVerdict(
                    engine,
                    "degrades",
                    f"vLLM's {fmt.title} model drops a learned mask embedding ({MASK_FILE} too) and feeds the "
                    f"target's row {cfg.mask_token_id} at masked slots",
                )
            )
        elif layout:
            out.append(EngineVerdict(engine, "converts", "; ".join(layout) + f" — {TO_VLLM}"))
        elif mask_degrades:
            out.append(
                EngineVerdict(
                    engine,
                    "degrades",
                    f"the learned mask embedding is read only from {MASK_FILE}; without it vLLM feeds the "
                    f"target's row {cfg.mask_token_id} at masked slots — {TO_VLLM}",
                )
            )
        elif fmt.vllm_gpu_layout:
            out.append(EngineVerdict(engine, "unverified", f"{fmt.vllm_gpu_layout}; dflashkit runs vLLM on CPU only"))
        else:
            out.append(EngineVerdict(engine, "loads"))
    problems = export_problems(cfg)
    if problems:
        out.append(EngineVerdict("llama.cpp", "refuses", "; ".join(problems)))
    else:
        command = "dflashkit convert DIR OUT.gguf --to gguf --target TARGET.gguf"
        out.append(EngineVerdict("llama.cpp", "converts", f"{command} (--spec-type {fmt.llamacpp_spec_type})"))
    if fmt.zlab_problem:
        out.append(EngineVerdict("z-lab", "refuses", fmt.zlab_problem))
    elif cfg.draft_vocab_size is not None:
        out.append(EngineVerdict("z-lab", "refuses", "z-lab's drafter classes have no reduced draft vocabulary"))
    elif cfg.learned_mask_embedding:
        out.append(
            EngineVerdict("z-lab", "degrades", f"z-lab embeds masked slots with the target's row {cfg.mask_token_id}")
        )
    else:
        out.append(EngineVerdict("z-lab", "unverified", "z-lab's layout; its loader is not run by dflashkit"))
    out.append(
        EngineVerdict(
            "SGLang", "unverified", f"SGLang's loader reads z-lab's {fmt.title} fields; dflashkit does not run SGLang"
        )
    )
    return out


def verdicts_for_dir(path: Any) -> list[EngineVerdict]:
    """Verdicts for a drafter directory on disk (config.json + safetensors headers; nothing is loaded)."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    from dflashkit.drafter.checkpoint import CONFIG_NAME, load_config, weight_files

    path = Path(path)
    cfg = load_config(path)
    keys: set[str] = set()
    for f in weight_files(path):
        with safe_open(str(f), framework="pt") as handle:
            keys.update(handle.keys())
    raw = json.loads((path / CONFIG_NAME).read_text())
    files = {p.name for p in path.iterdir()}
    return engine_verdicts(cfg, files=files, keys=keys, raw=raw)


__all__ = [
    "VERDICTS",
    "EngineVerdict",
    "engine_verdicts",
    "export_problems",
    "mixed_layers",
    "verdicts_for_dir",
    "vllm_model_problems",
]
