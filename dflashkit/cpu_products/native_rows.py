"""A product of a few rows compiled for the CPU at hand, as one more candidate products.py times (`native_rows`).

    y = native_product(x, w, b)      # x (M, in) · wᵀ + b → (M, out); builds the kernel on first use
    status()                         # {"available": bool, "library": path or None, "reason": why not, or None}

A decoding step reads every weight once and multiplies it by 1–17 rows: bandwidth-bound in principle, but a BLAS's
GEMM is tuned for large M and its small-M paths differ between CPUs and builds (on some, a few rows cost far more
than one, where the weights' bytes say they should cost about the same: docs/studies.md, "Compiled few-row kernel").
kernels/rows_linear.cpp streams each block of weight rows once, asks for the next block's lines while up to 6 rows
of x are multiplied by it in registers, and sums each output in the same order whatever the other rows. It is
compiled the first time a trial needs it, with the machine's C++ compiler (`$CXX`, else g++, else c++; -O3
-march=native -fopenmp; seconds, once), into the user cache under a name that digests the source, the compiler, the CPU
model and flags and the torch version — a cache shared by two kinds of CPU never hands one the other's
instructions. No compiler, a build that fails or a cache that cannot be written: the candidate is unusable on this
machine (RuntimeError, recorded as such by the chooser: never timed, never chosen) and `status()` says why;
`dflashkit info` prints it. `DFLASHKIT_CHOICES=native=off` leaves it out (and the compiled layers with it).

Each output is the same dot product as F.linear's, summed in another order (float32 rounding differences only).
Only contiguous float32 CPU tensors go through the kernel; anything else runs F.linear.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from dflashkit.cpu_products.choice import Choice
from dflashkit.errors import DFlashError

KERNELS = Path(__file__).with_name("kernels")
SOURCE = KERNELS / "rows_linear.cpp"  # the product; decoder_layer.cpp (a whole layer) is built into the same library
SOURCES = (SOURCE, KERNELS / "decoder_layer.cpp")
HEADERS = (KERNELS / "rows_tiles.h",)
SWITCH = Choice("native", ("on", "off"), stored=False)  # DFLASHKIT_CHOICES=native=off: left out
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17")
BUILD_TIMEOUT_S = 300

_STATE: dict[str, object] = {}  # "lib": the loaded kernel function, or "reason": why there is none
_F32 = torch.float32


def enabled() -> bool:
    """Whether the candidate takes part: not on a machine without a C++ compiler, nor with native=off."""
    return not _switched_off() and _compiler() is not None


def _switched_off() -> bool:
    return SWITCH.override() == "off"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX", "").strip(), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@functools.lru_cache(maxsize=4)
def _compiler_version(cxx: str) -> str:
    try:
        run = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    return run.stdout.splitlines()[0] if run.stdout else "unknown"


def library_path(cxx: str) -> Path:
    """Where the kernel built by `cxx` for this CPU lives: the user cache, under a digest of everything it
    depends on (source, compiler, flags, CPU model and instruction-set flags, torch version)."""
    from dflashkit.cpu_products.machine import cpu_signature
    from dflashkit.io_utils import cache_root

    parts = [source_digest().encode(), _compiler_version(cxx).encode(), " ".join(FLAGS).encode()]
    digest = hashlib.sha256(b"\0".join([*parts, cpu_signature().encode(), torch.__version__.encode()])).hexdigest()[:16]
    return cache_root() / "kernels" / f"rows_linear-{digest}.so"


def source_digest() -> str:
    """A digest of the kernels' source files: a changed kernel is another library, and its choices are timed anew."""
    return hashlib.sha256(b"\0".join(f.read_bytes() for f in (*SOURCES, *HEADERS))).hexdigest()[:16]


def _build(cxx: str, target: Path) -> None:
    """Compile the kernel into `target` (a temporary name renamed into place: concurrent builders never see half a
    file). Raises RuntimeError with the compiler's own message on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cxx, *FLAGS, "-o", tmp, *(str(f) for f in SOURCES)]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"{' '.join(cmd)}: {e}") from None
        if run.returncode != 0:
            tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {run.returncode}): {' | '.join(tail)}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> object:
    """The kernel's entry point, built first when this machine has none; RuntimeError when it cannot be had."""
    if "lib" in _STATE:
        return _STATE["lib"]
    if "reason" in _STATE:
        raise RuntimeError(str(_STATE["reason"]))
    try:
        if _switched_off():
            raise RuntimeError(SWITCH.why("off"))
        cxx = _compiler()
        if cxx is None:
            raise RuntimeError("no C++ compiler on this machine ($CXX, g++, c++)")
        try:
            path = library_path(cxx)
            if not path.is_file():
                _build(cxx, path)
        except (OSError, DFlashError) as e:  # a cache that cannot be written (read-only home, a file in its place)
            raise RuntimeError(f"cannot build the kernel in the user cache: {e}") from None
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise RuntimeError(f"{path}: {e}") from None
        fn = lib.dfk_rows_linear
        fn.restype = None
        p, n = ctypes.c_void_p, ctypes.c_long
        fn.argtypes = [p, n, n, p, n, p, p, ctypes.c_int]
        for name in ("dfk_decoder_layer", "dfk_layer_scratch"):
            entry = getattr(lib, name)
            entry.restype, entry.argtypes = (None if name == "dfk_decoder_layer" else n), [p]
            _STATE[name] = entry
        _STATE["lib"], _STATE["path"] = fn, str(path)
        return fn
    except RuntimeError as e:
        _STATE["reason"] = str(e)
        raise


def status() -> dict[str, object]:
    """{"available", "library", "reason"} — building the kernel now if it was not tried yet in this process."""
    with contextlib.suppress(RuntimeError):  # the reason is kept in _STATE
        _load()
    return {"available": "lib" in _STATE, "library": _STATE.get("path"), "reason": _STATE.get("reason")}


def native_product(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """x (M, in) · wᵀ (+ b) → (M, out) through the compiled kernel; F.linear for what it does not take (not
    contiguous float32 CPU tensors). RuntimeError where the kernel cannot be built (products.py: unusable).
    A decoding pass makes ~200 of these calls: the checks are kept to attribute reads (microseconds a call add up to
    milliseconds a step)."""
    fn = _STATE.get("lib") or _load()
    if (
        x.dtype == _F32
        and w.dtype == _F32
        and x.dim() == 2
        and w.dim() == 2
        and x.is_cpu
        and w.is_cpu
        and w.is_contiguous()
        and (b is None or (b.dtype == _F32 and b.is_cpu and b.is_contiguous() and b.dim() == 1))
    ):
        rows, inner = x.shape
        outer, k = w.shape
        if k == inner and (b is None or b.shape[0] == outer):
            x = x.contiguous()  # (M, in)
            out = torch.empty((rows, outer), dtype=_F32)  # (M, out), row-major as F.linear returns it
            bias = None if b is None else b.data_ptr()
            fn(x.data_ptr(), rows, inner, w.data_ptr(), outer, bias, out.data_ptr(), torch.get_num_threads())
            return out
    return F.linear(x, w, b)  # other dtypes, devices, layouts; torch's own error for shapes that do not fit


def layer_kernel() -> tuple[object, object]:
    """(dfk_decoder_layer, dfk_layer_scratch) of the same library (kernels/decoder_layer.cpp: one decoder layer of a
    Llama-family target per call, target/native_layers.py); RuntimeError where the library cannot be built."""
    _load()
    return _STATE["dfk_decoder_layer"], _STATE["dfk_layer_scratch"]


def reset() -> None:
    """Forget this process's build result (tests: another cache directory, compiler or native=off)."""
    _STATE.clear()


__all__ = [
    "SOURCE",
    "SOURCES",
    "SWITCH",
    "enabled",
    "layer_kernel",
    "library_path",
    "native_product",
    "reset",
    "source_digest",
    "status",
]
