"""Run llama.cpp's `llama-server` (scripts/build_llamacpp.sh) on 127.0.0.1 for the time of a block: regeneration
through it (`dflashkit prepare --server`, the quickstart's `--regen-server`), bench/regen_throughput.py and the
opt-in engine tests.

    with LlamaServer(gguf, slots=4, threads=2) as srv:
        srv.url          # http://127.0.0.1:PORT, answering /health
        srv.log_path     # the server's log

`slots` is llama-server's `--parallel` (requests decoded together in one batch); each slot gets `ctx_per_slot`
tokens of context. The server is stopped (SIGTERM, then SIGKILL) when the block ends, however it ends; a server
that exits or does not answer /health within `start_timeout_s` raises LlamaCppError with the tail of its log.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from dflashkit.export.llamacpp import LlamaCppError, tool


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """A `llama-server` process serving one GGUF file on 127.0.0.1."""

    def __init__(
        self,
        gguf: str | Path,
        *,
        slots: int = 4,
        threads: int | None = None,
        ctx_per_slot: int = 4096,
        port: int | None = None,
        start_timeout_s: float = 120.0,
        extra_args: list[str] | None = None,
    ) -> None:
        if slots < 1 or ctx_per_slot < 16:
            raise LlamaCppError(f"slots={slots}, ctx_per_slot={ctx_per_slot}: expected ≥ 1 slot of ≥ 16 tokens")
        self.gguf, self.slots, self.threads = Path(gguf), slots, threads
        self.ctx_per_slot, self.start_timeout_s = ctx_per_slot, start_timeout_s
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])

    def command(self) -> list[str]:
        cmd = [str(tool("llama-server")), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--parallel", str(self.slots), "--ctx-size", str(self.slots * self.ctx_per_slot), "--no-webui"]
        if self.threads:
            cmd += ["--threads", str(self.threads), "--threads-batch", str(self.threads)]
        return cmd + self.extra_args

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return json.loads(r.read()).get("status") == "ok"
        except (OSError, ValueError):
            return False

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def start(self) -> LlamaServer:
        if not self.gguf.is_file():
            raise LlamaCppError(f"{self.gguf}: no such GGUF file for llama-server")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise LlamaCppError(
                    f"llama-server exited (code {code}) while starting on {self.url}:\n{self.log_tail()}"
                )
            if self._healthy():
                return self
            time.sleep(0.1)
        self.stop()
        raise LlamaCppError(f"llama-server on {self.url} did not answer /health in {self.start_timeout_s:.0f} s")

    def stop(self) -> None:
        """Stop the server (SIGTERM; SIGKILL after 10 s)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def kill(self) -> None:
        """SIGKILL, as a crash would (tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


__all__ = ["LlamaServer", "free_port"]
