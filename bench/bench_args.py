"""Argument parsing shared by the bench scripts (bench/ is not a package: scripts add their own folder to sys.path)."""

from __future__ import annotations


def positive_ints(text: str, flag: str, example: str = "1,4,16", *, unique_sorted: bool = False) -> list[int]:
    """'1,4,16' → [1, 4, 16]; anything else (empty, non-integer, < 1) exits with one line naming `flag`."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SystemExit(f"error: {flag} {text!r}: expected comma-separated positive integers, e.g. {example}")
    return sorted(set(values)) if unique_sorted else values
