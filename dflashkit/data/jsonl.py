"""Reading user-supplied JSONL safely: bytes in, a size cap per line, UTF-8 checked, blank lines skipped.

    for line in read_lines(path):          # a `Line` for every non-blank line, numbered from 1
        try:
            record = line.json()           # LineProblem (a ValueError) when the line is over the size cap, not
        except ValueError as e:            #   UTF-8, or not valid JSON; the message says what (callers add
            ...                            #   "file:line: ")

A line longer than the cap is never held in memory: the reader reads in 1 MiB pieces, drops a line once it passes
the cap and only counts the rest of its bytes, so one runaway line (a pasted log, a binary blob) costs neither
gigabytes of memory nor a minute of parsing. The cap is `DEFAULT_MAX_LINE_BYTES` (8 MiB, far above any real
conversation or tokens.jsonl line of a few hundred thousand tokens), or `$DFLASHKIT_MAX_LINE_MB` megabytes (MiB)
when that is set.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflashkit.errors import ConfigError
from dflashkit.validation import first_text_problem

DEFAULT_MAX_LINE_BYTES = 8 << 20
MAX_LINE_ENV = "DFLASHKIT_MAX_LINE_MB"
_BOM = b"\xef\xbb\xbf"
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_CHUNK = 1 << 20


class LineProblem(ValueError):
    """A line that cannot be used: over the size cap, not UTF-8, or not JSON (message without file:line)."""


def max_line_bytes() -> int:
    """The line-size cap in bytes: $DFLASHKIT_MAX_LINE_MB (MiB, may be fractional) or DEFAULT_MAX_LINE_BYTES."""
    raw = os.environ.get(MAX_LINE_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_LINE_BYTES
    try:
        mb = float(raw)
    except ValueError:
        mb = math.nan
    if not (math.isfinite(mb) and mb > 0):
        raise ConfigError(f"${MAX_LINE_ENV}={raw!r}: expected a positive number of megabytes, e.g. 64")
    return max(1, int(mb * (1 << 20)))


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.3g} MiB" if n >= 1 << 16 else f"{n:,} bytes"


@dataclass(frozen=True)
class Line:
    """One non-blank line of a JSONL file. `data` is None when the line was over the cap (never read whole)."""

    number: int
    data: bytes | None
    size: int
    cap: int

    def text(self) -> str:
        """The line decoded as UTF-8; LineProblem when it is over the cap or not UTF-8."""
        if self.data is None:
            raise LineProblem(
                f"line of {_mib(self.size)} is over the {_mib(self.cap)} line-size cap (not read; set "
                f"{MAX_LINE_ENV} to a larger number of megabytes to accept it)"
            )
        try:
            return self.data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise LineProblem(
                f"not valid UTF-8 (byte 0x{self.data[e.start]:02x} at byte {e.start + 1} of the "
                f"line); JSONL must be UTF-8: re-encode the file (e.g. `iconv -f latin1 -t utf-8`)"
            ) from None

    def json(self) -> Any:
        """The line parsed as JSON; LineProblem naming what is wrong (column of a syntax error, a string that is
        not Unicode text: a lone surrogate escape such as `\\ud800` decodes to one)."""
        text = self.text()
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise LineProblem(f"invalid JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise LineProblem("invalid JSON (nested too deeply)") from None
        if _SURROGATE_ESCAPE.search(text):  # only \u escapes can make a lone surrogate out of valid UTF-8
            why = first_text_problem(value)
            if why:
                raise LineProblem(why)
        return value


def _next_line(f: Any, cap: int) -> tuple[bytes | None, int] | None:
    """(line without its newline, or None when over the cap; its size in bytes) — or None at the end of file.
    Read in 1 MiB pieces, so an over-cap line costs at most about cap + 1 MiB of memory, however long it is."""
    parts: list[bytes] | None = []
    size, ended = 0, False
    while not ended:
        piece = f.readline(_CHUNK)
        if not piece:
            break
        ended = piece.endswith(b"\n")
        size += len(piece) - ended
        if parts is not None:
            parts.append(piece)
            if size > cap:
                parts = None  # over the cap: keep counting to the end of the line, keep none of it
    if not size and not ended:
        return None
    return (None if parts is None else b"".join(parts).rstrip(b"\r\n")), size


def read_lines(path: str | Path, *, cap: int | None = None) -> Iterator[Line]:
    """Every non-blank line of `path` as a `Line` (numbers count blank lines too, as editors do)."""
    cap = max_line_bytes() if cap is None else int(cap)
    with open(path, "rb") as f:
        number = 0
        while (got := _next_line(f, cap)) is not None:
            number += 1
            data, size = got
            if data is None:
                yield Line(number, None, size, cap)
                continue
            if number == 1 and data.startswith(_BOM):
                data = data[len(_BOM) :]
            if data.strip():
                yield Line(number, data, len(data), cap)
