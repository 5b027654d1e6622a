"""The manifest of a feature capture (`manifest.json`) and the arithmetic around it: shard plan, disk size.

    m = Manifest.load("feats/")        # DataError naming the problem when it is not a finished capture dir
    m.complete, m.num_samples, m.total_tokens, m.bytes, m.store_topk
    bytes_per_token(5 * 576, "bf16", True, store_topk=32)   # → 5961: disk bytes per captured token
    m.store_target_lse                 # whether each position's log-sum-exp of the target's logits is stored

Written by `dflashkit.features.capture.capture` (which also describes the shard format) and re-exported from
`dflashkit.features.capture`. Older manifests without `store_topk` read as 0 (no top-k log-probs stored), without
`store_target_lse` as false and without `precision` as None (the target as it was loaded: a resumed capture takes
that), so feature dirs captured before those options stay valid with the same format_version.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflashkit.errors import DataError
from dflashkit.features.manifest_schema import manifest_problem
from dflashkit.io_utils import atomic_write_text

if TYPE_CHECKING:
    from dflashkit.target.model import Target

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
STORAGE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOPK_BYTES = 4 + 2  # per stored top-k entry: an int32 token id + a float16 log-prob


def bytes_per_token(
    feature_dim: int, dtype: str, store_target_tokens: bool, store_topk: int = 0, store_target_lse: bool = False
) -> int:
    """Disk bytes per captured token: features + int32 ids + bool mask (+ int32 target token)
    (+ store_topk × (int32 id + float16 log-prob)) (+ float32 log-sum-exp)."""
    return (
        feature_dim * STORAGE_DTYPES[dtype].itemsize
        + 4
        + 1
        + (4 if store_target_tokens else 0)
        + store_topk * TOPK_BYTES
        + (4 if store_target_lse else 0)
    )


def plan_shards(lengths: Sequence[int], shard_max_tokens: int) -> list[dict[str, Any]]:
    """Greedy, order-preserving split into shards of whole samples with ≤ shard_max_tokens tokens (≥ 1 sample)."""
    shards: list[dict[str, Any]] = []
    first, tokens = 0, 0
    for i, n in enumerate(lengths):
        if i > first and tokens + n > shard_max_tokens:
            shards.append({"first": first, "count": i - first, "tokens": tokens})
            first, tokens = i, 0
        tokens += n
    shards.append({"first": first, "count": len(lengths) - first, "tokens": tokens})
    for j, s in enumerate(shards):
        s.update(file=f"shard-{j:05d}.safetensors", done=False, bytes=0)
    return shards


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


@dataclass
class Manifest:
    """Contents of manifest.json (see `dflashkit.features.capture`); totals are derived, never trusted from disk."""

    target: dict[str, Any]
    layer_ids: list[int]
    dtype: str
    store_target_tokens: bool
    shard_max_tokens: int
    samples_sha256: str
    tokens_file: str | None
    shards: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    format_version: int = FORMAT_VERSION
    store_topk: int = 0  # top-k log-probs stored per position (0: none; manifests older than the option)
    store_target_lse: bool = False  # the target's log-sum-exp stored per position (false in older manifests)
    # what the target computed in (features.capture_precision): fp32, bf16 (autocast), bf16-weights /
    # fp16-weights (a target loaded so); None in manifests older than the field (the target as it was loaded)
    precision: str | None = None
    data: dict[str, Any] = field(default_factory=dict)  # how the tokens were prepared (thinking, turns); {} unknown
    run_stats: dict[str, float] = field(default_factory=dict, repr=False)  # this process only, never saved

    @property
    def complete(self) -> bool:
        return all(s["done"] for s in self.shards)

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    @property
    def total_tokens(self) -> int:
        return sum(s["length"] for s in self.samples)

    @property
    def total_supervised(self) -> int:
        return sum(s["supervised"] for s in self.samples)

    @property
    def done_samples(self) -> int:
        return sum(s["count"] for s in self.shards if s["done"])

    @property
    def bytes(self) -> int:
        return sum(s["bytes"] for s in self.shards)

    @property
    def feature_dim(self) -> int:
        return len(self.layer_ids) * int(self.target["hidden_size"])

    def get(self, dotted: str) -> Any:
        obj: Any = self
        for part in dotted.split("."):
            obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
        return obj

    def to_json(self) -> str:
        """JSON text with one line per shard and per sample (readable, and small for 100K+ samples)."""
        head = {
            "format_version": self.format_version,
            "target": self.target,
            "layer_ids": self.layer_ids,
            "dtype": self.dtype,
            "store_target_tokens": self.store_target_tokens,
            "store_topk": self.store_topk,
            "store_target_lse": self.store_target_lse,
            "precision": self.precision,
            "shard_max_tokens": self.shard_max_tokens,
            "tokens_file": self.tokens_file,
            "data": self.data,
            "samples_sha256": self.samples_sha256,
            "totals": {
                "samples": self.num_samples,
                "tokens": self.total_tokens,
                "supervised": self.total_supervised,
                "done_samples": self.done_samples,
                "bytes": self.bytes,
                "complete": self.complete,
            },
        }
        parts = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in head.items()]
        for key, rows in (("shards", self.shards), ("samples", self.samples)):
            body = ",\n".join("    " + json.dumps(r) for r in rows)
            parts.append(f'  "{key}": [\n{body}\n  ]')
        return "{\n" + ",\n".join(parts) + "\n}\n"

    def save(self, out_dir: str | Path) -> None:
        atomic_write_text(Path(out_dir) / MANIFEST_NAME, self.to_json())

    @classmethod
    def load(cls, out_dir: str | Path) -> Manifest:
        out_dir = Path(out_dir)
        what = "expected a directory written by `dflashkit capture`"
        if not out_dir.is_dir():
            raise DataError(f"capture dir {out_dir} does not exist ({what})")
        path = out_dir / MANIFEST_NAME
        if not path.is_file():
            raise DataError(f"capture dir {out_dir} has no {MANIFEST_NAME} ({what})")
        try:
            raw = json.loads(path.read_text())
            version = raw.get("format_version")
            if version != FORMAT_VERSION:
                raise DataError(
                    f"{path}: format_version {version!r}, expected {FORMAT_VERSION}; recapture it with this dflashkit"
                )
            why = manifest_problem(raw)
            if why:
                raise DataError(f"{path}: malformed manifest ({why}); {what}")
            topk = raw.get("store_topk", 0)  # absent in manifests written before the option
            lse = raw.get("store_target_lse", False)  # absent in manifests written before the option
            return cls(
                **{
                    k: raw[k]
                    for k in (
                        "target",
                        "layer_ids",
                        "dtype",
                        "store_target_tokens",
                        "shard_max_tokens",
                        "samples_sha256",
                        "tokens_file",
                        "shards",
                        "samples",
                    )
                },
                store_topk=topk,
                store_target_lse=lse,
                precision=raw.get("precision"),  # absent in manifests written before it was recorded
                data=dict(raw.get("data") or {}),  # absent in manifests written before it was recorded
            )
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not valid UTF-8 (byte offset {e.start}); {what}") from None
        except (KeyError, TypeError, AttributeError) as e:
            raise DataError(f"{path}: malformed manifest (missing or bad field {e}); {what}") from None


def target_fingerprint(target: Target) -> str:
    """Cheap, stable identity of a target: its text config (minus paths/dtype), parameter shapes, a few weights.

    Weight slices are hashed after rounding to bf16, so the same checkpoint loaded in fp32 or bf16 matches.
    """
    cfg = target.text_config.to_dict()
    for k in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash", "use_cache"):
        cfg.pop(k, None)
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
    params = dict(target.model.named_parameters())
    for name in sorted(params):
        h.update(f"{name}:{list(params[name].shape)};".encode())
    for w in (
        target.embed_weight,
        target.lm_head_weight,
        next(target.layers[0].parameters()),
        next(target.layers[-1].parameters()),
    ):
        head = w.detach().reshape(-1)[:256].cpu().to(torch.bfloat16)  # (≤256,)
        h.update(head.view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "STORAGE_DTYPES",
    "TOPK_BYTES",
    "Manifest",
    "bytes_per_token",
    "format_bytes",
    "plan_shards",
]
