"""`dflashkit inspect CKPT`: what a drafter checkpoint really is, read from its tensors, and where it disagrees
with its config.json.

    dflashkit inspect runs/smollm2/train/final          # text
    dflashkit inspect z-lab/Qwen3-8B-DFlash-b16 --json  # any z-lab, dflashkit or speculators checkpoint

The number of target features is read from the **fc weight** (fc.weight.shape[1] / hidden), never from the
config alone: a drafter whose config names 5 target layers while its fc reads 4 is reported
(docs/troubleshooting.md#pitfall-fc-layers).
Shapes come from the safetensors headers (nothing is loaded but for the finiteness check), so a partial or
unreadable checkpoint is described as far as it can be, naming the missing file or tensor.
Also home of `Finding`, the one-line result used by inspect, diff and doctor.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dflashkit.drafter import checkpoint as checkpoint_files
from dflashkit.drafter.checkpoint import CONFIG_NAME, INDEX_NAME, SERVING_ONLY, WEIGHTS_NAME, drafter_state_dict
from dflashkit.drafter.config import DrafterConfig, stores_target_layer_ids
from dflashkit.drafter.heads import head_of, kind_of_config
from dflashkit.errors import CheckpointError, ConfigError
from dflashkit.shell import shell_line

STATUSES = ("OK", "WARN", "FAIL")


@dataclass
class Finding:
    """One line: `STATUS check: what — fix: how` (the fix is shown for WARN and FAIL)."""

    status: str
    check: str
    what: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status} {self.check}: {self.what}"
        return text + (f" — fix: {self.fix}" if self.fix and self.status != "OK" else "")


@dataclass
class CheckpointReport:
    """Facts about a checkpoint (from tensors where possible) and the inconsistencies found."""

    path: str
    format: str = "unknown"
    files: dict[str, int] = field(default_factory=dict)  # file name → bytes
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)  # dflashkit name → {shape, dtype, file}
    config_raw: dict[str, Any] | None = None
    config: DrafterConfig | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, status: str, check: str, what: str, fix: str = "") -> None:
        self.findings.append(Finding(status, check, what, fix))

    @property
    def ok(self) -> bool:
        return not any(f.status == "FAIL" for f in self.findings)

    def shape(self, name: str) -> list[int] | None:
        t = self.tensors.get(name)
        return list(t["shape"]) if t else None

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "files": self.files,
            "facts": self.facts,
            "tensors": self.tensors,
            "findings": [asdict(f) for f in self.findings],
            "notes": self.notes,
            "ok": self.ok,
        }


def weight_files(path: Path, report: CheckpointReport) -> list[Path]:
    if (path / WEIGHTS_NAME).is_file():
        return [path / WEIGHTS_NAME]
    if (path / INDEX_NAME).is_file():
        try:
            names = sorted(set(json.loads((path / INDEX_NAME).read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
            report.add("FAIL", "files", f"{INDEX_NAME} is malformed ({e})", "re-save the checkpoint")
            return []
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            report.add(
                "FAIL",
                "files",
                f"shard file(s) {missing} named by {INDEX_NAME} are missing",
                "copy the missing shards next to the index",
            )
        return [path / n for n in names if (path / n).is_file()]
    report.add(
        "FAIL",
        "files",
        f"no {WEIGHTS_NAME} (or {INDEX_NAME}) in {path}",
        "point at the directory holding the drafter's safetensors weights",
    )
    return []


def _read_headers(files: list[Path], report: CheckpointReport) -> dict[str, dict[str, Any]]:
    from dflashkit.export.convert import map_key

    out: dict[str, dict[str, Any]] = {}
    for f in files:
        report.files[f.name] = f.stat().st_size
        try:
            with safe_open(str(f), framework="pt") as h:
                for key in list(h.keys()):
                    sl = h.get_slice(key)
                    name = map_key(key) if report.format == "speculators" else key
                    out[name] = {
                        "shape": list(sl.get_shape()),
                        "dtype": str(sl.get_dtype()),
                        "file": f.name,
                        "stored_as": key,
                    }
        except Exception as e:  # safetensors raises its own types on truncated / garbage files
            report.add(
                "FAIL",
                "files",
                f"{f.name} is not a readable safetensors file ({e})",
                "the file is truncated or not safetensors: copy it again or re-export the checkpoint",
            )
    return out


def _config(path: Path, report: CheckpointReport) -> None:
    from dflashkit.export.convert import config_from_speculators, detect_format

    cfg_path = path / CONFIG_NAME
    if not cfg_path.is_file():
        report.add(
            "FAIL",
            "config",
            f"{CONFIG_NAME} is missing in {path}",
            "copy the drafter's config.json next to its weights",
        )
        return
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        bad_json = isinstance(e, json.JSONDecodeError)
        why = f"JSON (line {e.lineno}: {e.msg})" if bad_json else f"UTF-8 (byte offset {e.start})"
        report.add("FAIL", "config", f"{CONFIG_NAME} is not valid {why}", "repair or re-export config.json")
        return
    report.config_raw = raw
    report.format = detect_format(raw)
    try:
        if report.format == "speculators":
            report.config = config_from_speculators(raw, notes=report.notes, source=str(cfg_path))
        else:
            report.config = DrafterConfig.from_zlab_dict(raw, source=str(cfg_path))
    except (ConfigError, CheckpointError) as e:
        report.add("FAIL", "config", str(e), "fix the named field in config.json")
    if report.format == "speculators":
        report.add(
            "WARN",
            "format",
            "speculators-format checkpoint (layer ids count the embedding output)",
            f"convert it: {shell_line('dflashkit', 'convert', path, 'OUT')}",
        )


def _raw_field(raw: dict[str, Any] | None, name: str) -> Any:
    """A field of an unparsable config, or None when absent or of the wrong type (the config FAIL names it)."""
    from dflashkit.drafter.config_fields import field_value_ok

    if not raw:
        return None
    dflash = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    value = dflash.get(name, raw.get(name))
    return value if field_value_ok(name, value) else None


def _facts(report: CheckpointReport) -> None:
    cfg, raw, shape = report.config, report.config_raw, report.shape
    facts = report.facts
    fc, norm, qn = shape("fc.weight"), shape("norm.weight"), shape("layers.0.self_attn.q_norm.weight")
    hidden = cfg.hidden_size if cfg else (_raw_field(raw, "hidden_size") or (norm[0] if norm else None))
    facts["hidden_size"] = hidden
    ids = cfg.target_layer_ids if cfg else _raw_field(raw, "target_layer_ids")
    facts["target_layer_ids"] = ids
    # z-lab format without stored ids: from_zlab_dict derived them by z-lab's rule (K = num_hidden_layers)
    facts["target_layer_ids_derived"] = bool(
        cfg and report.format != "speculators" and raw and not stores_target_layer_ids(raw)
    )
    if facts["target_layer_ids_derived"]:
        report.notes.append(
            f"config.json stores no target_layer_ids: {ids} are derived, as z-lab does, from "
            f"num_target_layers {cfg.num_target_layers} and num_hidden_layers {cfg.num_hidden_layers}"
            f" (build_target_layer_ids); they are right only if the drafter was trained on them"
        )
    facts["num_target_layers"] = cfg.num_target_layers if cfg else _raw_field(raw, "num_target_layers")
    facts["fc_shape"] = fc
    facts["fc_features"] = fc[1] / hidden if fc and hidden else None
    if isinstance(facts["fc_features"], float) and facts["fc_features"].is_integer():
        facts["fc_features"] = int(facts["fc_features"])
    layer_idx = sorted({int(m.group(1)) for k in report.tensors if (m := re.match(r"layers\.(\d+)\.", k))})
    facts["layers_in_tensors"] = len(layer_idx)
    head_dim_t = qn[0] if qn else None
    q = shape("layers.0.self_attn.q_proj.weight")
    k = shape("layers.0.self_attn.k_proj.weight")
    gate = shape("layers.0.mlp.gate_proj.weight")
    facts["tensor_geometry"] = {
        "head_dim": head_dim_t,
        "heads": q[0] // head_dim_t if q and head_dim_t else None,
        "kv_heads": k[0] // head_dim_t if k and head_dim_t else None,
        "intermediate": gate[0] if gate else None,
    }
    src = cfg.to_zlab_dict() if cfg else (raw or {})
    for name in (
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "layer_types",
        "sliding_window",
        "rms_norm_eps",
        "vocab_size",
        "max_position_embeddings",
    ):
        facts[name] = src.get(name)
    facts["rope_theta"] = cfg.rope_theta if cfg else (raw or {}).get("rope_theta")
    facts["block_size"] = cfg.block_size if cfg else _raw_field(raw, "block_size")
    facts["kind"] = cfg.kind if cfg else kind_of_config(raw or {})
    facts["heads"] = head_of(facts["kind"]).format.inspect_facts(report.tensors, cfg)  # the head's own tensors
    facts["is_causal"] = cfg.is_causal if cfg else (raw or {}).get("is_causal")
    facts["draft_vocab_size"] = cfg.draft_vocab_size if cfg else _raw_field(raw, "draft_vocab_size")
    # DeepSpec's layout (convert --to deepspec) keeps a learned mask in its row of the embed_tokens copy
    in_row = bool(
        cfg
        and cfg.learned_mask_embedding
        and head_of(cfg).format.carries_target_tables
        and "embed_tokens.weight" in report.tensors
    )
    learned = "mask_embedding" in report.tensors or in_row
    facts["mask"] = {
        "mask_token_id": cfg.mask_token_id if cfg else _raw_field(raw, "mask_token_id"),
        "learned_embedding_tensor": learned,
        "in_embedding_row": in_row and "mask_embedding" not in report.tensors,
        "config_says_learned": bool(cfg.learned_mask_embedding) if cfg else None,
    }
    facts["extra"] = dict(cfg.extra) if cfg else {}
    facts["parameters"] = sum(
        math.prod(t["shape"])
        for n, t in report.tensors.items()
        if n not in ("draft_to_target", "lm_head.weight") and not t["dtype"].startswith(("I", "U", "BOOL"))
    )
    facts["dtypes"] = sorted({t["dtype"] for t in report.tensors.values()})
    facts["bytes"] = sum(report.files.values())


def _consistency(report: CheckpointReport) -> None:
    cfg, facts, shape = report.config, report.facts, report.shape
    ids = facts["target_layer_ids"]
    fc = facts["fc_shape"]
    if fc is None and report.tensors:
        report.add("FAIL", "fc", "tensor 'fc.weight' is missing", "the checkpoint is incomplete: re-export it")
    elif fc is not None and ids:
        k = facts["fc_features"]
        named = "the derived ids name" if facts.get("target_layer_ids_derived") else "config.json names"
        if k != len(ids):
            what = (
                f"fc reads {k} target layers (fc.weight {fc} = {k} × hidden {facts['hidden_size']}) but "
                f"{named} {len(ids)} (target_layer_ids {ids})"
                if isinstance(k, int)
                else f"fc.weight {fc} is not a multiple of hidden {facts['hidden_size']}"
            )
            report.add(
                "FAIL",
                "fc width",
                what,
                "retrain with an fc over every named layer (docs/troubleshooting.md#pitfall-fc-layers), or correct "
                "target_layer_ids "
                "to the layers the fc was trained on",
            )
        else:
            report.add("OK", "fc width", f"fc reads {k} target layers ({fc[1]} → {fc[0]}), as {named}")
    if cfg is None:
        return
    with torch.device("meta"):
        skeleton = drafter_state_dict(_skeleton(cfg))
        expected = {k: list(v.shape) for k, v in skeleton.items()}
    _dtype_kinds(report, skeleton)
    present = set(report.tensors) | ({"draft_to_target"} if "d2t" in report.tensors else set())
    present |= {"mask_embedding"} if report.facts.get("mask", {}).get("in_embedding_row") else set()
    missing = sorted(set(expected) - present)
    unexpected = sorted(set(report.tensors) - set(expected))
    if report.format == "speculators":  # tables the converter drops or translates (see dflashkit.export.convert)
        from dflashkit.export.convert import DROPPED_KEYS

        unexpected = [k for k in unexpected if k not in DROPPED_KEYS and k != "d2t"]
    elif cfg.draft_vocab_size is not None:  # the serving layout's vocabulary map and LM-head rows
        unexpected = [k for k in unexpected if k not in SERVING_ONLY]
    if missing and report.tensors:
        report.add(
            "FAIL",
            "tensors",
            f"missing tensors {missing[:8]}" + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""),
            "the checkpoint is incomplete or from another architecture: re-export it",
        )
    if unexpected:
        hint = checkpoint_files.deepspec_hint(unexpected, cfg)  # DeepSpec: frozen copies of the target tables
        more = f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""
        report.add(
            "FAIL" if report.format != "speculators" and not hint else "WARN",
            "tensors",
            f"unexpected tensors {unexpected[:8]}{more}",
            hint or "remove them, or fix config.json (layers, mask_embedding, draft_vocab_size) to describe them",
        )
    _shape_findings(report, expected)
    geo = facts["tensor_geometry"]
    q = shape("layers.0.self_attn.q_proj.weight")
    if (
        geo["head_dim"]
        and q
        and (geo["head_dim"], geo["heads"], geo["kv_heads"])
        != (cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads)
    ):
        report.add(
            "FAIL",
            "geometry",
            f"tensors say {geo['heads']} heads × {geo['head_dim']} with {geo['kv_heads']} "
            f"kv heads; config.json says {cfg.num_attention_heads} × {cfg.head_dim} with "
            f"{cfg.num_key_value_heads}",
            "make config.json match the q/k/v/o and q_norm shapes",
        )
    if report.tensors and facts["layers_in_tensors"] != cfg.num_hidden_layers:
        report.add(
            "FAIL",
            "layers",
            f"tensors hold {facts['layers_in_tensors']} decoder layers; config.json says "
            f"num_hidden_layers {cfg.num_hidden_layers}",
            "correct num_hidden_layers / layer_types",
        )
    if cfg.learned_mask_embedding != facts["mask"]["learned_embedding_tensor"] and report.tensors:
        report.add(
            "FAIL",
            "mask",
            "config.json says a learned mask embedding but no 'mask_embedding' tensor exists"
            if cfg.learned_mask_embedding
            else "a 'mask_embedding' tensor exists but config.json does not set dflash_config.mask_embedding",
            "make dflash_config.mask_embedding match the tensors",
        )


def _shape_findings(report: CheckpointReport, expected: dict[str, list[int]]) -> None:
    """Tensors whose shapes differ from what config.json implies (fc.weight: reported by the fc-width check)."""
    bad = [
        (k, expected[k], report.shape(k))
        for k in sorted(set(expected) & set(report.tensors))
        if report.shape(k) != expected[k] and k != "fc.weight"
    ]
    for key, want, got in bad[:8]:
        report.add(
            "FAIL",
            "shapes",
            f"tensor '{key}' has shape {got}, config.json implies {want}",
            "config.json does not describe these weights: correct heads / head_dim / sizes to the tensors",
        )


def _dtype_kinds(report: CheckpointReport, skeleton: dict[str, Any]) -> None:
    """The loader's rule (drafter.checkpoint.check_tensors): weights are floating point, maps integers."""
    wrong_kind = [
        f"{k} ({report.tensors[k]['dtype']})"
        for k, v in skeleton.items()
        if k in report.tensors and _is_float(report.tensors[k]["dtype"]) != v.is_floating_point()
    ]
    if wrong_kind:
        report.add(
            "FAIL",
            "dtypes",
            f"tensors of the wrong kind: {wrong_kind[:8]} (weights must be floating point, maps integers)",
            "re-export the checkpoint; its loader refuses it",
        )


def _is_float(safetensors_dtype: str) -> bool:
    """Whether a safetensors header dtype ("F32", "BF16", "I64", …) is a floating-point one."""
    return safetensors_dtype.upper().startswith(("F", "BF", "E"))


def _skeleton(cfg: DrafterConfig) -> Any:
    from dflashkit.drafter.model import DFlashDrafter

    return DFlashDrafter(cfg)


def _finite(path: Path, report: CheckpointReport) -> None:
    bad = []
    for f in sorted({t["file"] for t in report.tensors.values()}):
        try:
            with safe_open(str(path / f), framework="pt") as h:
                for key in list(h.keys()):
                    t = h.get_tensor(key)
                    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        bad.append(key)
        except Exception:  # already reported by _read_headers
            continue
    if bad:
        report.add(
            "FAIL",
            "values",
            f"non-finite values (NaN/inf) in {bad[:8]}",
            "training diverged before this save: use an earlier checkpoint",
        )


def inspect_checkpoint(path: str | Path, *, check_values: bool = True) -> CheckpointReport:
    """Describe a checkpoint directory; never raises on a broken checkpoint (the findings say what is wrong)."""
    path = Path(path)
    report = CheckpointReport(path=str(path))
    if not path.exists():
        report.add("FAIL", "files", f"checkpoint {path} does not exist", "check the path")
        return report
    if not path.is_dir():
        report.add(
            "FAIL",
            "files",
            f"{path} is a file; expected a checkpoint directory (config.json + {WEIGHTS_NAME})",
            "pass the directory that holds it",
        )
        return report
    _config(path, report)
    report.tensors = _read_headers(weight_files(path, report), report)
    if (path / CONFIG_NAME).is_file():
        report.files[CONFIG_NAME] = (path / CONFIG_NAME).stat().st_size
    _facts(report)
    _consistency(report)
    if check_values and report.tensors:
        _finite(path, report)
    if report.config is not None and report.format != "speculators":
        from dflashkit.export.engines import engine_verdicts

        verdicts = engine_verdicts(
            report.config,
            files={p.name for p in path.iterdir()},
            keys=set(report.tensors),
            raw=report.config_raw or {},
        )
        report.facts["engines"] = [asdict(v) for v in verdicts]
    return report


def _kind_line(f: dict) -> str:
    """The kind's words on the block-size line: drafts a round, and its head's own parts (`HeadFormat.describe`)."""
    return head_of(f.get("kind") or "dflash").format.describe(f, f["block_size"])


def render_report(report: CheckpointReport) -> str:
    """Human-readable description plus the findings, one line each."""
    f = report.facts
    if not f:
        return "\n".join([f"Checkpoint {report.path}"] + [x.line() for x in report.findings])
    geo, mask = f["tensor_geometry"], f["mask"]
    ids = f["target_layer_ids"]
    kinds = f["layer_types"] or []
    summary = ", ".join(f"{kinds.count(t)} × {t}" for t in dict.fromkeys(kinds))
    mask_txt = (
        f"learned mask embedding (row {mask['mask_token_id']} of the embed_tokens copy: DeepSpec's layout)"
        if mask.get("in_embedding_row")
        else "learned mask embedding (tensor 'mask_embedding')"
        if mask["learned_embedding_tensor"]
        else f"target embedding row {mask['mask_token_id']}"
    )
    if f["extra"].get("mask_reason"):
        mask_txt += f" — {f['extra']['mask_reason']}"
    named = (
        "config stores none, derived (z-lab default)"
        if f.get("target_layer_ids_derived")
        else f"config names {len(ids) if ids else '?'}"
    )
    lines = [
        f"Checkpoint {report.path}  ({report.format} format)",
        f"  target features   fc reads {f['fc_features']} layers ({f['fc_shape']}); {named}: "
        f"target_layer_ids {ids} of a {f['num_target_layers']}-layer target",
        f"  layers            {f['num_hidden_layers']} ({summary or 'unknown'}), tensors hold {f['layers_in_tensors']}"
        + (f"; sliding window {f['sliding_window']}" if f["sliding_window"] else ""),
        f"  attention         {f['num_attention_heads']} heads × {f['head_dim']}, {f['num_key_value_heads']} kv heads"
        f" (tensors: {geo['heads']} × {geo['head_dim']}, {geo['kv_heads']} kv)",
        f"  MLP               {f['intermediate_size']} (tensors: {geo['intermediate']})",
        f"  hidden / vocab    {f['hidden_size']} / {f['vocab_size']}"
        + (f" (draft vocabulary {f['draft_vocab_size']})" if f["draft_vocab_size"] else ""),
        f"  block size        {f['block_size']}" + _kind_line(f),
        f"  mask token        {mask_txt}",
        f"  rope θ / norm ε   {f['rope_theta']} / {f['rms_norm_eps']}",
        f"  parameters        {f['parameters']:,} ({', '.join(f['dtypes']) or 'no tensors'})",
        f"  size on disk      {f['bytes'] / 1e6:.2f} MB in {len(report.files)} file(s)",
    ]
    if f["extra"]:
        lines.append(f"  recorded          {json.dumps(f['extra'], sort_keys=True)}")
    for i, v in enumerate(f.get("engines", [])):
        head = "  engines           " if i == 0 else " " * 20
        lines.append(head + f"{v['engine']:<11} {v['verdict']}" + (f": {v['why']}" if v["why"] else ""))
    lines += [f"  note: {n}" for n in report.notes]
    problems = [x for x in report.findings if x.status != "OK"]
    lines.append("Findings" if report.findings else "Findings: none")
    lines += ["  " + x.line() for x in report.findings]
    if not problems:
        lines.append("  config.json and tensors agree")
    return "\n".join(lines)


__all__ = ["CheckpointReport", "Finding", "inspect_checkpoint", "render_report"]
