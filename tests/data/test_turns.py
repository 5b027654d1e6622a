"""Every-turn regeneration: which turns, the target's own replies as later context, samples made of exactly the ids
the target saw and wrote (one joined sample or one per turn), and thinking modes."""

from __future__ import annotations

import json

import pytest

from dflashkit.data.conversations import Conversation, encode_prompt
from dflashkit.data.regenerate import RegenSettings, generate_batch, read_regenerated, regenerate
from dflashkit.data.thinking import split_reasoning
from dflashkit.data.tokens_file import write_tokens
from dflashkit.data.turns import TurnState, tokenize_turns, turn_segments


def _m(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def test_turn_segments():
    conv = Conversation(
        [
            _m("system", "S"),
            _m("assistant", "lead"),  # no prompt: dropped
            _m("user", "u1"),
            _m("assistant", "a1"),
            _m("assistant", "a1 continued"),  # a split-off continuation: replaced with the first reply
            _m("user", "u2"),
            _m("user", "u2b"),
            _m("assistant", "a2"),
            _m("user", "u3"),  # a trailing user message gets a reply too
        ],
        "x",
        "t",
    )
    assert turn_segments(conv, "all") == [
        [_m("system", "S"), _m("user", "u1")],
        [_m("user", "u2"), _m("user", "u2b")],
        [_m("user", "u3")],
    ]
    assert turn_segments(conv, "first") == [[_m("system", "S"), _m("user", "u1")]]
    assert turn_segments(Conversation([_m("assistant", "a")], "y", "t"), "all") == []
    with pytest.raises(Exception, match="turns='some'"):
        turn_segments(conv, "some")


def test_split_reasoning_and_thinking_on_state():
    assert split_reasoning("<think>\nplan it\n</think>\n\nThe answer.") == ("plan it", "The answer.")
    assert split_reasoning("no reasoning") == ("", "no reasoning")
    state = TurnState(Conversation([_m("user", "q")], "z", "t"), turns="all", thinking="on")
    state.history = [_m("user", "q")]
    state.add_reply([5, 6, 2], "<think>hm</think>\n\nA.", True)
    assert state.history[-1] == _m("assistant", "A.")
    rec = state.record({"s": 1})
    assert rec["reasoning"] == ["hm"] and rec["turn_token_ids"] == [[5, 6, 2]] and rec["finished"]
    with pytest.raises(Exception, match="thinking='maybe'"):
        TurnState(Conversation([_m("user", "q")], "z", "t"), thinking="maybe")


CONVS = [
    Conversation(
        [_m("user", "Hi"), _m("assistant", "old"), _m("user", "Tell me more."), _m("assistant", "old")], "a", "t"
    ),
    Conversation([_m("user", "What is 2+2?"), _m("assistant", "4"), _m("user", "And 3+3?")], "b", "t"),
    Conversation([_m("user", "One turn only.")], "c", "t"),
]


def test_every_turn_sees_the_targets_own_replies(tiny, tmp_path):
    path = tmp_path / "regen.jsonl"
    stats = regenerate(
        tiny, CONVS, path, progress=False, settings=RegenSettings(max_new_tokens=5, batch_size=2, turns="all")
    )
    recs = {r["id"]: r for r in read_regenerated(path)}
    assert stats.turns == sum(len(r["turn_token_ids"]) for r in recs.values())
    for conv in CONVS:
        rec = recs[conv.id]
        history: list[dict[str, str]] = []
        users = [m for m in conv.messages if m["role"] == "user"]
        n = len(rec["turn_token_ids"])
        assert n == len(users) or not rec["finished"]
        for k in range(n):  # a slow, obvious reference: one prompt at a time, built from the record's own replies
            history.append(users[k])
            prompt = encode_prompt(tiny.tokenizer, history)
            ids, _ = generate_batch(tiny, [prompt], max_new_tokens=5)[0]
            assert rec["turn_token_ids"][k] == ids
            reply = tiny.tokenizer.decode(ids, skip_special_tokens=True)
            history.append(_m("assistant", reply))
        assert rec["messages"] == history
        assert "old" not in [m["content"] for m in rec["messages"]]


def _joined_reference(tok, messages, turn_ids):
    """A Python loop: context of each reply + its ids, chained."""
    ids, mask = [], []
    for k, i in enumerate(i for i, m in enumerate(messages) if m["role"] == "assistant"):
        ctx = encode_prompt(tok, messages[:i])
        assert ctx[: len(ids)] == ids
        mask += [0] * (len(ctx) - len(ids)) + [1] * len(turn_ids[k])
        ids = ctx + turn_ids[k]
    return ids, mask


def test_tokenize_turns_joined_and_split(tiny):
    tok = tiny.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    replies = ["Hello there.", "Sure, more."]
    turn_ids = [tok(r, add_special_tokens=False)["input_ids"] + [end] for r in replies]
    msgs = [_m("user", "Hi"), _m("assistant", replies[0]), _m("user", "More?"), _m("assistant", replies[1])]
    (joined,) = tokenize_turns(tok, msgs, turn_ids, max_length=512)
    ids, mask = _joined_reference(tok, msgs, turn_ids)
    assert joined.input_ids == ids and [int(b) for b in joined.loss_mask] == mask
    assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "Hello there.<|im_end|>Sure, more.<|im_end|>"
    # a reply the target spelled with other ids than the template's re-tokenisation: contexts do not chain, so
    # each turn is its own sample (the ids the target saw and wrote, never a re-tokenised guess)
    odd = [[*tok.convert_tokens_to_ids(list("Hello")), end], turn_ids[1]]
    msgs_odd = [_m("user", "Hi"), _m("assistant", "Hello"), _m("user", "More?"), _m("assistant", replies[1])]
    first, second = tokenize_turns(tok, msgs_odd, odd, max_length=512)
    assert first.input_ids == encode_prompt(tok, msgs_odd[:1]) + odd[0]
    assert second.input_ids == encode_prompt(tok, msgs_odd[:3]) + odd[1]
    assert sum(first.loss_mask) == len(odd[0]) and sum(second.loss_mask) == len(odd[1])
    with pytest.raises(Exception, match="turn id lists"):
        tokenize_turns(tok, msgs, turn_ids[:1], max_length=512)


def test_write_tokens_names_split_turns(tiny, tmp_path):
    tok = tiny.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    odd = [[*tok.convert_tokens_to_ids(list("Hello")), end], [*tok("Ok.", add_special_tokens=False)["input_ids"], end]]
    msgs = [_m("user", "Hi"), _m("assistant", "Hello"), _m("user", "More?"), _m("assistant", "Ok.")]
    report = write_tokens(tok, [("x", msgs, odd)], tmp_path / "t.jsonl", max_length=512)
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["x", "x#2"] and report.split_turns == 1 and report.written == 2


@pytest.mark.parametrize("mode", ["off", "on", "keep"])
def test_prepare_thinking_modes(thinking_dir, tmp_path, mode):
    from dflashkit.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": c.id, "messages": c.messages}) + "\n" for c in CONVS))
    out = tmp_path / "out"
    argv = ["prepare", "--data", str(data), "--out", str(out), "--target", str(thinking_dir), "--max-new-tokens", "4"]
    assert main([*argv, "--turns", "all", "--thinking", mode]) == 0
    report = json.loads((out / "prepare.json").read_text())
    assert report["thinking"] == mode and report["turns"] == "all"
    assert report["chat_template_kwargs"] == {"enable_thinking": mode != "off"}
    recs = read_regenerated(out / "regenerated.jsonl")
    assert all(r["generation"]["thinking"] == mode for r in recs)
    assert all(("reasoning" in r) == (mode == "on") for r in recs)
    rows = [json.loads(line) for line in (out / "tokens.jsonl").read_text().splitlines()]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(thinking_dir)
    think = tok("<think>\n\n</think>", add_special_tokens=False)["input_ids"]
    text = tok.decode(rows[0]["input_ids"])
    assert ("<think>\n\n</think>" in text) == (mode == "off")  # the switch reached the prompt
    assert len(think) > 1
    # resuming with another thinking mode is refused: the file would mix two distributions
    other = {"off": "keep", "on": "off", "keep": "on"}[mode]
    assert main([*argv, "--turns", "all", "--thinking", other]) == 2


def test_a_reply_cut_at_the_cap_does_not_end_the_conversation(tiny, tmp_path):
    path = tmp_path / "regen.jsonl"
    regenerate(tiny, CONVS, path, progress=False, settings=RegenSettings(max_new_tokens=2, turns="all"))
    for rec in read_regenerated(path):
        users = sum(m["role"] == "user" for m in rec["messages"])
        assert len(rec["turn_token_ids"]) == users and all(len(ids) <= 2 for ids in rec["turn_token_ids"])
    # a context over the prompt limit ends it there, earlier turns kept
    limit = len(encode_prompt(tiny.tokenizer, CONVS[0].messages[:1])) + 4
    regenerate(
        tiny,
        CONVS[:1],
        tmp_path / "short.jsonl",
        settings=RegenSettings(max_new_tokens=2, turns="all", max_prompt_length=limit),
    )
    (rec,) = read_regenerated(tmp_path / "short.jsonl")
    assert len(rec["turn_token_ids"]) == 1
