"""Regeneration with a tiny random target (SmolLM2 tokenizer): output lines, resume after a kill, batching,
and `dflashkit prepare` end to end."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from dflashkit.data.conversations import Conversation, encode_prompt, end_of_turn_ids
from dflashkit.data.regenerate import RegenSettings, generate_batch, read_regenerated, regenerate
from dflashkit.errors import DataError
from dflashkit.target.model import Target

QUESTIONS = [
    "Hi",
    "Tell me a long story about dragons, please.",
    "What is 2+2?",
    "Name three colours.",
    "Why is the sky blue? Explain briefly.",
    "ok",
]


def _convs(n: int | None = None):
    n = len(QUESTIONS) if n is None else n
    return [
        Conversation([{"role": "user", "content": q}, {"role": "assistant", "content": "old answer"}], f"c{i}", "test")
        for i, q in enumerate(QUESTIONS[:n])
    ]


def test_batched_equals_unbatched_greedy(tiny):
    prompts = [encode_prompt(tiny.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS[:3]]
    assert len({len(p) for p in prompts}) == 3  # different lengths → real left padding
    batched = generate_batch(tiny, prompts, max_new_tokens=10)
    single = [generate_batch(tiny, [p], max_new_tokens=10)[0] for p in prompts]
    assert batched == single
    assert len({tuple(r) for r, _ in single}) == 3  # outputs differ per prompt
    # control: attending to the pads (no attention mask) changes the outputs, so the check above has teeth
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])
    out = tiny.model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, pad_token_id=2
    )
    assert [r[width:] for r in out.tolist()] != [r for r, _ in single]


def test_regenerate_writes_lines(tiny, tmp_path):
    out = tmp_path / "regen.jsonl"
    convs = [*_convs(3), Conversation([{"role": "assistant", "content": "no user"}], "bad", "test")]
    stats = regenerate(tiny, convs, out, progress=False, settings=RegenSettings(max_new_tokens=6, batch_size=2))
    recs = read_regenerated(out)
    assert sorted(r["id"] for r in recs) == ["c0", "c1", "c2"]
    assert stats.generated == 3 and "bad" in stats.skipped and stats.new_tokens > 0
    for r in recs:
        assert r["messages"][:-1] == [{"role": "user", "content": QUESTIONS[int(r["id"][1:])]}]
        assert r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"] != "old answer"
        assert 1 <= len(r["response_token_ids"]) <= 6
        if r["finished"]:
            assert r["response_token_ids"][-1] in end_of_turn_ids(tiny.tokenizer)
        else:
            assert len(r["response_token_ids"]) == 6
        assert r["generation"] == {
            "max_new_tokens": 6,
            "temperature": 0.0,
            "top_p": 1.0,
            "chat_template_kwargs": {},
            "target": tiny.source,
        }
    # settings must match when resuming
    with pytest.raises(DataError, match="generation settings"):
        regenerate(tiny, convs, out, progress=False, settings=RegenSettings(max_new_tokens=7))


def test_resume_after_kill(tiny, tmp_path):
    convs = _convs()
    ref = tmp_path / "ref.jsonl"
    regenerate(tiny, convs, ref, progress=False, settings=RegenSettings(max_new_tokens=8, batch_size=2))
    out = tmp_path / "regen.jsonl"
    text = ref.read_text()
    lines = text.splitlines(keepends=True)
    out.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2])  # killed mid-line
    assert len(read_regenerated(out)) == 2
    stats = regenerate(tiny, convs, out, progress=False, settings=RegenSettings(max_new_tokens=8, batch_size=2))
    assert stats.already_done == 2 and stats.generated == len(convs) - 2
    recs = read_regenerated(out)
    assert len(recs) == len(convs) and len({r["id"] for r in recs}) == len(convs)
    assert {r["id"]: r for r in recs} == {r["id"]: r for r in read_regenerated(ref)}  # greedy: nothing lost
    again = regenerate(tiny, convs, out, progress=False, settings=RegenSettings(max_new_tokens=8))
    assert again.generated == 0 and again.already_done == len(convs)
    # a damaged line that is not the last one is an error naming the line
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0] + "{oops\n" + lines[1])
    with pytest.raises(DataError, match=r"bad.jsonl:2: damaged"):
        read_regenerated(bad)
    # … and so is a line whose fields are of the wrong type, named by its path (tokenising it would crash later)
    for change, why in (
        (lambda r: r.update(response_token_ids=[1, "x"]), 'response_token_ids[1] = "x": expected an integer'),
        (lambda r: r["messages"][0].update(content=None), "messages[0].content = null: expected a string"),
        (lambda r: r.update(turn_token_ids=[[1, -2]]), "turn_token_ids[0][1] = -2: expected a number ≥ 0"),
    ):
        rec = json.loads(lines[1])
        change(rec)
        bad.write_text(lines[0] + json.dumps(rec) + "\n")
        with pytest.raises(DataError, match=rf"bad.jsonl:2: damaged regeneration record \({re.escape(why)}\)"):
            read_regenerated(bad)


def test_prepare_end_to_end(tiny_dir, tmp_path, capsys):
    from dflashkit.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {
                    "id": "a",
                    "messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"}],
                },
                {"id": "b", "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},
                {"id": "c", "prompt": "Write a haiku."},
            ]
        )
        + "\n"
    )
    out = tmp_path / "prep"
    argv = [
        "prepare",
        "--data",
        str(data),
        "--out",
        str(out),
        "--target",
        str(tiny_dir),
        "--max-new-tokens",
        "5",
        "--batch-size",
        "2",
        "--max-length",
        "64",
    ]
    assert main(argv) == 0
    assert "prepared 3 samples" in capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "tokens.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == ["a", "b", "c"]
    for r in rows:
        assert len(r["input_ids"]) == len(r["loss_mask"]) <= 64 and set(r["loss_mask"]) <= {0, 1}
        assert 1 <= sum(r["loss_mask"]) <= 5 and r["loss_mask"][-1] == 1
    report = json.loads((out / "prepare.json").read_text())
    assert report["conversations_read"] == 3 and report["samples_written"] == 3
    assert report["supervised_tokens"] == sum(sum(r["loss_mask"]) for r in rows)
    assert report["total_tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert report["regeneration"]["generated"] == 3 and report["target"] == str(tiny_dir)
    # rerun: regeneration is reused, outputs identical
    before = (out / "tokens.jsonl").read_text()
    assert main(argv) == 0
    assert json.loads((out / "prepare.json").read_text())["regeneration"]["already_done"] == 3
    assert (out / "tokens.jsonl").read_text() == before
    # --no-regenerate: the data's own answers; the prompt-only line has none and is skipped with a reason
    out2 = tmp_path / "prep2"
    assert main(["prepare", "--data", str(data), "--out", str(out2), "--target", str(tiny_dir), "--no-regenerate"]) == 0
    rep2 = json.loads((out2 / "prepare.json").read_text())
    assert rep2["samples_written"] == 2 and "no assistant" in rep2["skipped_reasons"]["c"]
    assert not (out2 / "regenerated.jsonl").exists()


def test_prepare_time_budget_stops_and_the_same_command_continues(tiny_dir, tmp_path, capsys):
    """--time-budget-minutes: past it no batch starts (the first always does); prepare.json counts the rest and says
    the data is not complete; the same command without (or with) the budget continues and ends with the lines of an
    uninterrupted run, none twice."""
    from dflashkit.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": c.id, "messages": c.messages}) + "\n" for c in _convs()))

    def argv(out, *extra):
        return ["prepare", "--data", str(data), "--out", str(out), "--target", str(tiny_dir), "--max-new-tokens",
                "4", "--batch-size", "2", "--max-length", "64", *extra]  # fmt: skip

    assert main(argv(tmp_path / "whole")) == 0
    capsys.readouterr()
    out = tmp_path / "boxed"
    assert main(argv(out, "--time-budget-minutes", "0.000001")) == 0
    printed = capsys.readouterr().out
    assert "4 conversations not regenerated yet; run the same command again" in printed
    report = json.loads((out / "prepare.json").read_text())
    assert report["regeneration"]["generated"] == 2 and report["regeneration"]["not_started"] == 4
    assert report["complete"] is False and report["samples_written"] == 2
    assert main(argv(out)) == 0
    report = json.loads((out / "prepare.json").read_text())
    assert report["regeneration"]["already_done"] == 2 and report["regeneration"]["not_started"] == 0
    assert report["complete"] is True and report["samples_written"] == len(QUESTIONS)
    whole = read_regenerated(tmp_path / "whole" / "regenerated.jsonl")
    boxed = read_regenerated(out / "regenerated.jsonl")
    assert len(boxed) == len({r["id"] for r in boxed}) == len(QUESTIONS)
    strip = lambda rs: sorted((r["id"], r["messages"][-1]["content"]) for r in rs)  # noqa: E731
    assert strip(boxed) == strip(whole)
    assert (out / "tokens.jsonl").read_text() == (tmp_path / "whole" / "tokens.jsonl").read_text()
    assert main(argv(tmp_path / "o", "--no-regenerate", "--time-budget-minutes", "5")) == 2
    assert "--time-budget-minutes with --no-regenerate" in capsys.readouterr().err


def test_prepare_errors(tiny_dir, tmp_path, capsys):
    from dflashkit.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "ok"}\nnot json\n')
    assert main(["prepare", "--data", str(data), "--out", str(tmp_path / "o"), "--target", str(tiny_dir)]) == 2
    assert "d.jsonl:2" in capsys.readouterr().err
    assert main(["prepare", "--data", "nosuchset", "--out", str(tmp_path / "o")]) == 2
    assert "expected one of sharegpt" in capsys.readouterr().err


def test_original_text_keeps_its_order_and_fits_a_token_budget(tmp_path):
    """ShareGPT conversations with their original reply, as tokens.jsonl lines; a token budget (the capture time the
    quickstart can afford on this machine) keeps a prefix of them, and the report counts what was kept."""
    from dflashkit.data.original_text import ID_PREFIX, write_original_text

    tok = Target.load("default").tokenizer
    full = write_original_text(tok, 6, tmp_path / "all.jsonl", exclude=set(), max_prompt_tokens=384)
    rows = [json.loads(line) for line in (tmp_path / "all.jsonl").read_text().splitlines()]
    assert full.written == len(rows) == 6 and all(r["id"].startswith(ID_PREFIX) for r in rows)
    budget = len(rows[0]["input_ids"]) + len(rows[1]["input_ids"]) + 1
    cut = write_original_text(
        tok, 6, tmp_path / "cut.jsonl", exclude=set(), max_prompt_tokens=384, max_total_tokens=budget
    )
    kept = [json.loads(line) for line in (tmp_path / "cut.jsonl").read_text().splitlines()]
    assert [r["id"] for r in kept] == [r["id"] for r in rows[:2]] and cut.written == 2
    assert cut.total_tokens == budget - 1 and cut.supervised == sum(sum(r["loss_mask"]) for r in kept)


def test_quickstart_in_process_rate_does_the_servers_job(tiny, monkeypatch):
    """The quickstart's in-process side of its route choice (dflashkit/quickstart/server.py), real `generate` on a
    tiny target: the prompts answered in batches, at most RATE_TOKENS new tokens each, a
    closing stop token not counted (the server may not return it) — so the count equals the replies' content."""
    import dflashkit.quickstart.server as server_mod
    from dflashkit.data.conversations import default_stop_token_ids

    prompts = [
        encode_prompt(tiny.tokenizer, [{"role": "user", "content": q}]) for q in ("Hi", "Name a colour.", "2+2?")
    ]
    clock = iter([10.0, 12.0])  # the timed span: 2 s
    monkeypatch.setattr(server_mod, "time", SimpleNamespace(perf_counter=lambda: next(clock)))  # this module's clock
    rate = server_mod.in_process_rate(tiny, prompts, batch=2)
    monkeypatch.undo()
    stops = default_stop_token_ids(tiny)
    replies = [generate_batch(tiny, [p], max_new_tokens=server_mod.RATE_TOKENS, stop_ids=stops)[0][0] for p in prompts]
    content = sum(len(r) - (r[-1] in stops) for r in replies)  # batched greedy = one by one (test above)
    assert 0 < content <= 3 * server_mod.RATE_TOKENS and rate == content / 2.0
    assert server_mod._content_tokens([5, 6, stops[0]], stops) == 2 and server_mod._content_tokens([], stops) == 0
