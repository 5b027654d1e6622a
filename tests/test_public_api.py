"""`from dflashkit import …`: every public name is the library's own object, `import dflashkit` stays light (the CLI
imports it first), and the package says it is typed."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import dflashkit

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", dflashkit.__all__)
def test_each_public_name_is_the_defining_modules_object(name: str) -> None:
    module, attr = dflashkit._PUBLIC[name]
    assert getattr(dflashkit, name) is getattr(importlib.import_module(module), attr)
    assert name in dir(dflashkit)


def test_the_stage_packages_do_not_shadow_the_entry_points() -> None:
    import dflashkit.evaluate
    import dflashkit.train  # noqa: F401
    from dflashkit import evaluate_drafters, train_drafter
    from dflashkit.evaluate.evaluate import evaluate
    from dflashkit.train.loop import train

    assert train_drafter is train and evaluate_drafters is evaluate


def test_all_lists_exactly_the_public_names() -> None:
    assert dflashkit.__all__ == sorted(dflashkit._PUBLIC)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dflashkit.nope  # noqa: B018


def test_import_dflashkit_loads_neither_torch_nor_transformers() -> None:
    code = "import sys, dflashkit; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_the_package_is_typed_and_ships_the_marker() -> None:
    assert (ROOT / "dflashkit" / "py.typed").is_file()
    assert '"py.typed"' in (ROOT / "pyproject.toml").read_text()
    usage = (ROOT / "tests" / "typing" / "public_api.py").read_text()
    assert all(name in usage for name in dflashkit.__all__), "the type-checked use names every public name"
