"""Small file helpers: atomic writes (temp file + rename) so a kill never leaves a half-written file; clear
messages for failed writes (a full disk); removal of temp leftovers (`.NAME.tmp-PID`) of dead processes, and of
the temp files an interrupted atomic write leaves in a directory its caller has locked; the user cache directory."""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from dflashkit.errors import TargetError


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path in the same directory; rename it onto `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_path, 0o666 & ~umask)  # mkstemp creates 0600; give the file ordinary permissions
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


_PID_TEMP = re.compile(r"^\.(.+)\.(tmp|old)-(\d+)$")  # .step-000002.tmp-1234, .final.old-1234


def _alive(pid: int) -> bool:
    if pid == os.getpid():  # our own pid on a leftover: a previous process that had it (containers reuse pids)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temps(directory: str | Path, log: Callable[[str], None] | None = None) -> list[Path]:
    """Delete `.NAME.tmp-PID` / `.NAME.old-PID` files and directories in `directory` whose process is gone
    (what a kill or a failed write leaves behind); returns what was removed. Call before writing anything.
    A `.NAME.old-PID` (the previous version, moved aside for a replacement) whose NAME is missing — killed
    between the two renames — is renamed back to NAME instead."""
    removed: list[Path] = []
    directory = Path(directory)
    if not directory.is_dir():
        return removed
    for p in sorted(directory.iterdir()):
        m = _PID_TEMP.match(p.name)
        if m is None or _alive(int(m.group(3))):
            continue
        if m.group(2) == "old" and not (directory / m.group(1)).exists():
            os.replace(p, directory / m.group(1))
            if log is not None:
                log(f"restored {directory / m.group(1)} from {p.name} (a replacement was interrupted)")
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
        if log is not None:
            log(f"removed {p} (left by an interrupted write of process {m.group(3)}, no longer running)")
    return removed


_ATOMIC_TEMP = re.compile(r"^\..+\.tmp$")  # atomic_path's own: .shard-00001.safetensors.k3j2.tmp
_RUST_TEMP = re.compile(r"^\.tmp[A-Za-z0-9]{6}$")  # safetensors' save_file writes through Rust's tempfile: .tmpuanqnK


def remove_interrupted_writes(directory: str | Path) -> list[Path]:
    """Delete the temp files a killed atomic write leaves in `directory`: atomic_path's `.NAME.XXXX.tmp`, and the
    `.tmpXXXXXX` safetensors' `save_file` creates next to its destination before renaming it. Such names carry no
    pid, so call this only while holding the directory's lock with no writer of your own running."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    names = (_ATOMIC_TEMP, _RUST_TEMP)
    stale = [p for p in sorted(directory.iterdir()) if p.is_file() and any(r.match(p.name) for r in names)]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def write_failure(path: str | Path, error: BaseException) -> str:
    """One line saying why writing `path` failed: the disk is full (ENOSPC/EDQUOT, or torch's / safetensors'
    wrapping of it), or the OS error; with the free space left there."""
    text = " ".join(str(error).split())
    code = getattr(error, "errno", None)
    full = code in (errno.ENOSPC, errno.EDQUOT) or "No space left" in text or "StorageFull" in text
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
        room = f"{free / 1e9:.2f} GB free at {where}"
    except OSError:
        room = f"free space at {where} unknown"
    torn = any(k in text for k in ("unexpected pos", "write failed", "failed writing"))  # torch.save's words
    if full:
        return f"the disk is full ({text[:160]}; {room})"
    if torn:
        return f"the write failed, most likely a full disk ({text[:160]}; {room})"
    return f"the write failed ({type(error).__name__}: {text[:160]}; {room})"


def cache_root() -> Path:
    """Where dflashkit keeps converted models and other large derived files ($DFLASHKIT_CACHE, else
    $XDG_CACHE_HOME/dflashkit, else ~/.cache/dflashkit); a variable pointing at a file is an error naming it."""
    if os.environ.get("DFLASHKIT_CACHE"):
        root, var = Path(os.environ["DFLASHKIT_CACHE"]).expanduser(), "DFLASHKIT_CACHE"
    elif os.environ.get("XDG_CACHE_HOME"):
        root, var = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "dflashkit", "XDG_CACHE_HOME"
    else:
        root, var = Path.home() / ".cache" / "dflashkit", None
    for p in (root, *root.parents):
        if p.exists() and not p.is_dir():
            where = f"{var}={os.environ[var]}" if var else f"the cache directory {root}"
            raise TargetError(f"{where}: {p} is a file; expected a directory for dflashkit's cache")
    return root
