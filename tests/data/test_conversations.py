"""Conversations, JSONL parsing, loss masks, and the bundled datasets (ShareGPT, MT-Bench, HumanEval)."""

from __future__ import annotations

import json

import pytest

from dflashkit.data.conversations import (
    Conversation,
    prompt_messages,
    read_jsonl_conversations,
    tokenize_for_training,
    tokenize_regenerated,
)
from dflashkit.data.datasets import DATASETS, heldout, load_dataset, load_humaneval, load_mtbench, load_sharegpt
from dflashkit.errors import DataError


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from dflashkit.target.default import ensure_default_target

    return AutoTokenizer.from_pretrained(ensure_default_target())


def _write(tmp_path, lines, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return p


def _spans(tok, sample):
    """Decoded runs of consecutive supervised tokens."""
    spans, cur = [], []
    for i, m in zip(sample.input_ids, sample.loss_mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    return [tok.decode(s) for s in spans]


# ------------------------------------------------------------------------------------------- JSONL
def test_jsonl_formats(tmp_path):
    p = _write(
        tmp_path,
        [
            {
                "id": "a",
                "messages": [
                    {"role": "system", "content": "S"},
                    {"role": "user", "content": "U"},
                    {"role": "assistant", "content": [{"type": "text", "text": "A"}]},
                ],
            },
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
            {"prompt": "just a prompt", "id": 7},
            json.dumps("bare string"),
            "",
        ],
    )
    convs, problems = read_jsonl_conversations(p)
    assert problems == []
    assert [c.id for c in convs] == ["a", "d-2", "7", "d-4"]
    assert convs[0].messages == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
    ]
    assert convs[1].messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert convs[2].messages == [{"role": "user", "content": "just a prompt"}]
    assert convs[3].messages == [{"role": "user", "content": "bare string"}]
    assert all(c.source == str(p) for c in convs)


def test_malformed_line_stop_names_file_and_line(tmp_path):
    p = _write(tmp_path, [{"prompt": "ok"}, '{"prompt": "broken', {"prompt": "ok2"}])
    with pytest.raises(DataError, match=rf"{p.name}:2: invalid JSON"):
        read_jsonl_conversations(p)
    p2 = _write(tmp_path, [{"prompt": "ok"}, {"messages": [{"role": "bot", "content": "x"}]}], "r.jsonl")
    with pytest.raises(DataError, match=r"r.jsonl:2: field messages\[0\].role: expected one of system\|user"):
        read_jsonl_conversations(p2)


def test_skip_mode_records_problems(tmp_path):
    p = _write(
        tmp_path,
        [{"prompt": "ok"}, "not json", {"text": "no known field"}, {"prompt": "ok", "id": "d-1"}, {"prompt": "fine"}],
    )
    convs, problems = read_jsonl_conversations(p, on_error="skip")
    assert [c.messages[0]["content"] for c in convs] == ["ok", "fine"]
    assert len(problems) == 3
    assert problems[0].startswith(f"{p}:2:") and "invalid JSON" in problems[0]
    assert f"{p}:3:" in problems[1] and "'messages'" in problems[1]
    assert f"{p}:4:" in problems[2] and "duplicate id" in problems[2]


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(DataError, match="no conversations"):
        read_jsonl_conversations(_write(tmp_path, ["", "  "]))
    with pytest.raises(DataError, match=r"no conversations.*1 malformed"):
        read_jsonl_conversations(_write(tmp_path, ["[1, 2]"], "bad.jsonl"), on_error="skip")
    with pytest.raises(DataError, match="no such file"):
        read_jsonl_conversations(tmp_path / "nope.jsonl")


def test_no_user_and_no_assistant(tmp_path, tok):
    p = _write(tmp_path, [{"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}])
    with pytest.raises(DataError, match=r"d.jsonl:1: no user message"):
        read_jsonl_conversations(p)
    conv = Conversation([{"role": "user", "content": "q"}], "x", "t")
    assert prompt_messages(conv) == conv.messages
    with pytest.raises(DataError, match="no assistant message"):
        tokenize_for_training(tok, conv.messages, max_length=100)
    with pytest.raises(DataError, match="no user message"):
        prompt_messages(Conversation([{"role": "assistant", "content": "a"}], "y", "t"))


def test_prompt_messages_first_turn_only():
    conv = Conversation(
        [
            {"role": "assistant", "content": "continuation"},
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "u2"},
            {"role": "assistant", "content": "a2"},
        ],
        "c",
        "t",
    )
    assert prompt_messages(conv) == [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}]


# ------------------------------------------------------------------------------------------- loss mask
def test_loss_mask_single_turn(tok):
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!\n\nHow can I help?"}]
    s = tokenize_for_training(tok, msgs, max_length=4096)
    assert not s.truncated and len(s.input_ids) == len(s.loss_mask)
    assert _spans(tok, s) == ["Hello!\n\nHow can I help?<|im_end|>"]
    assert s.input_ids == tok.apply_chat_template(msgs, tokenize=True, return_dict=False)


def test_loss_mask_multi_turn_with_system(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": " 6, of course "},
        {"role": "user", "content": "trailing, dropped"},
    ]
    s = tokenize_for_training(tok, msgs, max_length=4096)
    assert _spans(tok, s) == ["4<|im_end|>", " 6, of course <|im_end|>"]
    assert "trailing" not in tok.decode(s.input_ids)


def test_loss_mask_truncation(tok):
    msgs = [{"role": "user", "content": "Say a lot"}, {"role": "assistant", "content": "word " * 100}]
    full = tokenize_for_training(tok, msgs, max_length=10_000)
    s = tokenize_for_training(tok, msgs, max_length=40)
    assert s.truncated and not full.truncated
    assert len(s.input_ids) == 40 and s.input_ids == full.input_ids[:40] and s.loss_mask == full.loss_mask[:40]


# A ChatML template with a Qwen3-style thinking switch: history turns drop the think block, the generation
# prompt carries an empty one when thinking is off. The mask must follow what the model writes.
THINK_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' and loop.last %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{{ m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)


@pytest.mark.parametrize("thinking", [True, False])
def test_loss_mask_thinking_template(tok, thinking):
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = THINK_TEMPLATE
    msgs = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    s = tokenize_for_training(t, msgs, max_length=4096, chat_template_kwargs={"enable_thinking": thinking})
    spans = _spans(t, s)
    assert spans[0] == "a1<|im_end|>"  # history turn: no think block in the template
    if thinking:  # the model writes the (empty) think block itself
        assert spans[1] == "<think>\n\n</think>\n\na2<|im_end|>"
    else:  # the prompt ends in "</think>\n\n"; BPE merges "\n\na2" differently, so the one straddling token is
        # supervised (it carries content characters); no template token before it is
        assert spans[1].endswith("a2<|im_end|>") and spans[1].strip() == "a2<|im_end|>"


def test_tokenize_regenerated(tok):
    prompt = [{"role": "user", "content": "Hi"}]
    resp = tok("Hello you", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    s = tokenize_regenerated(tok, prompt, resp, max_length=4096)
    assert _spans(tok, s) == ["Hello you<|im_end|>"]
    assert s.input_ids[: -len(resp)] == tok.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, return_dict=False
    )


# ------------------------------------------------------------------------------------------- datasets
def test_sharegpt_parse_and_split():
    problems: list[str] = []
    train = load_sharegpt("train", problems=problems)
    held = load_sharegpt("heldout")
    assert len(train) + len(held) > 17_000
    assert 0.01 < len(held) / (len(train) + len(held)) < 0.03
    train_ids, held_ids = {c.id for c in train}, {c.id for c in held}
    assert len(train_ids) == len(train) and len(held_ids) == len(held)  # repeated ids were made unique
    assert not train_ids & held_ids
    assert not {i.rsplit("_", 1)[0] for i in train_ids} & {i.rsplit("_", 1)[0] for i in held_ids}
    assert all(heldout(c.id.split(".")[0]) for c in held)
    assert problems and all("record" in p for p in problems)  # dropped records are reported
    assert [c.id for c in load_sharegpt("heldout", limit=5)] == [c.id for c in held[:5]]  # deterministic
    roles = {m["role"] for c in train[:2000] for m in c.messages}
    assert roles <= {"system", "user", "assistant"}


def test_benchmarks():
    mt = load_mtbench()
    assert len(mt) == 80 and len({c.id for c in mt}) == 80
    assert all(len(c.meta["turns"]) == 2 and c.messages[0]["content"] == c.meta["turns"][0] for c in mt)
    assert load_mtbench(turn=2)[0].messages[0]["content"] == mt[0].meta["turns"][1]
    he = load_humaneval()
    assert len(he) == 164 and he[0].id == "HumanEval/0"
    text = he[0].messages[0]["content"]
    assert text.startswith("Complete the following Python function.") and he[0].meta["prompt"] in text
    assert text.endswith("```")


def test_a_limited_mtbench_takes_its_categories_in_turn():
    every = load_mtbench()
    cats = list(dict.fromkeys(c.meta["category"] for c in every))  # the file's order of first appearance
    assert len(cats) == 8
    few = load_mtbench(limit=10)
    assert [c.meta["category"] for c in few] == cats + cats[:2]
    first = {cat: [c.id for c in every if c.meta["category"] == cat] for cat in cats}
    assert [c.id for c in few[:8]] == [first[cat][0] for cat in cats]  # each category's first question
    assert few[8].id == first[cats[0]][1] and load_dataset("mtbench", limit=10)[0] == few
    assert sorted(c.id for c in load_mtbench(limit=80)) == sorted(c.id for c in every)


def test_load_dataset_registry(tmp_path):
    assert set(DATASETS) == {"sharegpt", "sharegpt-heldout", "mtbench", "humaneval"}
    convs, problems = load_dataset("mtbench", limit=3)
    assert len(convs) == 3 and problems == []
    p = _write(tmp_path, [{"prompt": "a"}, {"prompt": "b"}])
    assert len(load_dataset(str(p))[0]) == 2
    with pytest.raises(DataError, match="unknown dataset 'shargpt': expected one of sharegpt, sharegpt-heldout"):
        load_dataset("shargpt")
