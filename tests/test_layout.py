"""The house rules, checked on the source: the package is grouped by pipeline stage, a stage imports only stages
below it (never one above, never in a circle), every module says what it is, files and functions stay small."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dflashkit"
# Bottom to top. A module of stage i may import stages 0..i (its own included) and the shared modules.
STAGES = ("target", "drafter", "data", "features", "train", "decode", "evaluate", "export", "diagnose")
SHARED = ("errors", "io_utils", "validation", "output_dir")  # imported by everyone, import no stage
TOP = (
    "cli",
    "failures",
    "commands",
    "quickstart",
    "quickstart_screen",
    "quickstart_eval",
    "quickstart_rates",
    "quickstart_server",
    "__main__",
    "__init__",
)  # entry points: may import anything
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 100  # of the body, docstring and signature not counted


def _modules() -> dict[str, Path]:
    """Dotted module name (without the `dflashkit.` prefix) → file."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)] = path
    return out


def _imports(name: str, path: Path) -> set[str]:
    """dflashkit modules that `path` imports anywhere (module level or inside functions), without the prefix."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                mod = ".".join(base + ([node.module] if node.module else []))
                full = f"dflashkit.{mod}" if mod else "dflashkit"
            else:
                full = node.module or ""
            if full == "dflashkit":  # from dflashkit import x
                found.update(alias.name for alias in node.names)
            elif full.startswith("dflashkit."):
                sub = full.removeprefix("dflashkit.")
                found.add(sub)
                found.update(f"{sub}.{alias.name}" for alias in node.names)  # `from pkg import module`
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("dflashkit.") for a in node.names if a.name.startswith("dflashkit."))
    modules = _modules()
    return {m for m in found if m in modules}


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function's body, without its signature and docstring (what a reader has to hold)."""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


def _stage(module: str) -> str:
    return module.split(".")[0]


def test_every_module_belongs_to_a_stage_or_is_shared_or_an_entry_point():
    homeless = [m for m in _modules() if _stage(m) not in STAGES + SHARED + TOP]
    assert not homeless, f"modules outside the stage packages: {homeless}"


def test_a_stage_imports_only_stages_below_it():
    rank = {s: i for i, s in enumerate(STAGES)}
    upward = []
    for name, path in _modules().items():
        stage = _stage(name)
        for dep in _imports(name, path):
            dep_stage = _stage(dep)
            if stage in SHARED and dep_stage not in SHARED:
                upward.append(f"{name} (shared) imports {dep}")
            elif stage in rank and dep_stage in rank and rank[dep_stage] > rank[stage]:
                upward.append(f"{name} ({stage}) imports {dep} ({dep_stage}, a stage above)")
            elif stage in rank and dep_stage in TOP:
                upward.append(f"{name} ({stage}) imports the entry point {dep}")
    assert not upward, "\n".join(upward)


def test_no_import_circles():
    graph = {name: _imports(name, path) - {name} for name, path in _modules().items()}
    # a package's __init__ importing its own modules is not a circle worth reporting; none of ours import any
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(" → ".join([*stack[stack.index(dep) :], dep]))
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_every_module_opens_with_a_docstring_and_stays_small():
    problems = []
    for name, path in _modules().items():
        text = path.read_text()
        tree = ast.parse(text)
        if name != "__main__" and not ast.get_docstring(tree):
            problems.append(f"{path.relative_to(PACKAGE.parent)}: no module docstring")
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            problems.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines (> {MAX_FILE_LINES}: two rooms?)")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _body_lines(node)
                if n > MAX_FUNCTION_LINES:
                    problems.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {n} lines")
    assert not problems, "\n".join(problems)


def test_stage_packages_say_what_they_read_and_write():
    for stage in STAGES:
        doc = ast.get_docstring(ast.parse((PACKAGE / stage / "__init__.py").read_text())) or ""
        assert "Reads" in doc and "Writes" in doc, f"dflashkit/{stage}/__init__.py: say what the stage reads/writes"
        for module in sorted((PACKAGE / stage).glob("*.py")):
            if module.name != "__init__.py":
                assert module.name in doc, f"dflashkit/{stage}/__init__.py does not name {module.name}"


def test_the_checker_sees_an_upward_import(tmp_path):
    """The import reader finds imports inside functions and `from package import module` forms."""
    src = tmp_path / "m.py"
    src.write_text('"""x"""\ndef f():\n    from dflashkit.train import loop\n    import dflashkit.decode.tree\n')
    assert {"train.loop", "decode.tree"} <= _imports("data.m", src)
