"""The documentation is tested like code: every `dflashkit …` command in README.md and docs/ parses with the real
command-line parser, every relative link and anchor resolves, the training-options table is the one `TrainConfig`
generates, and no file of the repository narrates how the project was developed."""

from __future__ import annotations

import re
import shlex
import subprocess
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_OPERATORS = {"&&", "||", "|", ";", "&", ">", ">>", "<", "2>", "2>&1", "(", ")"}


def _fenced_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, body) of every fenced code block."""
    blocks, lines, start, body = [], text.splitlines(), None, []
    for i, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            if start is None:
                start, body = i + 1, []
            else:
                blocks.append((start, "\n".join(body)))
                start = None
        elif start is not None:
            body.append(line)
    return blocks


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)


def _commands(path: Path) -> list[tuple[str, list[str]]]:
    """(where, argv) of every `dflashkit` invocation in the file's code blocks and inline code spans; `where` of an
    inline span starts with "inline " (prose names a command or a flag of it: its required arguments may be left
    out, its subcommand and flags must exist)."""
    text = path.read_text()
    found = []
    sources = [(f"{path.name}:{n}", body.replace("\\\n", " ")) for n, body in _fenced_blocks(text)]
    for m in re.finditer(r"`(dflashkit [^`]+)`", _prose(text)):
        sources.append((f"inline {path.name}:{text[: m.start()].count(chr(10)) + 1}", m.group(1)))
    for where, source in sources:
        for line in source.splitlines():
            line = line.replace("$(which dflashkit)", "dflashkit")
            if "dflashkit" not in line or re.match(r"\s*(from|import)\s+dflashkit\b", line):  # Python, not a shell
                continue
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            lexer.commenters = "#"
            try:
                tokens = list(lexer)
            except ValueError as e:
                found.append((f"{where}: {line.strip()}", ["<unparsable shell line>", str(e)]))
                continue
            for i, tok in enumerate(tokens):
                if tok == "dflashkit" or tok.endswith("/dflashkit"):
                    argv = []
                    for t in tokens[i + 1 :]:
                        if t in SHELL_OPERATORS:
                            break
                        argv.append(t)
                    if argv and not argv[0].startswith("$") and not argv[0].endswith(":"):  # not a quoted message
                        found.append((f"{where}: {line.strip()}", argv))
    return found


ALL_COMMANDS = [c for path in DOCS for c in _commands(path)]


def test_the_docs_hold_commands_to_check():
    assert len(ALL_COMMANDS) > 40  # the extraction itself works (README + docs/ show every command)
    names = {argv[0] for _, argv in ALL_COMMANDS}
    assert {"quickstart", "prepare", "capture", "train", "eval", "convert", "serve-check", "doctor"} <= names


@pytest.mark.parametrize(("where", "argv"), ALL_COMMANDS, ids=[w for w, _ in ALL_COMMANDS])
def test_every_documented_command_parses(where, argv, monkeypatch, capsys):
    """The real parser (unknown subcommands and flags fail); a device the docs name for a GPU machine is accepted
    as a device string here (this machine need not have it)."""
    from dflashkit import cli

    monkeypatch.setattr("dflashkit.target.devices.device_problem", lambda text: None)
    parser = cli.build_parser()
    try:
        args = cli._parse(parser, [a for a in argv if a != "…"])
    except SystemExit as e:
        err = capsys.readouterr().err.strip()
        if where.startswith("inline ") and re.search(
            r"arguments are required|expected (?:at least )?one argument", err
        ):
            return  # prose names a command or one of its flags without every value
        placeholder = re.search(r' "([^"]*)": expected', err)
        if placeholder and re.fullmatch(r"[A-Z][A-Z0-9_]*|.*[$…].*", placeholder.group(1)):
            return  # a placeholder (N, CKPT, $T) where a typed value goes: the flag itself exists
        assert e.code == 0, f"{where}: {err}"
        return
    assert args.command == argv[0]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, markup dropped, punctuation but `-` and `_` dropped, spaces → `-`."""
    text = re.sub(r"`|\*\*|\*|<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = path.read_text()
    out, seen = set(), {}
    for line in _prose(text).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    out.update(re.findall(r'<a\s+(?:id|name)="([^"]+)"', text))
    return out


def _links(path: Path) -> list[tuple[str, str]]:
    """(where, target) of every relative Markdown link outside code."""
    text = _prose(path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    out = []
    for m in re.finditer(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
        target = m.group(1)
        if not re.match(r"^[a-z]+:", target):
            out.append((f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}", target))
    return out


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for path in DOCS:
        for where, target in _links(path):
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{where}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where}: {target} (no heading or anchor #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, "\n".join(broken)


def test_every_docs_link_the_code_prints_resolves():
    """Messages and docstrings point users at `docs/PAGE.md#anchor`: each must exist."""
    broken = []
    for path in sorted((ROOT / "dflashkit").rglob("*.py")):
        for m in re.finditer(r"docs/([\w-]+\.md)(?:#([\w-]+))?", path.read_text()):
            page = ROOT / "docs" / m.group(1)
            if not page.exists():
                broken.append(f"{path.relative_to(ROOT)}: docs/{m.group(1)} (no such page)")
            elif m.group(2) and m.group(2) not in _anchors(page):
                broken.append(f"{path.relative_to(ROOT)}: {m.group(0)} (no such anchor)")
    assert not broken, "\n".join(broken)


def test_the_training_options_table_is_the_one_train_config_generates():
    from dflashkit.train.options_table import BEGIN, END, options_table

    text = (ROOT / "docs" / "pipeline.md").read_text()
    assert BEGIN in text and END in text, "docs/pipeline.md lost the generated table's markers"
    shown = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert shown == options_table().strip(), "regenerate it: python -m dflashkit.train.options_table --write"


# Words about how the project was developed, not about what it is. Spelled in pieces so this file does not match.
_ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
DEVELOPMENT_WORDS = [
    r"\b(?:twenty|thirty|forty)-?(?:" + _ORDINALS + r")?\s+" + "sess" + r"ions?\b",
    r"\b(?:" + _ORDINALS + r"|earlier|previous|this|later|next|work|development|coding)\s+" + "sess" + r"ions?\b",
    r"\b" + "sess" + r"ions?\s+(?:note|log)s?\b",
    r"\b" + "iss" + r"ue[ -]#?\d+",
    r"\b" + "iss" + r"ue[ -]goals?\b",
    r"\bdevelopment rounds?\b",
    r"\b" + "tra" + r"cker numbers?\b",
]


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    files = []
    for name in out.stdout.splitlines():
        path = ROOT / name
        if path.suffix in {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".cpp", ".cfg"} or name in {
            ".ci/run",
            ".gitignore",
        }:
            files.append(path)
    return files


def test_no_file_narrates_how_the_project_was_developed():
    pattern = re.compile("|".join(DEVELOPMENT_WORDS), re.I)
    hits = []
    for path in _tracked_text_files():
        if not path.exists():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = pattern.search(line)
            if m:
                hits.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r} in {line.strip()[:100]}")
    assert not hits, "\n".join(hits[:40]) + (f"\n… {len(hits) - 40} more" if len(hits) > 40 else "")


def test_the_development_words_are_caught():
    pattern = re.compile("|".join(DEVELOPMENT_WORDS), re.I)
    for bad in ("the twenty-sixth " + "session", "measured in an earlier " + "session", "iss" + "ue 21 goals"):
        assert pattern.search(bad), bad
    for fine in ('@pytest.fixture(scope="session")', "a resumed run", "torchrun starts each rank in a session"):
        assert not pattern.search(fine), fine


def test_the_readme_is_a_guide_that_reaches_the_gpu_steps_early():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md is {len(lines)} lines; detail belongs in docs/"
    gpu = [i for i, line in enumerate(lines, 1) if "--cuda" in line or "--device cuda" in line]
    assert gpu and gpu[0] <= 100, "the first GPU command must come within the README's first 100 lines"


def test_the_architecture_page_names_every_module_of_the_tree():
    """docs/architecture.md's tree matches the package: every module of every stage is named in it."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    tree = text.split("```text", 1)[1].split("```", 1)[0]
    missing = []
    for path in sorted((ROOT / "dflashkit").rglob("*.py")):
        rel = path.relative_to(ROOT / "dflashkit")
        if path.name in ("__init__.py", "__main__.py") or (len(rel.parts) == 1 and path.stem in ("cli", "failures")):
            continue
        if len(rel.parts) > 1 and not re.search(rf"\b{re.escape(rel.parts[0])}/", tree):
            missing.append(f"{rel.parts[0]}/ (the package)")
        if not re.search(rf"\b{re.escape(path.stem)}\b", tree):
            missing.append(str(rel))
    assert not missing, "docs/architecture.md does not name: " + ", ".join(sorted(set(missing)))


def test_every_python_example_compiles_and_calls_decoding_with_its_settings_object():
    """Python blocks in README and docs are valid Python, and the decoding entry points get their options through
    their settings objects (a keyword such as `method=` passed to `generate` would be a TypeError)."""
    import ast

    problems = []
    settings_only = {"generate": {"drafter", "settings"}, "evaluate": {"out_dir", "settings", "dataset", "skipped"}}
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
            where = f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}"
            try:
                tree = ast.parse(m.group(1))
            except SyntaxError as e:
                problems.append(f"{where}: {e}")
                continue
            for node in ast.walk(tree):
                name = getattr(node.func, "id", None) if isinstance(node, ast.Call) else None
                if name in settings_only:
                    extra = {k.arg for k in node.keywords} - settings_only[name] - {None}
                    if extra:
                        problems.append(f"{where}: {name}(…, {', '.join(sorted(extra))}=…) — pass them in settings")
    assert not problems, "\n".join(problems)
