"""The training-options table of docs/pipeline.md, generated from `TrainConfig` so the docs cannot drift from it.

    python -m dflashkit.train.options_table            # print the Markdown table
    python -m dflashkit.train.options_table --write    # replace the table between the markers in docs/pipeline.md

Each row is one field: its name, its default, what it accepts (the declared type's own words, the same ones an error
message uses) and what it does (the comment written beside the field where it is declared, or on the lines above it).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import sys
from pathlib import Path

from dflashkit.drafter.heads import TRAIN_SETTINGS
from dflashkit.train.config import RESUME_LOCKED, TrainConfig
from dflashkit.validation import FLATTENS, expected_text, field_types

BEGIN = "<!-- train-options:begin -->"
END = "<!-- train-options:end -->"


def field_comments() -> dict[str, str]:
    """Field name → the comment beside it in the source of the class declaring it (`TrainConfig`, or a head's
    training settings), with the comment lines just above it (a `# ---- section` line starts none)."""
    out: dict[str, str] = {}
    for cls in (TrainConfig, *TRAIN_SETTINGS):
        out.update(_class_comments(cls))
    return out


def _class_comments(cls: type) -> dict[str, str]:
    source = inspect.getsource(inspect.getmodule(cls))
    lines = source.splitlines()
    node_cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    out = {}
    for node in node_cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, i = [], node.lineno - 2
        while i >= 0 and lines[i].strip().startswith("#") and not lines[i].strip().startswith("# ----"):
            above.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        last = lines[node.end_lineno - 1]
        beside = _trailing_comment(last)
        out[node.target.id] = " ".join(part for part in (*above, beside) if part)
    return out


def _trailing_comment(line: str) -> str:
    """The `# …` comment ending a line of code, outside string literals."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c == "#":
            return line[i + 1 :].strip()
    return ""


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    return "`null`" if value is None else f"`{json.dumps(value, ensure_ascii=False)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def options_table() -> str:
    """The Markdown table: option, default, accepted values, meaning (a • marks options fixed for a resumed run)."""
    comments, types = field_comments(), field_types(TrainConfig)
    rows = ["| option | default | accepts | what it does |", "| --- | --- | --- | --- |"]
    own = [f for f in dataclasses.fields(TrainConfig) if not f.metadata.get("internal") and FLATTENS not in f.metadata]
    # the run's options, then each head's (the registry's order), under their flat names
    for f in [*own, *(f for settings in TRAIN_SETTINGS for f in dataclasses.fields(settings))]:
        name = f"`{f.name}`" + (" •" if f.name in RESUME_LOCKED else "")
        accepts = expected_text(types[f.name]) or ""
        rows.append(f"| {name} | {_cell(_default(f))} | {_cell(accepts)} | {_cell(comments.get(f.name, ''))} |")
    return "\n".join(rows) + "\n"


def write(path: Path) -> None:
    """Replace the text between the markers in `path` with the current table."""
    text = path.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    path.write_text(f"{head}{BEGIN}\n{options_table()}{END}{tail}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write(Path(__file__).resolve().parents[2] / "docs" / "pipeline.md")
    else:
        print(options_table(), end="")
