"""Known failure classes of dflashkit's dependencies, turned into the one-line form users get for bad input.

    known_failure(exc)   # → "runs/x: Is a directory (expected a file)" or None for anything else

The CLI (`dflashkit.cli.main`) prints a `DFlashError` as one line with exit code 2; the same goes for the
failure classes below, which come from the machine or the files rather than from dflashkit's own logic:

- file system: a missing file, a directory where a file belongs (and the reverse), no permission, a full disk;
- safetensors: an empty, truncated or foreign file (`SafetensorError: invalid header length …`);
- GGUF: a file whose header the `gguf` reader cannot parse;
- allocation: `DefaultCPUAllocator: can't allocate memory`, CUDA out of memory, `MemoryError`;
- devices: CUDA where this torch build or machine has none;
- distributed environment: torchrun variables missing or half set (`env://` rendezvous).

Anything else is a bug: the CLI shows its traceback and asks for a report, so the class of a failure stays
visible. The checks at the boundaries (`dflashkit.validation`, `dflashkit.target.devices`, the readers) catch
most of these with a better message before they happen; this is the net under them.
"""

from __future__ import annotations

import errno
import re

_ALLOCATION = re.compile(r"can't allocate memory|out of memory|CUDA error: out of memory|not enough memory", re.I)
_DEVICE = re.compile(
    r"Torch not compiled with CUDA|no CUDA GPUs are available|Found no NVIDIA driver|"
    r"invalid device ordinal|Expected one of .* device type",
    re.I,
)
_DIST = re.compile(
    r"environment variable (RANK|WORLD_SIZE|MASTER_ADDR|MASTER_PORT|LOCAL_RANK)|"
    r"env:// rendezvous|Error initializing torch\.distributed",
    re.I,
)
_OS_WORDS = {
    errno.ENOENT: "no such file or directory",
    errno.EISDIR: "is a directory (expected a file)",
    errno.ENOTDIR: "is not a directory (a file is in the way)",
    errno.EEXIST: "already exists (as a file where a directory is expected, or the reverse)",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOSPC: "no space left on the device",
    errno.EROFS: "read-only file system",
}


def _oneline(text: object, limit: int = 240) -> str:
    words = " ".join(str(text).split())
    return words if len(words) <= limit else words[: limit - 1] + "…"


def known_failure(exc: BaseException) -> str | None:
    """The one-line message for a known failure class, or None when `exc` is not one (a bug)."""
    if isinstance(exc, OSError) and exc.errno in _OS_WORDS:
        where = " → ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
        return f"{where + ': ' if where else ''}{_OS_WORDS[exc.errno]}"
    if isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and _ALLOCATION.search(str(exc))):
        return (
            f"out of memory ({_oneline(exc, 160)}); reduce the sizes that drive memory (batch_rows, "
            f"max_tokens, max_anchors, model sizes) or use a machine with more memory"
        )
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover — safetensors is a dependency
        SafetensorError = ()
    if SafetensorError and isinstance(exc, SafetensorError):
        return f"unreadable safetensors file ({_oneline(exc)}); the file is empty, truncated or not safetensors"
    if isinstance(exc, (RuntimeError, AssertionError)) and _DEVICE.search(str(exc)):
        return f"device not available ({_oneline(exc)}); use --device cpu or a machine with that device"
    if isinstance(exc, (RuntimeError, ValueError)) and _DIST.search(str(exc)):
        return (
            f"distributed environment incomplete ({_oneline(exc)}); launch with torchrun, or unset RANK, "
            f"WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for one process"
        )
    return None


__all__ = ["known_failure"]
