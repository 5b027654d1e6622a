"""What machine a speed figure comes from: the CPU model and its vector extensions, torch's BLAS, threads — and a
quick measurement of memory bandwidth, the floor under every decoding step of a memory-bound model.

    describe_machine()          # {"cpu": "AMD EPYC", "flags": ["avx2"], "blas": "MKL 2024.2", "threads": 2, …}
    read_bandwidth()            # bytes/s a large read sustains (one sum over 256 MiB, best of a few)

Every speed figure in the docs names these; `choose` in products.py keys its measured choices by them.
"""

from __future__ import annotations

import functools
import platform
import re
import time
from pathlib import Path

import torch

FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "neon", "sve")


@functools.lru_cache(maxsize=1)
def _cpu_lines() -> tuple[str, str]:
    """(model name, the whole flags line) of the first core in /proc/cpuinfo (all cores share them); the platform's
    processor or machine name and no flags where there is no /proc."""
    model = platform.processor() or platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return model, ""
    m = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    f = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", text, re.M)
    return (m.group(1).strip() if m else model), (f.group(1).strip() if f else "")


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, tuple[str, ...]]:
    model, flags = _cpu_lines()
    have = set(flags.split())
    return model, tuple(x for x in FLAGS if x in have)


def cpu_signature() -> str:
    """The CPU model and every instruction-set flag it reports: what a binary built with -march=native depends on
    (native_rows.py keys its compiled kernel by it)."""
    model, flags = _cpu_lines()
    return f"{model}\n{flags}"


@functools.lru_cache(maxsize=1)
def blas() -> str:
    """torch's CPU BLAS as its build config names it, e.g. "MKL 2024.2" or "OpenBLAS"."""
    config = torch.__config__.show()
    m = re.search(r"Math Kernel Library Version ([\d.]+)", config)
    if m:
        return f"MKL {'.'.join(m.group(1).split('.')[:2])}"
    m = re.search(r"BLAS_INFO=(\w+)", config)
    return m.group(1) if m else "unknown BLAS"


def describe_machine() -> dict[str, object]:
    model, flags = _cpuinfo()
    return {
        "cpu": model,
        "flags": list(flags),
        "blas": blas(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def machine_line() -> str:
    """'AMD EPYC (avx2), MKL 2024.2, torch 2.13.0, 2 threads' — for reports and benchmark headers."""
    d = describe_machine()
    flags = f" ({', '.join(d['flags'])})" if d["flags"] else ""
    return f"{d['cpu']}{flags}, {d['blas']}, torch {d['torch']}, {d['threads']} threads"


@functools.lru_cache(maxsize=1)
def last_level_cache_bytes() -> int:
    """The largest CPU cache (Linux sysfs), or 32 MiB when it cannot be read."""
    best = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (d / "size").read_text().strip().upper()
        except OSError:
            continue
        m = re.fullmatch(r"(\d+)([KMG]?)", text)
        if m:
            best = max(best, int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)])
    return best or 32 << 20


def read_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second one large read sustains on this machine (the best of `repeats` sums over `mib` MiB)."""
    x = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


__all__ = ["blas", "cpu_signature", "describe_machine", "last_level_cache_bytes", "machine_line", "read_bandwidth"]
