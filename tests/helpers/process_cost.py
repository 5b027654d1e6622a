"""What a command costs to run: its wall time and peak resident memory, measured in a fresh interpreter that runs
only it (ru_maxrss of RUSAGE_CHILDREN covers every child a process ever waited for, so the test process's own
would count earlier tests' children too)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

_PROBE = (
    "import json, resource, subprocess, sys, time\n"
    "t = time.perf_counter()\n"
    "p = subprocess.run(sys.argv[2:], capture_output=True, text=True, timeout=float(sys.argv[1]))\n"
    "print(json.dumps({'rc': p.returncode, 'stdout': p.stdout, 'stderr': p.stderr, 's': time.perf_counter() - t,\n"
    "                  'kib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))\n"
)


@dataclass
class Cost:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    peak_rss_mib: float


def run_measured(argv: list[str], *, timeout: float) -> Cost:
    """Run `argv` (its output captured) → its exit code, output, wall seconds and peak RSS (MiB; Linux KiB).
    Past `timeout` seconds the command is killed and the probe fails (subprocess.TimeoutExpired in its stderr)."""
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE, str(timeout), *argv], capture_output=True, text=True, timeout=timeout + 60
    )
    assert probe.returncode == 0, probe.stderr
    out = json.loads(probe.stdout)
    return Cost(out["rc"], out["stdout"], out["stderr"], out["s"], out["kib"] / 1024)
