"""The house rules, checked on the source: the package is grouped by pipeline stage, a stage imports only stages
below it (never one above, never in a circle), every module has one job named by its docstring and keeps its
private names to itself, functions stay short enough to read."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dflashkit"
# Bottom to top. A module of stage i may import stages 0..i (its own included) and the shared modules.
STAGES = ("cpu_products", "target", "drafter", "data", "features", "train", "decode", "evaluate", "export", "diagnose")
SHARED = (
    "errors",
    "io_utils",
    "validation",
    "output_dir",
    "sampling",
    "shell",
)  # imported by everyone, import no stage
TOP = ("cli", "failures", "commands", "quickstart", "__main__", "__init__")  # entry points: may import anything
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


def test_every_module_names_its_one_job_and_functions_stay_readable():
    """A module opens with a docstring whose first sentence names its job (what a reader looks for, not a size)."""
    problems = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        doc = ast.get_docstring(tree) or ""
        if name != "__main__" and len(doc.split()) < 4:
            problems.append(f"{path.relative_to(PACKAGE.parent)}: no docstring naming the module's job")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _body_lines(node)
                if n > MAX_FUNCTION_LINES:
                    problems.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {n} lines")
    assert not problems, "\n".join(problems)


def _private_uses(path: Path) -> list[str]:
    """Names with a leading underscore that `path` takes from another dflashkit module (`from m import _x`, or
    `m._x` on an imported module)."""
    tree = ast.parse(path.read_text())
    where = path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path.name
    modules, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflashkit"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{where}:{node.lineno} imports {node.module}.{alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(a.asname or a.name for a in node.names if a.name.startswith("dflashkit."))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{where}:{node.lineno} uses {node.value.id}.{node.attr}")
    return found


def test_no_module_reaches_into_another_modules_private_names():
    """Cohesion: a module that needs another's private helpers is half of one job split in two (split by meaning,
    never by size): merge them, or make the helper public under a name that says what it does."""
    found = [use for path in _modules().values() for use in _private_uses(path)]
    assert not found, "\n".join(found)


def test_stage_packages_say_what_they_read_and_write():
    for stage in STAGES:
        doc = ast.get_docstring(ast.parse((PACKAGE / stage / "__init__.py").read_text())) or ""
        assert "Reads" in doc and "Writes" in doc, f"dflashkit/{stage}/__init__.py: say what the stage reads/writes"
        for module in sorted((PACKAGE / stage).glob("*.py")):
            if module.name != "__init__.py":
                assert module.name in doc, f"dflashkit/{stage}/__init__.py does not name {module.name}"


def test_the_checker_sees_a_private_name_taken_from_another_module(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        '"""x"""\nfrom dflashkit.data.conversations import _secret\nimport dflashkit.train.loop as loop\nloop._x\n'
    )
    uses = _private_uses(src)
    assert len(uses) == 2 and "conversations._secret" in uses[0] and "loop._x" in uses[1]


def test_the_checker_sees_an_upward_import(tmp_path):
    """The import reader finds imports inside functions and `from package import module` forms."""
    src = tmp_path / "m.py"
    src.write_text('"""x"""\ndef f():\n    from dflashkit.train import loop\n    import dflashkit.decode.tree\n')
    assert {"train.loop", "decode.tree"} <= _imports("data.m", src)


def _kind_branches(path: Path) -> list[str]:
    """Comparisons in `path` of a kind (a name or attribute `kind`) with a drafter kind's name."""
    from dflashkit.drafter.heads import KINDS

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = [s.value for s in sides if isinstance(s, ast.Constant) and s.value in KINDS]
        kind = any(
            (isinstance(n, ast.Name) and "kind" in n.id) or (isinstance(n, ast.Attribute) and n.attr == "kind")
            for s in sides
            for n in ast.walk(s)
        )
        if names and kind:
            found.append(f"{path.name}:{node.lineno} compares with {names[0]!r}")
    return found


def test_no_stage_branches_on_a_drafter_kind():
    """Drafter kinds are heads behind one interface (dflashkit/drafter/heads): outside the heads, nothing compares a
    kind with a kind's name — a stage asks the head instead."""
    heads = PACKAGE / "drafter" / "heads"
    branches = [b for p in sorted(PACKAGE.rglob("*.py")) if heads not in p.parents for b in _kind_branches(p)]
    assert not branches, "\n".join(branches)


def test_the_kind_branch_checker_sees_a_branch(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('if cfg.kind == "dspark":\n    pass\nif raw.get("projector_type") != "dflash":\n    pass\n')
    assert _kind_branches(src) == ["m.py:1 compares with 'dspark'"]
