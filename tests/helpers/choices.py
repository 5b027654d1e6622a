"""Setting one entry of DFLASHKIT_CHOICES in a test, the suite's other entries kept (tests/conftest.py sets them).

set_choice(monkeypatch, "products", "stock")        # DFLASHKIT_CHOICES=…,products=stock
set_choice(monkeypatch, "train_precision", None)    # the entry removed: measured
"""

from __future__ import annotations

import pytest

from dflashkit.cpu_products.choice import ENV, with_override


def set_choice(monkeypatch: pytest.MonkeyPatch, name: str, value: str | None) -> None:
    """DFLASHKIT_CHOICES with `name` set to `value` (None: removed), restored after the test."""
    monkeypatch.setenv(ENV, with_override(name, value))
