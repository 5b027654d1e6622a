"""Command lines dflashkit prints for the user to paste (plan's recipe, suggestions in errors and reports).

    shell_line("dflashkit", "prepare", "--out", "data/my run")   # → "dflashkit prepare --out 'data/my run'"

Every argument is quoted for a POSIX shell (`shlex.quote`), so a path with a space, a quote or a `$` comes back from
the shell as the same one argument; a plain word is left as it is.
"""

from __future__ import annotations

import shlex
from pathlib import Path


def shell_line(*args: str | int | float | Path) -> str:
    """One command line of `args`, each quoted where a shell would split or expand it."""
    return " ".join(shlex.quote(str(a)) for a in args)


__all__ = ["shell_line"]
