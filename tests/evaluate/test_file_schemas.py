"""The files an evaluation reads back: a progress.jsonl record that a resumed `eval` cannot use is named (line and
field path), a torn last line is dropped, and records as `eval` writes them pass."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dflashkit.errors import DataError
from dflashkit.evaluate.aggregate import run_record
from dflashkit.evaluate.evaluate import read_progress
from dflashkit.evaluate.file_schemas import (
    budget_choice_problem,
    check_results,
    progress_problem,
    transcripts_problem,
)


def record(prompt_id: str = "p1") -> dict:
    """A progress record built by the code `eval` uses (`run_record` of a generation result)."""
    timings = {"prefill": 0.01, "draft": 0.02, "verify": 0.05, "commit": 0.001}

    def res(lengths):
        return SimpleNamespace(
            tokens=list(range(sum(lengths))),
            acceptance_lengths=lengths,
            drafted=[3] * len(lengths),
            timings=timings,
            stop_reason="max_new_tokens",
        )

    chain = run_record(res([3, 1, 2]), 0.2)
    chain.update(divergence=None, greedy_equal=True)
    return {
        "key": "k",
        "id": prompt_id,
        "prompt_sha": "s",
        "prompt_len": 5,
        "ar": run_record(res([1] * 6), 0.3),
        "runs": {"d": {"chain": chain}},
        "hf": {"n_tokens": 6, "wall_s": 0.31, "equal_to_ar": True},
    }


def test_records_as_eval_writes_them_pass():
    assert progress_problem(record()) is None


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r["runs"]["d"]["chain"].update(acceptance_lengths="x"), 'chain.acceptance_lengths = "x": expected'),
        (lambda r: r["ar"].update(n_tokens="many"), 'ar.n_tokens = "many": expected an integer'),
        (lambda r: r["runs"].update(d=3), "runs.d = 3: expected a mapping"),
        (lambda r: r["runs"]["d"]["chain"]["timings"].update(verify=None), "timings.verify = null: expected a number"),
        (lambda r: r["runs"]["d"]["chain"]["acceptance_lengths"].__setitem__(0, 0), "[0] = 0: expected a number ≥ 1"),
        (lambda r: r["hf"].pop("equal_to_ar"), "hf.equal_to_ar: missing (a required field)"),
    ],
)
def test_a_damaged_record_is_named_by_line_and_field(tmp_path, change, message):
    bad = record("p2")
    change(bad)
    path = tmp_path / "progress.jsonl"
    path.write_text(json.dumps(record()) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(DataError) as e:
        read_progress(path)
    assert str(e.value).startswith(f"{path}:2: damaged progress record (") and message in str(e.value)
    assert "delete that line (its prompt runs again) or the file" in str(e.value)


def test_a_torn_last_line_is_dropped_and_cut_when_repairing(tmp_path):
    path = tmp_path / "progress.jsonl"
    whole = json.dumps(record()) + "\n"
    path.write_text(whole + json.dumps(record("p2"))[:40])
    assert [r["id"] for r in read_progress(path)] == ["p1"]
    assert path.read_text() != whole  # reading alone leaves the file as it is
    assert [r["id"] for r in read_progress(path, repair=True)] == ["p1"]
    assert path.read_text() == whole  # appends start on a fresh line


def test_results_may_hold_null_where_nothing_was_measured():
    """τ is null when no round was decoded (every prompt ended at its first token): a results.json `eval` writes."""
    check_results({"results": {"d": {"chain": {"tau_micro": None, "histogram": [0, 0]}}}}, "r.json")
    with pytest.raises(DataError, match=r"^r.json: results.d.chain.tau_micro: missing \(a required field\)$"):
        check_results({"results": {"d": {"chain": {"histogram": [0, 0]}}}}, "r.json")


@pytest.fixture(scope="module")
def transcripts(tiny_llama_dir, tmp_path_factory):
    """A transcript cache as `simulate --cache` builds it: 2 prompts of the tiny Llama."""
    from dflashkit.evaluate.stats import Prompt
    from dflashkit.evaluate.transcripts import build_transcripts
    from dflashkit.target.model import Target

    out = tmp_path_factory.mktemp("transcripts")
    prompts = [Prompt("a", [5, 6, 7, 8]), Prompt("b", [9, 8, 7])]
    build_transcripts(Target.load(tiny_llama_dir), prompts, out, max_new_tokens=6, layer_ids=[1, 3], progress=False)
    return out


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda m: m["prompts"][1].update(file="../tokens.jsonl"),
            'prompts[1].file = "../tokens.jsonl": expected a file',
        ),
        (lambda m: m["prompts"][1].update(num_tokens="6"), 'prompts[1].num_tokens = "6": expected an integer'),
        (lambda m: m.update(layer_ids=["1"]), 'layer_ids[0] = "1": expected an integer'),
        (lambda m: m.update(max_new_tokens=None), "max_new_tokens = null: expected an integer"),
        (lambda m: m["target"].pop("hidden_size"), "target.hidden_size: missing (a required field)"),
    ],
)
def test_a_damaged_transcript_manifest_is_named_by_field(transcripts, tmp_path, change, message):
    from dflashkit.evaluate.transcripts import TranscriptCache

    manifest = json.loads((transcripts / "manifest.json").read_text())
    assert transcripts_problem(manifest) is None  # as build_transcripts writes it
    change(manifest)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError) as e:
        TranscriptCache(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'manifest.json'}: damaged transcript manifest (")
    assert message in str(e.value) and str(e.value).endswith(f"delete {tmp_path} to rebuild it")


def test_a_kept_budget_choice_is_reused_only_when_it_reads_as_one():
    from dflashkit.evaluate.budget_choice import BudgetChoice

    kept = BudgetChoice(3, [{"budget": 3, "tau": 1.4, "round_ms": 50.0, "tokens_per_s": 28.0}], ["p1"], 12).as_dict()
    assert budget_choice_problem(kept) is None
    assert budget_choice_problem(dict(kept, budget="x")) == 'budget = "x": expected an integer'
    assert budget_choice_problem(dict(kept, rows=[{"budget": 3}])).startswith("rows[0].tau: missing")
