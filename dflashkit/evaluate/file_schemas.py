"""The files an evaluation reads back, declared: results.json (`report`), progress.jsonl records and
budget_choice.json (a resumed `eval`), a transcript cache's manifest.json (`simulate`).

    check_results(doc, "runs/eval/results.json")  # DataError: "…: results.d.chain.tau_micro = "x": expected a number"
    progress_problem(record)                      # 'runs.d.chain.n_tokens = "many": expected an integer' or None
    budget_choice_problem(entry)                  # a kept ddtree:auto choice that cannot be reused (then: measured)
    transcripts_problem(manifest)                 # 'prompts[3].file = "../x": expected a file name …' or None

`dflashkit eval` and `dflashkit simulate` write these files; users also hand-edit results.json, merge several, or write
them from other tools, and a progress file can be damaged. Each field a reader uses is declared here (pydantic,
strict: a string is not a number, true is not a count; null where the report shows "—"); fields no reader uses may
hold anything. A file that does not fit stops with one line naming the file, the field's path in the JSON and what
was expected (`dflashkit.validation.json_problem`) — never a traceback from deep inside the table, plot or
statistics code.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from dflashkit.errors import DataError
from dflashkit.validation import JsonFields, json_problem, safetensors_name

# ---------------------------------------------------------------------------------------------- results.json
Number = float | None  # null: not measured (shown as "—")
Count = Annotated[float, Field(ge=0)]


class _Divergence(JsonFields):
    index: int
    ar_token: int
    spec_token: int
    margin: float
    verdict: str


class _BudgetRow(JsonFields):
    budget: int
    tau: float
    round_ms: float
    tokens_per_s: float


class _BudgetChoice(JsonFields):
    budget: int
    rows: list[_BudgetRow]
    prompts: list[str] | None = None


class _Prefill(JsonFields):
    prefill: Number = None


class _GroupStats(JsonFields):
    """One category's or length bucket's acceptance statistics (evaluate/groups.py)."""

    tau_micro: Number
    n_prompts: int | None = None
    rounds: int | None = None
    tau_macro: Number = None
    per_position_acceptance: list[Number] | None = None
    accepted_drafts: int | None = None
    drafted: int | None = None
    acceptance_rate: Number = None


class _Stats(JsonFields):
    tau_micro: Number  # null when no round was decoded
    histogram: list[Count]  # rounds with acceptance length L = 0, 1, 2, …
    rounds: int | None = None
    tau_macro: Number = None
    tok_s: Number = None
    speedup_vs_ar: Number = None
    predicted_speedup: Number = None
    efficiency: Number = None
    full_block_fraction: Number = None
    zero_accept_fraction: Number = None
    greedy_equal_fraction: Number = None
    round_s: Number = None
    survival: list[Number] | None = None
    per_position_acceptance: list[Number] | None = None
    timings_per_round_s: dict[str, Number] | None = None
    timings_s: _Prefill | None = None
    divergences: list[_Divergence] | None = None
    budget_choice: _BudgetChoice | None = None
    by_category: dict[str, _GroupStats] | None = None
    by_length: dict[str, _GroupStats] | None = None
    accepted_drafts: int | None = None
    drafted: int | None = None
    acceptance_rate: Number = None


class _AR(JsonFields):
    tok_s: Number = None
    t_step_s: Number = None
    timings_per_round_s: dict[str, Number] | None = None
    timings_s: _Prefill | None = None


class _Sampling(JsonFields):
    temperature: float | None = None


class _Settings(JsonFields):
    sampling: _Sampling | None = None
    thinking: str | None = None
    length_buckets: list[int] | None = None


class _Dataset(JsonFields):
    skipped: list[Any] | dict[str, Any] | None = None


class _DrafterInfo(JsonFields):
    parameters: int = 0


class _Machine(JsonFields):
    """What `eval` timed on (cpu_products/machine.py `describe_machine`); a model card prints it."""

    cpu: str | None = None
    flags: list[str] | None = None
    blas: str | None = None
    torch: str | None = None
    threads: int | None = None


class _Results(JsonFields):
    results: dict[str, dict[str, _Stats]]  # {drafter: {method: stats}}
    ar: _AR | None = None
    settings: _Settings | None = None
    dataset: _Dataset | None = None
    target: dict[str, Any] | None = None
    drafters: dict[str, _DrafterInfo] | None = None
    notes: list[Any] | None = None
    kind: str | None = None
    machine: _Machine | None = None


def check_results(doc: Any, path: str) -> None:
    """Raise DataError naming `path`, the first field of `doc` that the report cannot read, and what it expects."""
    why = json_problem(_Results, doc)
    if why:
        raise DataError(f"{path}: {why}")


# ---------------------------------------------------------------------------------------------- progress.jsonl
class _Run(JsonFields):
    """One prompt × method as `aggregate.run_record` keeps it (+ the greedy triage of a speculative method)."""

    n_tokens: Annotated[int, Field(ge=0)]
    acceptance_lengths: list[Annotated[int, Field(ge=1)]]  # tokens committed per round (the bonus included)
    drafted: Annotated[int, Field(ge=0)] | None = None  # draft tokens verified (absent in older records)
    wall_s: float
    timings: dict[str, float]
    divergence: _Divergence | None = None
    greedy_equal: bool | None = None
    budget: Annotated[int, Field(ge=1)] | None = None  # ddtree:auto's budget for this run


class _HFRun(JsonFields):
    n_tokens: Annotated[int, Field(ge=0)]
    wall_s: float
    equal_to_ar: bool


class _ProgressRecord(JsonFields):
    key: str
    id: str
    prompt_sha: str
    ar: _Run
    runs: dict[str, dict[str, _Run]]  # {drafter: {method: run}}
    hf: _HFRun | None = None


def progress_problem(record: Any) -> str | None:
    """Why one progress.jsonl record cannot be resumed from ("runs.d.chain.n_tokens = …: expected …"), or None."""
    return json_problem(_ProgressRecord, record)


def budget_choice_problem(entry: Any) -> str | None:
    """Why a drafter's entry of budget_choice.json cannot be reused (it is measured again then), or None."""
    return json_problem(_BudgetChoice, entry)


# ---------------------------------------------------------------------------------------------- transcript cache


class _Transcript(JsonFields):
    id: str
    file: safetensors_name("the cache directory", "pNNNNN.safetensors")
    prompt_len: Annotated[int, Field(ge=0)]
    num_tokens: Annotated[int, Field(ge=0)]
    prompt_sha: str
    stop_reason: str | None = None
    category: str | None = None


class _TranscriptTarget(JsonFields):
    hidden_size: Annotated[int, Field(ge=1)]
    fingerprint: str | None = None


class _Transcripts(JsonFields):
    target: _TranscriptTarget
    layer_ids: list[Annotated[int, Field(ge=0)]]
    max_new_tokens: Annotated[int, Field(ge=1)]
    stop_token_ids: list[int]
    prompts: list[_Transcript]


def transcripts_problem(manifest: Any) -> str | None:
    """Why a transcript cache's manifest.json cannot be read (the first wrong field by its path), or None."""
    return json_problem(_Transcripts, manifest)


__all__ = ["budget_choice_problem", "check_results", "progress_problem", "transcripts_problem"]
