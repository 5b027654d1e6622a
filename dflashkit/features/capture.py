"""Target features for training: captured once to sharded safetensors files, or computed online.

    capture(target, samples, out_dir, settings=CaptureSettings(layer_ids=(1, 8, 14, 20, 27)))  # → Manifest; resumable
    CaptureSettings(layer_ids=ids, store_topk=32)         # + top-32 log-probs per position
    CaptureSettings(layer_ids=ids, store_target_lse=True) # + log-sum-exp of the logits
    CapturedFeatures(out_dir, ...)[i]       # reading it back: dflashkit.features.captured
    OnlineFeatures(target, samples, ...)[i] # the same features, nothing on disk: dflashkit.features.online

The feature of layer i is the output of decoder layer i (HF `output_hidden_states[i + 1]`), concatenated in
`layer_ids` order → (T, K·H) per sample. `target_tokens` are the argmax of the verifier logits, i.e. the
target's FINAL layer through its final norm and LM head (never an intermediate layer).

On-disk format (format_version 1), one directory:
    manifest.json            written atomically at the start and after every finished shard
    shard-00000.safetensors  several whole samples each, written atomically; for global sample index k:
        "{k}.features"       (T, K·H) storage dtype (bf16 / fp16 / fp32)
        "{k}.input_ids"      (T,) int32
        "{k}.loss_mask"      (T,) bool
        "{k}.target_tokens"  (T,) int32, only when store_target_tokens
        "{k}.topk_ids"       (T, K) int32, only when store_topk = K > 0: the K most likely next tokens
        "{k}.topk_logprobs"  (T, K) float16, their log-probs under the full softmax (log_softmax over the whole
                             vocabulary of the verifier logits, then topk; descending). float16 is ample for
                             log-probs (error ≤ |ℓ|·2^-11, see `dflashkit.features.online`); they train
                             `loss: topk` without running the target (6·K bytes per token: 192 B for K = 32)
        "{k}.target_lse"     (T,) float32, only when store_target_lse: log Σ_v exp(logit_v) of the verifier logits
                             of the final layer's output *as stored* (rounded to the storage dtype), so with the
                             logits of a reduced draft vocabulary formed from the same stored state in training it
                             gives the target's exact probabilities (DSpark's L1 term) without a full-vocabulary
                             product per epoch (`dflashkit.target.logsumexp`)
The manifest (`Manifest`, in `dflashkit.features.manifest`) holds the target (source, architecture,
num_layers, hidden_size, fingerprint), layer_ids, dtype, store_target_tokens, store_topk (0 when absent, so older
manifests stay valid), the shard plan (file, first sample, count, tokens, done, bytes, sha256), one entry per
sample (id, shard, length, supervised), totals, the tokens file and a digest of the samples. The shard plan is
a pure function of the samples and `shard_max_tokens`, so a killed run resumes by redoing only the shards not
marked done (or damaged: `dflashkit.features.shards`), and the result is byte-identical to an uninterrupted run. The
default storage dtype is bf16 (half the disk of fp32; features are converted to float32 when read); pass
dtype="fp32" for bit-exact features.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import Tensor
from tqdm import tqdm

from dflashkit.data.samples import Sample, check_token_ids
from dflashkit.errors import DataError
from dflashkit.features.capture_compile import CaptureForwards
from dflashkit.features.capture_precision import as_loaded, capture_precision
from dflashkit.features.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    STORAGE_DTYPES,
    TOPK_BYTES,
    Manifest,
    bytes_per_token,
    format_bytes,
    plan_shards,
    target_fingerprint,
)
from dflashkit.features.online import topk_logprobs
from dflashkit.features.rank_shards import fold_rank_records, owned_by, record_finished
from dflashkit.features.shards import VERIFY_MODES, file_sha256, shard_problem
from dflashkit.io_utils import atomic_path, remove_interrupted_writes
from dflashkit.output_dir import one_writer
from dflashkit.target.distributed import DistContext
from dflashkit.target.logsumexp import row_logsumexp

if TYPE_CHECKING:
    from dflashkit.target.model import Target

DEFAULT_SHARD_BYTES = 1 << 30  # default shard size: ~1 GiB of features, whatever the target's width
_RESUME_FIELDS = (
    "target.fingerprint",
    "target.num_layers",
    "target.hidden_size",
    "layer_ids",
    "dtype",
    "store_target_tokens",
    "store_topk",
    "store_target_lse",
    "precision",
    "samples_sha256",
    "shard_max_tokens",
)


def samples_digest(samples: Sequence[Sample]) -> str:
    """sha256 over every sample's id, input_ids and loss_mask: a resumed capture must see the same data."""
    h = hashlib.sha256()
    for s in samples:
        h.update(s.id.encode() + b"\0")
        h.update(s.input_ids.to(torch.int64).numpy().tobytes())
        h.update(s.loss_mask.to(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _new_manifest(
    target: Target,
    samples: Sequence[Sample],
    *,
    layer_ids: list[int],
    dtype: str,
    store_target_tokens: bool,
    store_topk: int,
    shard_max_tokens: int,
    tokens_file: str | None,
    data: dict[str, Any] | None = None,
    store_target_lse: bool = False,
    precision: str = "fp32",
) -> Manifest:
    shards = plan_shards([len(s) for s in samples], shard_max_tokens)
    entries: list[dict[str, Any]] = []
    for j, sh in enumerate(shards):
        for s in samples[sh["first"] : sh["first"] + sh["count"]]:
            entries.append({"id": s.id, "shard": j, "length": len(s), "supervised": s.num_supervised})
    info = {
        "source": target.source,
        "architecture": target.architecture,
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "fingerprint": target_fingerprint(target),
    }
    return Manifest(
        target=info,
        layer_ids=layer_ids,
        dtype=dtype,
        store_target_tokens=store_target_tokens,
        shard_max_tokens=shard_max_tokens,
        samples_sha256=samples_digest(samples),
        tokens_file=tokens_file,
        shards=shards,
        samples=entries,
        store_topk=store_topk,
        store_target_lse=store_target_lse,
        precision=precision,
        data=dict(data or {}),
    )


def _resume(
    out_dir: Path, fresh: Manifest, log: Callable[[str], None], verify: str = "full", loaded: str = "fp32"
) -> Manifest:
    """The manifest to work from: `fresh`, or the one already in out_dir when every setting matches; finished
    shards that no longer match their entry (size, header, sha256 unless verify="size") are marked to redo.
    `loaded`: the precision of the target as loaded, what a manifest older than the field was captured in."""
    if not (out_dir / MANIFEST_NAME).is_file():
        return fresh
    old = Manifest.load(out_dir)
    if old.precision is None:
        old.precision = loaded
    for name in _RESUME_FIELDS:
        if old.get(name) != fresh.get(name):
            raise DataError(
                f"{out_dir} already holds a capture with {name} {old.get(name)!r} but this run has "
                f"{fresh.get(name)!r}; rerun with the same settings to resume it, or use another --out"
            )
    for sh in old.shards:
        problem = shard_problem(out_dir / sh["file"], sh, checksum=verify == "full") if sh["done"] else None
        if problem:
            log(f"capture: {sh['file']} is listed as done but {problem}; capturing it again")
            sh["done"], sh["bytes"] = False, 0
            sh.pop("sha256", None)
    return old


def _capture_shard(
    target: Target,
    chunk: Sequence[Sample],
    first: int,
    *,
    layer_ids: list[int],
    store: torch.dtype,
    store_target_tokens: bool,
    store_topk: int,
    batch_tokens: int,
    bar: tqdm,
    forward: CaptureForwards,
    store_target_lse: bool = False,
) -> dict[str, Tensor]:
    """Run the target over one shard's samples (`forward`: in the capture's precision, compiled or not); equal-length
    samples may share a forward (no padding)."""
    groups: list[list[int]] = []
    for i in sorted(range(len(chunk)), key=lambda i: (len(chunk[i]), i)) if batch_tokens > 0 else range(len(chunk)):
        n = len(chunk[i])
        if groups and len(chunk[groups[-1][0]]) == n and (len(groups[-1]) + 1) * n <= batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    tensors: dict[str, Tensor] = {}
    for g in groups:
        ids = torch.stack([chunk[i].input_ids for i in g])  # (B, T)
        logits = store_target_tokens or store_topk > 0
        out = forward(ids, layer_ids=layer_ids, logits=logits, feature_dtype=store)
        feats = out.features.cpu()  # (B, T, K·H) in the storage dtype
        tokens = out.logits.argmax(-1).cpu() if store_target_tokens else None  # (B, T) final-layer argmax
        top = [t.cpu() for t in topk_logprobs(out.logits, store_topk)] if store_topk else None  # (B, T, k) ×2
        # of the final layer's output as stored (training forms its draft-vocabulary logits from that)
        stored_final = out.final_hidden.to(store).float() if store_target_lse else None  # (B, T, H)
        for b, i in enumerate(g):
            k, s = first + i, chunk[i]
            tensors[f"{k}.features"] = feats[b].clone()  # clone: safetensors refuses tensors sharing storage
            tensors[f"{k}.input_ids"] = s.input_ids.to(torch.int32)
            tensors[f"{k}.loss_mask"] = s.loss_mask.to(torch.bool)
            if tokens is not None:
                tensors[f"{k}.target_tokens"] = tokens[b].to(torch.int32)
            if top is not None:
                tensors[f"{k}.topk_ids"] = top[0][b].to(torch.int32)  # (T, k)
                tensors[f"{k}.topk_logprobs"] = top[1][b].clone()  # (T, k) float16
            if stored_final is not None:
                tensors[f"{k}.target_lse"] = row_logsumexp(target, stored_final[b]).cpu()  # (T,) float32
        bar.update(ids.numel())
    return tensors


@dataclass(frozen=True)
class CaptureSettings:
    """What `capture` stores per token, and how it checks a resumed run.

    layer_ids: the target's decoder layers whose outputs are stored (0-based; the drafter's `target_layer_ids`).
    dtype: storage type of the features ("bf16", "fp16", "fp32").
    store_target_tokens: also store the target's final-layer argmax per position (`labels: target`).
    store_topk: K > 0 also stores the target's top-K log-probs per position (for `loss: topk`; 0 = off).
    store_target_lse: also stores the log-sum-exp of the target's logits per position (DSpark with a reduced draft
    vocabulary: training then never forms all V logits; costs one more LM-head pass at capture, 4 B per token).
    shard_max_tokens: tokens per shard (None: ~1 GiB of features; a resumed run keeps the existing plan).
    batch_tokens: > 0 lets equal-length samples of a shard share one forward of ≤ batch_tokens tokens
    (0 = one sequence per forward, bit-identical to a plain per-sample forward).
    verify: how a resumed run checks finished shards: "full" (size, header, sha256) or "size" (no full read of
    a very large capture); damaged shards are captured again.
    precision: what the target computes in: "fp32" (a float32 target as loaded, the reference), "bf16" (autocast),
    or "auto" (timed on this machine: `dflashkit.features.capture_precision`); a resumed capture keeps its own.
    compile: whether the target's decoder layers run through torch.compile: "auto" (where measured to pay:
    `dflashkit.features.capture_compile`), "on", "off".
    """

    layer_ids: tuple[int, ...]
    dtype: str = "bf16"
    store_target_tokens: bool = True
    store_topk: int = 0
    store_target_lse: bool = False
    shard_max_tokens: int | None = None
    batch_tokens: int = 0
    verify: str = "full"
    precision: str = "auto"
    compile: str = "auto"


def capture(
    target: Target,
    samples: Sequence[Sample],
    out_dir: str | Path,
    *,
    settings: CaptureSettings,
    tokens_file: str | Path | None = None,
    data: dict[str, Any] | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
    on_shard: Callable[[int, Manifest], None] | None = None,
    dist: DistContext | None = None,
) -> Manifest:
    """Capture the features `settings` names (and final-layer argmax tokens) of every sample into `out_dir`;
    resumable.

    tokens_file: the tokens.jsonl the samples came from, recorded in the manifest.
    data: how the tokens were prepared (`dflashkit.data.thinking.data_info`), recorded for training to carry on.
    on_shard(shard_index, manifest) is called after each shard is on disk and the manifest updated.
    dist: torchrun ranks (`DistContext.from_env`): each captures its share of the shards, rank 0 keeps the one
    manifest (`dflashkit.features.rank_shards`); every rank returns the complete manifest.
    """
    cs = settings
    log = log or (lambda _msg: None)
    dist = dist or DistContext()
    layer_ids = [int(i) for i in cs.layer_ids]
    _check_arguments(target, samples, layer_ids, cs.dtype, cs.verify, cs.store_topk)
    out_dir = Path(out_dir)
    main_log = log if dist.is_main else (lambda _msg: None)
    with one_writer(out_dir, "dflashkit capture", enabled=dist.is_main):
        per_token = bytes_per_token(
            len(layer_ids) * target.hidden_size,
            cs.dtype,
            cs.store_target_tokens,
            cs.store_topk,
            bool(cs.store_target_lse),
        )
        shard_max_tokens = cs.shard_max_tokens
        if shard_max_tokens is None:
            existing = out_dir / MANIFEST_NAME
            shard_max_tokens = (
                Manifest.load(out_dir).shard_max_tokens
                if existing.is_file()
                else max(1, DEFAULT_SHARD_BYTES // per_token)
            )
        if shard_max_tokens < 1:
            raise DataError(f"shard_max_tokens must be ≥ 1, got {shard_max_tokens}")
        precision = _precision(target, samples, out_dir, cs.precision, dist, main_log)
        fresh = _new_manifest(
            target,
            samples,
            layer_ids=layer_ids,
            dtype=cs.dtype,
            store_target_tokens=cs.store_target_tokens,
            store_topk=cs.store_topk,
            shard_max_tokens=int(shard_max_tokens),
            tokens_file=None if tokens_file is None else str(Path(tokens_file).resolve()),
            data=data,
            store_target_lse=bool(cs.store_target_lse),
            precision=precision,
        )
        if dist.is_main:
            manifest = _resume(out_dir, fresh, log, cs.verify, loaded=as_loaded(target))
            folded = fold_rank_records(out_dir, manifest, verify=cs.verify, log=log)  # of a killed multi-rank run
            if folded or (dist.distributed and (out_dir / MANIFEST_NAME).is_file()):
                manifest.save(out_dir)  # the other ranks read what rank 0 found (damaged shards to redo)
        dist.barrier()  # rank 0 has checked (and maybe repaired) what is on disk
        if not dist.is_main:
            manifest = Manifest.load(out_dir) if (out_dir / MANIFEST_NAME).is_file() else fresh
        mine = [j for j, sh in enumerate(manifest.shards) if not sh["done"] and owned_by(j, dist.rank, dist.world_size)]
        all_todo = [j for j, sh in enumerate(manifest.shards) if not sh["done"]]
        manifest.run_stats = {"tokens": 0, "seconds": 0.0, "shards": 0}
        if not all_todo:
            main_log(
                f"capture: {out_dir} is already complete ({manifest.num_samples} samples, {manifest.total_tokens:,} "
                f"tokens); nothing to do"
            )
            return manifest
        if dist.is_main:
            remove_interrupted_writes(out_dir)  # temp files of a run killed mid-write (we hold the lock)
            _check_disk(target, manifest, out_dir, all_todo, per_token, log)
            manifest.save(out_dir)
            if dist.distributed:
                n = dist.world_size
                log(f"capture: {len(all_todo)} shard(s) over {n} ranks (shard j → rank j mod {n})")
        dist.barrier()  # the manifest is on disk before any rank writes next to it
        _capture_shards(
            target,
            samples,
            out_dir,
            manifest,
            mine,
            dist,
            layer_ids,
            cs,
            progress=progress,
            on_shard=on_shard,
            log=log,
        )
        if dist.distributed:
            dist.barrier()  # every rank's shards and records are on disk
            if dist.is_main:
                fold_rank_records(out_dir, manifest, verify="size", log=log)
                manifest.save(out_dir)
            dist.barrier()
            if not dist.is_main:
                stats = manifest.run_stats
                manifest = Manifest.load(out_dir)
                manifest.run_stats = stats
        return manifest


def _precision(
    target: Target,
    samples: Sequence[Sample],
    out_dir: Path,
    requested: str,
    dist: DistContext,
    log: Callable[[str], None],
) -> str:
    """The precision of this capture: a resumed one's own under "auto" (one capture never mixes two), else as
    `capture_precision` resolves `requested` (timed alike on every rank)."""
    if requested == "auto" and (out_dir / MANIFEST_NAME).is_file():  # checked against the target's dtype below
        requested = Manifest.load(out_dir).precision or as_loaded(target)
    reduce = dist.all_reduce if dist.distributed else None
    precision, ms = capture_precision(target, [len(s) for s in samples], requested, all_reduce=reduce)
    if ms:
        log(
            f"capture: the target computes in {precision} (one forward timed: fp32 {ms['fp32']:,.0f} ms, "
            f"bf16 autocast {ms['bf16']:,.0f} ms; kept for this machine)"
        )
    return precision


def _capture_shards(
    target: Target,
    samples: Sequence[Sample],
    out_dir: Path,
    manifest: Manifest,
    todo: list[int],
    dist: DistContext,
    layer_ids: list[int],
    cs: CaptureSettings,
    *,
    progress: bool,
    on_shard: Callable[[int, Manifest], None] | None,
    log: Callable[[str], None],
) -> None:
    """Capture this rank's shards `todo`; one process saves the manifest after each, a rank its own record."""
    todo_tokens = sum(manifest.shards[j]["tokens"] for j in todo)
    forwards = CaptureForwards.start(
        target,
        manifest.precision,
        cs.compile,
        tokens_left=todo_tokens,
        log=log if dist.is_main else (lambda _msg: None),
        distributed=dist.distributed,
        write=dist.is_main,
    )
    total = todo_tokens if dist.distributed else manifest.total_tokens
    t0 = time.perf_counter()
    finished: list[int] = []
    with tqdm(
        total=total,
        initial=total - todo_tokens,
        unit="tok",
        unit_scale=True,
        desc="capture" + (f" (rank {dist.rank}/{dist.world_size})" if dist.distributed else ""),
        disable=not progress,
        dynamic_ncols=True,
    ) as bar:
        for j in todo:
            sh = manifest.shards[j]
            tensors = _capture_shard(
                target,
                samples[sh["first"] : sh["first"] + sh["count"]],
                sh["first"],
                layer_ids=layer_ids,
                store=STORAGE_DTYPES[cs.dtype],
                store_target_tokens=cs.store_target_tokens,
                store_topk=cs.store_topk,
                batch_tokens=cs.batch_tokens,
                bar=bar,
                store_target_lse=bool(cs.store_target_lse),
                forward=forwards,
            )
            _write_shard(out_dir, sh, tensors)
            finished.append(j)
            if dist.distributed:
                record_finished(out_dir, dist.rank, manifest, finished)
            else:
                manifest.save(out_dir)
            manifest.run_stats["tokens"] += sh["tokens"]
            manifest.run_stats["shards"] += 1
            manifest.run_stats["seconds"] = time.perf_counter() - t0
            if on_shard is not None:
                on_shard(j, manifest)


def _check_arguments(
    target: Target, samples: Sequence[Sample], layer_ids: list[int], dtype: str, verify: str, store_topk: int
) -> None:
    target.check_layer_ids(layer_ids)
    if dtype not in STORAGE_DTYPES:
        raise DataError(f"capture dtype {dtype!r} is not supported; expected one of {sorted(STORAGE_DTYPES)}")
    if not samples:
        raise DataError("capture: no samples to capture (empty dataset)")
    if verify not in VERIFY_MODES:
        raise DataError(f"capture verify={verify!r}: expected one of {list(VERIFY_MODES)}")
    if not isinstance(store_topk, int) or isinstance(store_topk, bool) or not 0 <= store_topk <= target.vocab_size:
        raise DataError(
            f"capture store_topk={store_topk!r}: expected an integer from 0 (off) to the target's "
            f"vocabulary size {target.vocab_size}"
        )
    check_token_ids(samples, target.vocab_size, what=f"the target {target.source}")


def _check_disk(
    target: Target, manifest: Manifest, out_dir: Path, todo: list[int], per_token: int, log: Callable[[str], None]
) -> None:
    """Say what will be written and refuse before any work when the disk cannot hold it."""
    todo_tokens = sum(manifest.shards[j]["tokens"] for j in todo)
    need = todo_tokens * per_token
    free = shutil.disk_usage(out_dir).free
    dtype, topk = manifest.dtype, manifest.store_topk
    log(
        f"capture: {manifest.num_samples} samples, {manifest.total_tokens:,} tokens × {len(manifest.layer_ids)} "
        f"layers × {target.hidden_size} hidden × {STORAGE_DTYPES[dtype].itemsize} B ({dtype})"
        f"{' + target tokens' if manifest.store_target_tokens else ''}"
        f"{f' + top-{topk} log-probs ({topk * TOPK_BYTES} B/token)' if topk else ''}"
        f"{' + target log-sum-exp (4 B/token)' if manifest.store_target_lse else ''}"
        f" ≈ {format_bytes(manifest.total_tokens * per_token)}; "
        f"to write now: {todo_tokens:,} tokens in {len(todo)} shard(s) ≈ {format_bytes(need)}; "
        f"free at {out_dir}: {format_bytes(free)}"
    )
    if need * 1.02 + (16 << 20) > free:
        raise DataError(
            f"not enough disk space in {out_dir}: the capture needs ≈ {format_bytes(need)} but only "
            f"{format_bytes(free)} is free; free space, use --dtype bf16, --limit, or another --out"
        )


def _write_shard(out_dir: Path, sh: dict[str, Any], tensors: dict[str, Tensor]) -> None:
    """Write one shard atomically and record its size and checksum in its manifest entry `sh`."""
    path = out_dir / sh["file"]
    with atomic_path(path) as tmp:
        # one metadata key only: safetensors writes metadata in hash order, so several would make
        # otherwise identical shards differ byte-wise between runs
        save_file(tensors, str(tmp), metadata={"format": f"dflashkit-features/{FORMAT_VERSION}"})
        digest = file_sha256(tmp)  # of what reached the disk; re-checked on resume (dflashkit.features.shards)
    sh["done"], sh["bytes"], sh["sha256"] = True, path.stat().st_size, digest


__all__ = ["DEFAULT_SHARD_BYTES", "capture", "samples_digest"]
