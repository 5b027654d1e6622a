"""Output directories: made safely, and written by one run at a time.

    out = output_dir("runs/x", what="--out")      # a directory (made with its parents); a file there is an error
    with one_writer(out, "dflashkit train"):      # refuses while another live run holds `out`
        ...                                       # a lock left by a dead run is taken over, with a note

The lock is `OUT/.dflashkit.lock`: an `flock`ed file holding the holder's pid, host, command and start time. The
kernel drops an flock when its process dies, however it dies, so a lock whose holder is gone can always be taken
(the old holder is named in a note); a live holder is named in the refusal. Locks are re-entrant within one
process (the quickstart's stages nest), and the file is removed on release.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from dflashkit.errors import ConfigError

LOCK_NAME = ".dflashkit.lock"
_HELD: dict[str, list] = {}  # realpath → [count, fd] of locks this process holds


def output_dir(path: str | Path, *, what: str = "output directory", create: bool = True) -> Path:
    """`path` as an output directory: refused when it (or a parent) is a file; made (with parents) when missing."""
    path = Path(path)
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            raise ConfigError(f"{what} {path}: {p} is a file; expected a directory (or a path that does not exist)")
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{what} {path}: cannot create it ({e.strerror})") from None
    return path


def _holder_text(info: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return f"{info.get('command', '?')} (pid {info.get('pid', '?')} on {info.get('host', '?')}, started {started})"


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 65536)
    try:
        info = json.loads(raw) if raw.strip() else {}
    except ValueError:
        info = {}
    return info if isinstance(info, dict) else {}


@contextlib.contextmanager
def one_writer(path: str | Path, command: str, *, enabled: bool = True, log=None) -> Iterator[Path]:
    """Hold `path` (made if missing) for this run; ConfigError naming the holder when another live run has it."""
    out = output_dir(path)
    if not enabled:
        yield out
        return
    key = os.path.realpath(out)
    if key in _HELD:  # nested in this process: the quickstart holds its directory while a stage runs in it
        _HELD[key][0] += 1
        try:
            yield out
        finally:
            _HELD[key][0] -= 1
        return
    lock = out / LOCK_NAME
    fd = _acquire(lock, out)
    stale = _read(fd)
    if stale:
        note = f"[dflashkit] {out}: taking over the lock of {_holder_text(stale)}, which is no longer running"
        (log or (lambda m: print(m, file=sys.stderr, flush=True)))(note)
    mine = {"pid": os.getpid(), "host": socket.gethostname(), "command": command, "started": time.time()}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(mine).encode())
    os.fsync(fd)
    _HELD[key] = [1, fd]
    try:
        yield out
    finally:
        del _HELD[key]
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)  # releases the flock


def _acquire(lock: Path, out: Path) -> int:
    """An fd of `lock` holding an exclusive flock, the file still linked at that path (a release unlinks it)."""
    for _ in range(100):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            who = _holder_text(holder) if holder else "another dflashkit run"
            raise ConfigError(
                f"{out} is in use by {who}; one run writes an output directory at a time: wait for it to finish, "
                f"or use another output directory"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the holder released (and unlinked) it between our open and flock: try again
    raise ConfigError(f"{lock}: could not take the lock (it keeps changing); is something deleting it?")


__all__ = ["LOCK_NAME", "one_writer", "output_dir"]
