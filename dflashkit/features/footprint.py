"""What hidden-state capture stores per token and holds in memory while it runs, from shapes alone (no model loaded).

    token_bytes(hidden_size=5120, num_layers=5, dtype="bf16").total  # 51_209: disk bytes per token (TokenBytes)
    disk = capture_disk(lengths, settings=CaptureSettings(layer_ids=ids), hidden_size=5120)
    disk.total, disk.tensors, disk.headers, disk.manifest           # bytes of the capture directory
    mem = capture_memory(read_target_shape(path), settings=settings, tokens=3072, dtype_bytes=2)
    mem.peak, mem.device, mem.host, mem.lines()                     # bytes; one line per part and moment
    forward_transient(shape, rows=1, tokens=3072, layers=ids)       # bytes one `Target.forward` holds above weights

`settings` is the `CaptureSettings` that `dflashkit.features.capture.capture` takes, `shape` a
`dflashkit.target.shape.TargetShape`.

Disk is exact: per sample, the tensors `capture` writes (its docstring lists them); per shard, a safetensors header
(8 bytes of length + JSON, padded with spaces to a multiple of 8; tensors sorted by dtype, F32 > I32 > BF16 > F16 >
BOOL, then by name), computed entry by entry. Only the manifest's head (paths, fingerprint) and sample ids are guessed.

Memory is modelled from what the code runs, one moment at a time (B·T tokens a forward, H hidden, V vocabulary,
I intermediate, K captured layers); the peak is the resident parts plus the largest moment:
    resident   the target's weights; the samples (int64 ids + bool mask: all are read before capture starts); the
               shard's stored tensors so far (a shard is written once all its samples are captured)
    + forward layers   in the last decoder layer: the embeddings (kept by the HF model's `inputs_embeds`), RoPE's
               cos/sin, the hooked layers' outputs and the layer's input, then the larger of the attention (q's
               per-head norm; RoPE's q·cos, rotate_half(q), ·sin beside q, k, v; o_proj) and the MLP (SiLU(gate),
               up and their product: 3·B·T·I)
    + forward end      the hooked outputs, the final norm, the verifier logits (B, T, V), the features concatenated
               (B, T, K·H) and converted to the storage dtype
    + top-k, stored copies, log-sum-exp   after the forward: its outputs, one chunk of float32 log_softmax
               (`online.topk_logprobs`), the copies kept for the shard, the final state as stored (float32) and a
               chunk of logits with their float32 copy and logsumexp's x − max (`target.logsumexp`)
    The previous forward's outputs (`out`, `feats`, `tokens`, `top`, …) live until the next forward returns: a
    shard of several forwards adds them to the forward's moments.
Checked against PyTorch's CPU allocator (tests/features/test_footprint.py). Not counted: SDPA's per-thread scratch
(< 1 MB a thread), Python objects, the allocator's slack; linear-attention layers count as full-attention ones, a
MoE MLP as a dense one of the config's `intermediate_size` (4·H when it names none).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from dflashkit.features.capture import DEFAULT_SHARD_BYTES, CaptureSettings
from dflashkit.features.manifest import STORAGE_DTYPES, TOPK_BYTES, plan_shards
from dflashkit.target.shape import TargetShape

SAFETENSORS_DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
# safetensors writes tensors sorted by dtype, the later in its enum first (F32 > I32 > BF16 > F16 > BOOL), then name
_DTYPE_ORDER = ("BOOL", "F16", "BF16", "I32", "F32")
_ITEMSIZE = {"BOOL": 1, "F16": 2, "BF16": 2, "I32": 4, "F32": 4}
_SHARD_METADATA = '{"__metadata__":{"format":"dflashkit-features/1"}'  # capture's one metadata key
MANIFEST_HEAD_BYTES = 1024  # manifest.json without its shard and sample rows: paths, fingerprint, data (a guess)
ID_CHARS = 16  # a sample id's characters in the manifest, when the ids are not known
# the chunks of capture's passes over the logits (tests/features/test_footprint.py checks them against their sources)
TOPK_CHUNK_VALUES = 1 << 24  # `features.online.topk_logprobs`: logits per chunk of log_softmax → top-k
LSE_CHUNK_VALUES = 1 << 25  # `target.logsumexp.row_logsumexp`: logits per chunk of the log-sum-exp


# ---------------------------------------------------------------------------------------------------------- disk
@dataclass(frozen=True)
class TokenBytes:
    """Disk bytes per captured token, tensor by tensor (0 for what is not stored)."""

    features: int  # (T, K·H) in the storage dtype
    input_ids: int = 4  # int32
    loss_mask: int = 1  # bool
    target_tokens: int = 0  # int32
    topk: int = 0  # topk_ids (int32) + topk_logprobs (float16), k of each
    target_lse: int = 0  # float32

    @property
    def total(self) -> int:
        return self.features + self.input_ids + self.loss_mask + self.target_tokens + self.topk + self.target_lse


def token_bytes(
    *,
    hidden_size: int,
    num_layers: int,
    dtype: str = "bf16",
    store_target_tokens: bool = True,
    store_topk: int = 0,
    store_target_lse: bool = False,
) -> TokenBytes:
    """What `capture` writes per token: `num_layers` captured layers of `hidden_size` in the storage `dtype`
    ("bf16", "fp16", "fp32"), and what `CaptureSettings` of the same names store beside them."""
    return TokenBytes(
        features=num_layers * hidden_size * STORAGE_DTYPES[dtype].itemsize,
        target_tokens=4 if store_target_tokens else 0,
        topk=store_topk * TOPK_BYTES,
        target_lse=4 if store_target_lse else 0,
    )


def settings_token_bytes(settings: CaptureSettings, *, hidden_size: int) -> TokenBytes:
    """`token_bytes` of what `settings` store."""
    return token_bytes(
        hidden_size=hidden_size,
        num_layers=len(settings.layer_ids),
        dtype=settings.dtype,
        store_target_tokens=settings.store_target_tokens,
        store_topk=settings.store_topk,
        store_target_lse=bool(settings.store_target_lse),
    )


def shard_tokens(settings: CaptureSettings, *, hidden_size: int) -> int:
    """The most tokens one shard holds: `settings.shard_max_tokens`, or capture's default (~1 GiB of data)."""
    if settings.shard_max_tokens is not None:
        return settings.shard_max_tokens
    return max(1, DEFAULT_SHARD_BYTES // settings_token_bytes(settings, hidden_size=hidden_size).total)


@dataclass(frozen=True)
class DiskFootprint:
    """Bytes of a capture directory: `tensors` (the shards' data), `headers` (their safetensors headers) and
    `manifest` (manifest.json, estimated); `shards` files."""

    per_token: TokenBytes
    tokens: int
    shards: int
    tensors: int
    headers: int
    manifest: int

    @property
    def total(self) -> int:
        return self.tensors + self.headers + self.manifest


def _digit_count(numbers: Iterable[int]) -> int:
    """Characters of the numbers written in decimal, all together."""
    return sum(map(len, map(str, numbers)))


def _sample_entries(settings: CaptureSettings, hidden_size: int) -> list[tuple[str, str, int, bool]]:
    """(name suffix, safetensors dtype, values per token, 2-D) of each tensor capture writes per sample."""
    width = len(settings.layer_ids) * hidden_size
    out = [
        ("features", SAFETENSORS_DTYPES[settings.dtype], width, True),
        ("input_ids", "I32", 1, False),
        ("loss_mask", "BOOL", 1, False),
    ]
    if settings.store_target_tokens:
        out.append(("target_tokens", "I32", 1, False))
    if settings.store_topk:
        out += [("topk_ids", "I32", settings.store_topk, True), ("topk_logprobs", "F16", settings.store_topk, True)]
    if settings.store_target_lse:
        out.append(("target_lse", "F32", 1, False))
    return out


@dataclass(frozen=True)
class _HeaderLayout:
    """What every sample adds to a shard's header: `entries` tensors, `fixed` characters whatever its index and
    length, and its tensors' bytes per token in safetensors' order (`groups`: one list per dtype, widest first)."""

    entries: int
    fixed: int
    groups: list[list[int]]


def _header_layout(settings: CaptureSettings, hidden_size: int) -> _HeaderLayout:
    entries = sorted(_sample_entries(settings, hidden_size))  # within a dtype, a sample's names sort by suffix
    entry = len(',"":{"dtype":"","shape":[],"data_offsets":[,]}') + 1  # + the "." of "k.name"
    fixed = sum(
        entry + len(suffix) + len(dt) + (1 + len(str(per)) if two_d else 0) for suffix, dt, per, two_d in entries
    )
    order = sorted({e[1] for e in entries}, key=_DTYPE_ORDER.index, reverse=True)
    groups = [[per * _ITEMSIZE[dt] for _, d, per, _ in entries if d == dt] for dt in order]
    return _HeaderLayout(entries=len(entries), fixed=fixed, groups=groups)


def shard_header_bytes(first: int, lengths: Sequence[int], settings: CaptureSettings, *, hidden_size: int) -> int:
    """The safetensors header of the shard holding samples first … first + len(lengths) − 1: 8 bytes of length and
    the JSON (entries `"k.name":{"dtype":…,"shape":[…],"data_offsets":[a,b]}` in safetensors' order), padded to 8."""
    return _shard_header(first, lengths, _header_layout(settings, hidden_size))


def _shard_header(first: int, lengths: Sequence[int], layout: _HeaderLayout) -> int:
    n = len(_SHARD_METADATA) + 1 + len(lengths) * layout.fixed  # "{" + metadata + entries each after a "," + "}"
    n += layout.entries * (_digit_count(range(first, first + len(lengths))) + _digit_count(lengths))  # "k.", "[T"
    order = sorted(range(len(lengths)), key=lambda i: str(first + i))  # names "k.…" sort as the strings of k
    sizes = [lengths[i] * per for cols in layout.groups for i in order for per in cols]  # in the file's order
    n += 2 * _digit_count(accumulate(sizes)) + 1 - len(str(sum(sizes)))  # each offset ends one entry, starts the next
    return 8 + n + (-n % 8)


def manifest_bytes(lengths: Sequence[int], shards: list[dict[str, Any]], *, id_chars: int = ID_CHARS) -> int:
    """manifest.json of a finished capture of samples of these lengths in `shards` (`plan_shards`' entries, their
    "bytes" filled in): one line per shard and per sample, exact but for the ids (`id_chars` each) and the supervised
    counts (taken as long as the lengths), plus `MANIFEST_HEAD_BYTES` for the rest."""
    shard_row = len('    {"first": , "count": , "tokens": , "file": "", "done": true, "bytes": , "sha256": ""},\n') + 64
    sample_row = len('    {"id": "", "shard": , "length": , "supervised": },\n') + id_chars
    n = MANIFEST_HEAD_BYTES + len(shards) * shard_row + len(lengths) * sample_row + 2 * _digit_count(lengths)
    for j, sh in enumerate(shards):
        n += _digit_count((sh["first"], sh["count"], sh["tokens"], sh["bytes"])) + len(sh["file"])
        n += len(str(j)) * sh["count"]  # each of its samples' "shard": j
    return n


def capture_disk(
    lengths: Sequence[int], *, settings: CaptureSettings, hidden_size: int, id_chars: int = ID_CHARS
) -> DiskFootprint:
    """The capture directory `capture` writes for samples of these lengths (tokens each), shards as it plans them;
    `id_chars`: the characters of a sample id (the manifest lists them)."""
    per = settings_token_bytes(settings, hidden_size=hidden_size)
    shards = plan_shards(list(lengths), shard_tokens(settings, hidden_size=hidden_size))
    layout = _header_layout(settings, hidden_size)
    headers, known = 0, {}  # shards whose indices have one width sort them as numbers: equal lengths, equal headers
    for sh in shards:
        first, last = sh["first"], sh["first"] + sh["count"] - 1
        part = lengths[first : last + 1]
        key = (len(str(first)), tuple(part)) if len(str(first)) == len(str(last)) else None
        header = known.get(key) or _shard_header(first, part, layout)
        if key is not None:
            known[key] = header
        sh["bytes"] = header + sh["tokens"] * per.total
        headers += header
    tokens = sum(lengths)
    return DiskFootprint(
        per_token=per,
        tokens=tokens,
        shards=len(shards),
        tensors=tokens * per.total,
        headers=headers,
        manifest=manifest_bytes(lengths, shards, id_chars=id_chars),
    )


# -------------------------------------------------------------------------------------------------------- memory
def _hooked(target: TargetShape, layers: int | Sequence[int]) -> tuple[int, int, int]:
    """(K captured layers, hooked outputs alive before the last layer, hooked outputs alive at the end: the K and
    the last layer's). A count stands for ids below the last two layers (dflashkit's defaults end at L − 3)."""
    if isinstance(layers, int):
        return layers, layers + 1, layers + 1  # + the last layer's input (an unhooked layer's output)
    last = target.num_layers - 1
    ids = {int(i) for i in layers}
    input_hooked = last == 0 or (last - 1) in ids  # the last layer's input is the embeddings or a hooked output
    return len(ids), len(ids - {last}) + (0 if input_hooked else 1), len(ids | {last})


def forward_moments(
    target: TargetShape,
    *,
    rows: int,
    tokens: int,
    layers: int | Sequence[int],
    dtype_bytes: int = 4,
    feature_bytes: int = 4,
    logits: bool = True,
) -> dict[str, int]:
    """Bytes above the weights at the two peaks of one `Target.forward` over (rows, tokens): "layers" (inside the
    last decoder layer) and "end" (the final norm, the verifier logits, the features concatenated and converted).

    layers: the captured layer ids, or their count; dtype_bytes: the target's weights (4 fp32, 2 bf16);
    feature_bytes: the features as returned (`feature_dtype`; capture: the storage dtype)."""
    n, b, width = rows * tokens, dtype_bytes, target.hidden_size
    hid = n * width * b  # (B, T, H): the residual stream, a norm's output, a layer's output
    q = n * target.num_attention_heads * target.head_dim * b  # (B, nh, T, hd)
    kv = n * target.num_key_value_heads * target.head_dim * b  # (B, nkv, T, hd)
    inter = n * (target.intermediate_size or 4 * width) * b  # (B, T, I); 4·H when the config names no width
    k, kept, kept_end = _hooked(target, layers)
    stream = hid + 2 * tokens * target.head_dim * b  # embeddings (B, T, H) + RoPE's cos, sin (1, T, hd)
    # an RMSNorm computes in float32 whatever the dtype: its input upcast or x², then x·rsqrt and the output
    qnorm = q + 8 * n * target.num_attention_heads * target.head_dim  # q_proj's output + its per-head RMSNorm
    rope = max(4 * q + 2 * kv, 2 * q + 5 * kv)  # q·cos, rotate_half(q), ·sin beside q, k, v (then k's)
    repeat = 2 * q if target.head_dim > 256 and target.num_key_value_heads < target.num_attention_heads else 0
    sdpa = 2 * q + 2 * kv + repeat + n * target.num_attention_heads * 4  # q, k, v (repeated) + out, logsumexp
    attention = hid + max(qnorm, rope, sdpa, hid + 2 * q + 2 * kv)  # the normed input + q, k, v, out, o_proj
    mlp = hid + max(8 * n * width, hid + 3 * inter, 2 * hid + inter)  # the residual + SiLU(gate), up, product
    head = n * target.vocab_size * b if logits else 0  # (B, T, V) verifier logits
    concat = n * k * width * b + (n * k * width * feature_bytes if feature_bytes != b else 0)  # (B, T, K·H) ×2
    end = max(
        stream + kept_end * hid + 8 * n * width,  # the text model's final norm
        kept_end * hid + hid + (max(8 * n * width, hid + head) if logits else 0),  # the verifier's norm, logits
        kept_end * hid + hid + head + concat,  # the features concatenated and converted, beside the logits
    )
    return {"layers": stream + kept * hid + max(attention, mlp), "end": end}


def forward_transient(target: TargetShape, **moments: Any) -> int:
    """The most bytes one `Target.forward` holds above its weights: the larger of `forward_moments(target,
    **moments)` (the same keywords; online features' pass by default: float32 features, logits formed)."""
    return max(forward_moments(target, **moments).values())


@dataclass
class MemoryParts:
    """Bytes of a piece of work: `parts` resident (name → bytes), `phases` its transient moments (the largest
    counts), `notes` how each was obtained. Capture's here (`CaptureMemory`); a training step's: `train.memory`."""

    parts: dict[str, int] = field(default_factory=dict)
    phases: dict[str, int] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def resident(self) -> int:
        return sum(self.parts.values())

    @property
    def peak(self) -> int:
        return self.resident + max(self.phases.values(), default=0)

    def lines(self) -> list[str]:
        """One line per part and phase: name, GiB, how obtained."""
        out = [f"{k:<24} {v / 2**30:9.3f} GiB  {self.notes.get(k, '')}" for k, v in self.parts.items()]
        top = max(self.phases, key=self.phases.__getitem__) if self.phases else None
        for k, v in self.phases.items():
            mark = "  ← the peak" if k == top else ""
            out.append(f"{'+ ' + k:<24} {v / 2**30:9.3f} GiB  {self.notes.get(k, '')}{mark}")
        out.append(f"{'peak':<24} {self.peak / 2**30:9.3f} GiB")
        return out


@dataclass
class CaptureMemory(MemoryParts):
    """Bytes of one capture process: the weights and samples resident, the moments of its largest forward."""

    @property
    def device(self) -> int:
        """The accelerator's share when the target runs on one: its weights and the largest moment (which counts the
        copies for the shard too: they are small beside it)."""
        return self.parts.get("target weights", 0) + max(self.phases.values(), default=0)

    @property
    def host(self) -> int:
        """The host's share when the target runs on an accelerator: the samples and the shard's stored tensors."""
        return self.resident - self.parts.get("target weights", 0)


def _forward_outputs(target: TargetShape, settings: CaptureSettings, n: int, dtype_bytes: int) -> dict[str, int]:
    """What one forward over n tokens leaves to `_capture_shard`: its features, final state and logits, and what is
    derived from them before the copies for the shard (argmax, top-k, the final state as stored, in float32)."""
    b, s = dtype_bytes, STORAGE_DTYPES[settings.dtype].itemsize
    logits = settings.store_target_tokens or settings.store_topk > 0  # the lse takes its own chunks of logits
    return {
        "features": n * len(settings.layer_ids) * target.hidden_size * s,  # (B, T, K·H) storage dtype
        "final state": n * target.hidden_size * b,  # (B, T, H)
        "logits": n * target.vocab_size * b if logits else 0,  # (B, T, V)
        "tokens": n * 8 if settings.store_target_tokens else 0,  # (B, T) int64 argmax
        "top-k": n * settings.store_topk * (8 + 2),  # (B, T, k) int64 ids + float16 log-probs
        # `final_hidden.to(store).float()`: the same tensor only when both are float32
        "stored final": 4 * n * target.hidden_size if settings.store_target_lse and (b, s) != (4, 4) else 0,
    }


def capture_memory(
    target: TargetShape,
    *,
    settings: CaptureSettings,
    tokens: int,
    dtype_bytes: int = 4,
    total_tokens: int | None = None,
    shard_tokens_held: int | None = None,
) -> CaptureMemory:
    """The memory of `capture(target, samples, …, settings=settings)` where the longest samples have `tokens`
    tokens (equal-length samples share a forward of up to `settings.batch_tokens`).

    dtype_bytes: the target's weights as loaded (fp32 on CPU: 4, bf16 on GPUs: 2). total_tokens: all samples'
    tokens (all are in memory; None leaves them out). shard_tokens_held: the tokens of the largest shard (default:
    the settings' shard size, or total_tokens when smaller)."""
    cs, b = settings, dtype_bytes
    rows = max(1, cs.batch_tokens // tokens) if cs.batch_tokens > 0 else 1
    n = rows * tokens
    per = settings_token_bytes(cs, hidden_size=target.hidden_size)
    copies = per.total - per.loss_mask  # per token kept for the shard (the bool mask is the sample's own)
    held = shard_tokens_held or min(shard_tokens(cs, hidden_size=target.hidden_size), total_tokens or 1 << 62)
    est = CaptureMemory()
    est.parts["target weights"] = target.num_parameters * b
    est.notes["target weights"] = f"{target.num_parameters:,} parameters × {b} B"
    if total_tokens is not None:
        est.parts["samples"] = total_tokens * 9
        est.notes["samples"] = "every sample's int64 ids + bool mask, all read before capture starts"
    before = max(0, held - n)
    est.parts["shard buffer"] = before * copies
    est.notes["shard buffer"] = f"the shard's stored tensors before its last forward ({before:,} tokens)"
    out = _forward_outputs(target, cs, n, b)
    previous = sum(out.values()) + n * 8 if before else 0  # + its (B, T) ids: rebound after the next forward
    moments = forward_moments(
        target,
        rows=rows,
        tokens=tokens,
        layers=cs.layer_ids,
        dtype_bytes=b,
        feature_bytes=STORAGE_DTYPES[cs.dtype].itemsize,
        logits=out["logits"] > 0,
    )
    for name, v in moments.items():
        est.phases[f"forward {name}"] = previous + v
    est.notes["forward layers"] = "the last decoder layer: embeddings, RoPE, hooked outputs, then attention or MLP"
    est.notes["forward end"] = "hooked outputs, final norm, logits, the features concatenated and converted"
    if previous:
        for name in moments:
            est.notes[f"forward {name}"] += "; the previous forward's outputs"
    upcast = 4 if b != 4 else 0  # `.float()` copies what is not float32 already
    if cs.store_topk:
        rows_c = min(n, max(1, TOPK_CHUNK_VALUES // target.vocab_size))
        lists = n * cs.store_topk * 10  # the chunks' ids + log-probs, before their concatenation
        chunk = rows_c * target.vocab_size * (4 + upcast) + rows_c * cs.store_topk * 12  # (R, V) float32 + topk
        live = out["features"] + out["final state"] + out["logits"] + out["tokens"]
        est.phases["top-k"] = live + max(chunk + lists, 2 * lists)
        est.notes["top-k"] = f"the forward's outputs + log_softmax over {rows_c} rows × V in float32"
    est.phases["stored copies"] = sum(out.values()) + n * copies
    est.notes["stored copies"] = "the forward's outputs + its tensors copied for the shard"
    if cs.store_target_lse:
        c = min(tokens, max(1, LSE_CHUNK_VALUES // target.vocab_size))
        cv, ch = c * target.vocab_size, c * target.hidden_size  # (c, V), (c, H)
        # the stored float32 slice cast back to the target's dtype, then the norm, logits, their float32 copy, x − max
        chunk = (ch * b if b != 4 else 0) + max(8 * ch, ch * b + cv * b, cv * (b + upcast + 4))
        est.phases["log-sum-exp"] = sum(out.values()) + n * copies + chunk
        est.notes["log-sum-exp"] = f"the stored copies + logits, their float32 copy and x − max over {c} rows"
    return est


__all__ = [
    "ID_CHARS",
    "LSE_CHUNK_VALUES",
    "MANIFEST_HEAD_BYTES",
    "TOPK_CHUNK_VALUES",
    "CaptureMemory",
    "DiskFootprint",
    "MemoryParts",
    "TokenBytes",
    "capture_disk",
    "capture_memory",
    "forward_moments",
    "forward_transient",
    "manifest_bytes",
    "settings_token_bytes",
    "shard_header_bytes",
    "shard_tokens",
    "token_bytes",
]
