"""Checking capture shards (`shard-*.safetensors`) against what their manifest entry recorded at write time.

Each finished shard entry of manifest.json holds `bytes` (file size) and `sha256`
(of the whole file, computed from the written temp file before it is renamed into place). `shard_problem`
says why a shard on disk does not match — missing, wrong size (a truncated copy, a full disk), unreadable
safetensors header, or a different checksum — or returns None. Older manifests without `sha256` fall back to
the size and header checks; entries without `bytes` to the header check alone.

    capture   re-verifies every finished shard before resuming (checksums included unless verify="size") and
              redoes the damaged ones
    training  checks sizes when it opens a capture, and each shard's header and checksum when it first reads
              from it (once per shard and run); a damaged shard is refused, named, with the advice to re-run
              `dflashkit capture`
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

VERIFY_MODES = ("full", "size")
_CHUNK = 8 << 20


def file_sha256(path: str | Path) -> str:
    """sha256 hex digest of a file, read in 8 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def header_problem(path: str | Path) -> str | None:
    """Why `path` is not a readable safetensors file (header parsed, data length checked), or None."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            handle.keys()
    except Exception as e:
        return f"is not a readable safetensors file ({' '.join(str(e).split())[:200]})"
    return None


def size_problem(path: str | Path, entry: dict[str, Any]) -> str | None:
    """Why the file size differs from the manifest's `bytes` (None when it matches or was not recorded)."""
    path = Path(path)
    if not path.is_file():
        return "is missing"
    want = entry.get("bytes")
    have = path.stat().st_size
    if isinstance(want, int) and want > 0 and have != want:
        what = "truncated" if have < want else "larger than written"
        return f"is {have:,} bytes where the manifest recorded {want:,} ({what})"
    return None


def shard_problem(path: str | Path, entry: dict[str, Any], *, checksum: bool = True) -> str | None:
    """Why the shard file at `path` does not match its manifest entry, or None when it does.

    checksum=False skips the sha256 (a full read of the file); size and header are always checked."""
    problem = size_problem(path, entry) or header_problem(path)
    if problem is None and checksum and entry.get("sha256"):
        digest = file_sha256(path)
        if digest != entry["sha256"]:
            problem = f"has sha256 {digest[:12]}… where the manifest recorded {str(entry['sha256'])[:12]}… (damaged)"
    return problem
