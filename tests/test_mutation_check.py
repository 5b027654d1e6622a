"""The mutation check's fault table (tests/mutation_check.py) matches the code: every `old` snippet occurs exactly once
in its file, inside the function named; every named test exists; ids are unique. Cheap: reads files, runs no pytest
subprocess."""

from __future__ import annotations

from pathlib import Path

import mutation_check as check  # tests/ is on the path (pyproject.toml: pythonpath)

ROOT = Path(__file__).resolve().parent.parent


def test_every_fault_matches_the_code_and_names_existing_tests() -> None:
    assert len(check.FAULTS) >= 20
    assert check.problems(check.FAULTS, ROOT) == []


def test_a_stale_snippet_or_a_missing_test_is_reported(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "mod.py").write_text("x = 1\nx = 1\n\n\ndef f():\n    return 3\n")
    (tmp_path / "tests" / "test_a.py").write_text("def test_b():\n    pass\n")
    faults = (
        check.Fault("twice", "mod.py", "<module>", "x = 1", "x = 2", ("tests/test_a.py::test_b",), ""),
        check.Fault("gone", "mod.py", "<module>", "y = 1", "y = 2", ("tests/test_a.py::test_c",), ""),
        check.Fault("gone", "mod.py", "<module>", "x = 1\nx", "x = 1\ny", ("tests/test_a.py",), ""),
        check.Fault("moved", "mod.py", "g", "return 3", "return 4", ("tests/test_a.py",), ""),
        check.Fault("fine", "mod.py", "f", "return 3", "return 4", ("tests/test_a.py::test_b",), ""),
    )
    assert check.problems(faults, tmp_path) == [
        "twice: `x = 1` occurs 2 times in mod.py, expected exactly once",
        "gone: `y = 1` occurs 0 times in mod.py, expected exactly once",
        "gone: tests/test_a.py defines no test_c",
        "gone: the id is used twice",
        "moved: `return 3` is in f of mod.py, expected in g",
    ]
