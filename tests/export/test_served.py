"""serve-check --server against deployments dflashkit did not start (tests/helpers/fake_engine.py: vLLM's and
llama-server's protocols and counters, a real tiny target and a drafter trained on it): a correct deployment agrees
exactly and raises no cause; each deliberately broken one (template, quantized target, layer ids, a window shorter
than the prompts, T > 0) is diagnosed by name; a server that cannot be checked says why in one line. The live engines
are in tests/export/test_served_engines.py (opt-in)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflashkit.cli import main
from dflashkit.decode.generate import DecodeSettings, generate
from dflashkit.export.convert import load_any_drafter
from dflashkit.export.served import ServedError, ServedSettings, check_server, read_counters, served_config
from dflashkit.export.served_diagnosis import same_counts
from dflashkit.train.loop import train
from helpers.bad_input import _one_line_error
from helpers.fake_engine import FakeEngine, render
from helpers.train_runs import cfg_for

N = 16  # output tokens a request


def _chat(i: int, n: int) -> list[dict[str, str]]:
    """A one-message chat whose rendering (fake_engine.render: 3 tokens + one per character) is n tokens long."""
    return [{"role": "user", "content": "".join(chr(97 + (5 * i + 3 * k + k * k) % 26) for k in range(n - 3))}]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, target, tiny_llama_dir, one_torch_thread) -> Path:
    """A drafter trained for 300 steps on the tiny target's own greedy continuations of rendered chats (~15 s): it
    accepts often enough that a wrong deployment changes its counts."""
    root = tmp_path_factory.mktemp("served")
    with (root / "tokens.jsonl").open("w") as f:
        for i in range(64):
            prompt = render(_chat(100 + i, 8 + (i * 7) % 40))
            out = generate(target, prompt, settings=DecodeSettings(method="ar", max_new_tokens=40)).tokens
            mask = [0] * len(prompt) + [1] * len(out)
            f.write(json.dumps({"id": f"x{i}", "input_ids": prompt + out, "loss_mask": mask}) + "\n")
    cfg = cfg_for(
        root / "run", tokens=str(root / "tokens.jsonl"), online=True, target=str(tiny_llama_dir), max_steps=300,
        max_tokens=256, save_every=1000, lr=3e-3,
    )  # fmt: skip
    train(cfg, target=target)
    return root / "run" / "final"


@pytest.fixture(scope="module")
def drafter(trained, target):
    return load_any_drafter(trained, target=target).eval()


def _prompts(lengths=(8, 9, 10, 11)) -> list[SimpleNamespace]:
    """Chats of the given rendered lengths, as the drafter was "trained" to see them."""
    chats = [_chat(i, n) for i, n in enumerate(lengths)]
    return [SimpleNamespace(id=f"p{i}", ids=render(m), messages=m) for i, m in enumerate(chats)]


def _check(target, drafter, prompts=None, settings=None, **engine):
    with FakeEngine(target, drafter, **engine) as srv:
        return check_server(target, drafter, srv.url, prompts or _prompts(), settings=settings or ServedSettings(N))


def test_prometheus_counters_of_both_engines_are_read_and_summed_over_labels():
    vllm = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 45.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 3.0
vllm:generation_tokens_total{engine="0",model_name="m"} 99.0
vllm:num_requests_running{engine="0"} 1.0
"""
    c = read_counters(vllm)
    assert (c.engine, c.drafts, c.draft_tokens, c.accepted, c.generated) == ("vllm", 15, 45, 20, 99)
    assert c.per_pos == {0: 13.0, 2: 3.0}
    llama = "llamacpp:tokens_predicted_total 64\nllamacpp:spec_decode_num_drafts_total 7\n"
    llama += "llamacpp:spec_decode_num_accepted_tokens_total 9\n"
    llama += 'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 4\n'
    c = read_counters(llama)
    assert (c.engine, c.drafts, c.accepted, c.generated, c.per_pos) == ("llamacpp", 7, 9, 64, {1: 4.0})
    assert read_counters("vllm:generation_tokens_total 5\nvllm:num_requests_running 0\n") is None  # no drafter
    assert read_counters("garbage\n{}\nvllm:spec_decode_num_drafts_total nan\n") is None
    before = read_counters(llama)
    later = read_counters(llama.replace("_drafts_total 7", "_drafts_total 2"))
    assert later.minus(before).went_down()


@pytest.mark.parametrize("protocol", ["openai", "llama.cpp"])
def test_a_correct_deployment_agrees_exactly_and_names_no_cause(target, drafter, protocol):
    report = _check(target, drafter, protocol=protocol)
    assert report.findings == [], report.render()
    assert report.engine == ("vllm" if protocol == "openai" else "llamacpp")
    for p in report.prompts:
        assert p.same_tokens and p.engine is not None
        assert (
            same_counts(p.engine, p.teacher_forced) and p.engine.accepted_per_pos == p.teacher_forced.accepted_per_pos
        )
        assert p.own.accepted == p.teacher_forced.accepted  # the server's output is the target's own here
    s = report.summary()
    assert s["engine"]["accepted"] > 0  # the drafter accepts: a broken deployment has counts to change
    assert s["engine"] == s["dflashkit_on_server_output"] == s["dflashkit_own"]
    text = report.render()
    assert "no cause found" in text and "per prompt" in text
    assert json.loads(json.dumps(report.as_dict()))["agrees"] is True


def test_the_round_rules_differ_as_the_engines_do(target, drafter):
    """vLLM verifies a full block every round and counts past the end; llama-server drafts no more than the output
    keeps: on the same outputs the two counts differ only in the last rounds."""
    vllm = _check(target, drafter, protocol="openai")
    llama = _check(target, drafter, protocol="llama.cpp")
    for a, b in zip(vllm.prompts, llama.prompts, strict=True):
        assert a.teacher_forced.tokens == b.teacher_forced.tokens
        assert a.teacher_forced.drafts >= b.teacher_forced.drafts
        assert a.teacher_forced.accepted >= b.teacher_forced.accepted


def test_llama_server_without_metrics_is_compared_on_its_answers(target, drafter):
    report = _check(target, drafter, protocol="llama.cpp", metrics=False)
    assert report.engine == "llama.cpp answers" and report.findings == []
    assert all(p.engine.drafts == -1 and p.engine.accepted == p.teacher_forced.accepted for p in report.prompts)
    assert report.summary()["engine"]["tau"] is None  # no rounds in its answers: no τ claimed


LONG = (8, 9, 40, 50)  # two prompts within a 24-token context (+ 16 new), two past it
MID = (12, 14, 16, 18)


@pytest.mark.parametrize(
    ("fault", "engine", "lengths", "cause", "says"),
    [
        ("template", {"system_prompt": [7, 8, 9]}, None, "template", "prompt tokens differ"),
        ("quantized target", {"target_noise": 0.3}, None, "numerics", "quantized"),
        ("layer ids", {"layer_map": {i: i + 2 for i in range(1, 6)}}, MID, "config", "another drafter"),
        ("window", {"window": 24}, LONG, "length", "falls with prompt length"),
        ("T > 0", {"temperature": 1.0}, None, "sampling", "greedy"),
    ],
)
@pytest.mark.parametrize("protocol", ["openai", "llama.cpp"])
def test_each_broken_deployment_is_diagnosed_by_name(target, drafter, protocol, fault, engine, lengths, cause, says):
    report = _check(target, drafter, _prompts(lengths) if lengths else None, protocol=protocol, **engine)
    assert [f.cause for f in report.findings] == [cause], report.render()
    assert says in report.findings[0].line and report.findings[0].fix
    assert f"{cause}: " in report.render() and "fix: " in report.render()


def test_the_window_case_agrees_on_the_short_prompts(target, drafter):
    report = _check(target, drafter, _prompts(LONG), window=24)
    short, long = report.prompts[:2], report.prompts[2:]
    assert all(p.same_tokens and same_counts(p.engine, p.teacher_forced) for p in short)
    assert all(not p.same_tokens for p in long)


def test_the_served_files_name_the_field_that_differs(tmp_path, target, drafter, trained):
    served = tmp_path / "served"
    served.mkdir()
    wrong = drafter.config.replace(target_layer_ids=[i + 1 for i in drafter.config.target_layer_ids])
    wrong.save(served / "config.json")
    facts = served_config(served)
    assert facts["target_layer_ids"] == wrong.target_layer_ids
    shifted = {i: i + 1 for i in drafter.config.target_layer_ids}
    report = _check(target, drafter, settings=ServedSettings(N, served_config=facts), layer_map=shifted)
    assert [f.cause for f in report.findings] == ["config"]
    assert "target_layer_ids" in report.findings[0].line and "served" in report.findings[0].line
    # the trained files themselves: no difference, no cause
    assert _check(target, drafter, settings=ServedSettings(N, served_config=served_config(trained))).findings == []


@pytest.mark.parametrize("protocol", ["openai", "llama.cpp"])
def test_a_server_without_speculative_decoding_is_one_clear_error(target, drafter, protocol):
    with pytest.raises(ServedError, match="speculative"):
        _check(target, drafter, protocol=protocol, speculative=False)
    with pytest.raises(ServedError, match="no speculative-decoding counters"):
        _check(target, drafter, protocol=protocol, speculative=False, metrics=False)


def test_other_traffic_and_resets_leave_counters_out_and_say_so(target, drafter):
    with pytest.raises(ServedError, match="other traffic"):
        _check(target, drafter, other_traffic=3)
    report = _check(target, drafter, reset_after=2)  # the third request's counters start from zero
    left = [p for p in report.prompts if p.engine is None]
    assert len(left) == 1 and "went down" in left[0].left_out
    assert report.findings == [] and any("left out" in n for n in report.notes)


def test_an_unreachable_server_is_one_line(target, drafter):
    from dflashkit.export.llama_server import free_port

    with pytest.raises(ServedError, match="no server answers"):
        check_server(target, drafter, f"http://127.0.0.1:{free_port()}", _prompts(), settings=ServedSettings(N))


def test_cli_checks_a_server_and_exits_by_what_it_found(tmp_path, target, drafter, trained, tiny_llama_dir, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": p.id, "prompt_ids": p.ids}) + "\n" for p in _prompts()))
    prompts.write_text("".join(json.dumps({"id": p.id, "prompt_ids": p.ids}) + "\n" for p in _prompts(MID)))
    base = ["serve-check", str(trained), "--target", str(tiny_llama_dir), "--dataset", str(prompts)]
    base += ["--prompts", "4", "--max-new-tokens", str(N), "--quiet"]
    with FakeEngine(target, drafter, protocol="llama.cpp") as srv:
        assert main([*base, "--server", srv.url]) == 0
    assert "no cause found" in capsys.readouterr().out
    with FakeEngine(target, drafter, protocol="openai", layer_map={i: i + 2 for i in range(1, 6)}) as srv:
        assert main([*base, "--server", srv.url, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert [f["cause"] for f in out["findings"]] == ["config"] and out["agrees"] is False
    from dflashkit.export.llama_server import free_port

    rc = main([*base, "--server", f"http://127.0.0.1:{free_port()}"])
    assert "no server answers" in _one_line_error(capsys, rc)


def test_an_off_by_one_layer_tap_is_named_when_it_reproduces_the_engine_exactly():
    """The diagnosis on evidence made by hand: engine counts that the drafter reading each layer one later gives
    exactly (and the trained layers do not) name that shift; counts no shift explains stay a generic config cause;
    a long-only split with one short exact prompt is not called a window."""
    from dflashkit.export.serve_check import PromptCounts
    from dflashkit.export.served import ServedPrompt
    from dflashkit.export.served_diagnosis import Evidence, diagnose

    def prompt(i, engine, ours, n=10):
        return ServedPrompt(
            f"p{i}", n, PromptCounts([], *engine), PromptCounts([], *ours), PromptCounts([], *ours), True
        )

    prompts = [prompt(0, (5, 6, [3, 2, 1]), (5, 7, [3, 2, 2])), prompt(1, (4, 3, [2, 1, 0]), (4, 3, [2, 1, 0]))]
    trained = {"target_layer_ids": [1, 3], "block_size": 4}
    ev = Evidence("openai", 4, 3, trained, None, prompts, [], None)
    ev.shifted_layers = {1: [p.engine for p in prompts], -1: [p.teacher_forced for p in prompts]}
    (f,) = diagnose(ev)
    assert f.cause == "config" and "[2, 4] instead of the trained [1, 3]" in f.line and "one later" in f.line
    ev.shifted_layers = {}
    (f,) = diagnose(ev)
    assert f.cause == "config" and "another drafter" in f.line
    ev.prompts = [
        prompt(0, (4, 3, [2, 1, 0]), (4, 3, [2, 1, 0]), 10),
        prompt(1, (5, 6, [3, 2, 1]), (5, 7, [3, 2, 2]), 12),
    ]
    assert [f.cause for f in diagnose(ev)] == ["config"]  # one exact short prompt: no window claimed
    ev.prompts.append(prompt(2, (4, 3, [2, 1, 0]), (4, 3, [2, 1, 0]), 11))
    ev.prompts[1].prompt_tokens = 40
    assert [f.cause for f in diagnose(ev)] == ["length"]
