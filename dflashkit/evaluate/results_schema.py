"""What a results.json must hold for `dflashkit report` to render it: every field the report reads, with its type.

    check_results(doc, "runs/eval/results.json")   # DataError: "…: results.d.chain.tau_micro = "x": expected a number"

`dflashkit eval` and `dflashkit simulate` write results.json; users also hand-edit them, merge them, or write them from
other tools. Each field the report reads is declared here (pydantic, strict: a string is not a number, true is not a
count; null where the report shows "—"); fields it does not read may hold anything. A file that does not fit stops
with one line naming the file, the field's path in the JSON and what was expected — never a traceback from deep
inside the table or plot code.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dflashkit.errors import DataError
from dflashkit.validation import show

Number = float | None  # null: not measured (shown as "—")
Count = Annotated[float, Field(ge=0)]


class _Read(BaseModel):
    """The fields the report reads; others are left alone. Fields without a default are required."""

    model_config = ConfigDict(extra="ignore", strict=True)


class _Divergence(_Read):
    index: int
    ar_token: int
    spec_token: int
    margin: float
    verdict: str


class _BudgetRow(_Read):
    budget: int
    tau: float
    round_ms: float
    tokens_per_s: float


class _BudgetChoice(_Read):
    budget: int
    rows: list[_BudgetRow]
    prompts: list[str] | None = None


class _Prefill(_Read):
    prefill: Number = None


class _Stats(_Read):
    tau_micro: float
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


class _AR(_Read):
    tok_s: Number = None
    t_step_s: Number = None
    timings_per_round_s: dict[str, Number] | None = None
    timings_s: _Prefill | None = None


class _Sampling(_Read):
    temperature: float | None = None


class _Settings(_Read):
    sampling: _Sampling | None = None


class _Dataset(_Read):
    skipped: list[Any] | dict[str, Any] | None = None


class _DrafterInfo(_Read):
    parameters: int = 0


class _Results(_Read):
    results: dict[str, dict[str, _Stats]]  # {drafter: {method: stats}}
    ar: _AR | None = None
    settings: _Settings | None = None
    dataset: _Dataset | None = None
    target: dict[str, Any] | None = None
    drafters: dict[str, _DrafterInfo] | None = None
    notes: list[Any] | None = None
    kind: str | None = None


_EXPECTED = {
    "float_type": "a number",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "greater_than_equal": "a count ≥ 0",
}


def check_results(doc: Any, path: str) -> None:
    """Raise DataError naming `path`, the first field of `doc` that the report cannot read, and what it expects."""
    try:
        _Results.model_validate(doc)
    except ValidationError as e:
        error = _first_meaningful(e.errors())
        expected = _EXPECTED.get(error["type"], error["msg"].removeprefix("Input should be "))
        if error["type"] == "missing":
            where, _ = _locate(doc, error["loc"][:-1])
            field = f"{where}.{error['loc'][-1]}" if where else str(error["loc"][-1])
            raise DataError(f"{path}: {field}: missing (a required field)") from None
        where, value = _locate(doc, error["loc"])
        raise DataError(f"{path}: {where or 'the file'} = {show(value)}: expected {expected}") from None


def _first_meaningful(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """A union's errors repeat the value once per member; the first error at the deepest place says the most."""
    return max(errors, key=lambda err: len(err["loc"]))


def _locate(doc: Any, loc: tuple[Any, ...]) -> tuple[str, Any]:
    """The dotted path of `loc` as far as it names keys and indices of `doc` (a union's member tags are not keys:
    dropped), and the value found there."""
    where, node = "", doc
    for key in loc:
        if isinstance(node, dict) and key in node:
            where += f".{key}" if where else str(key)
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            where += f"[{key}]"
        else:
            continue
        node = node[key]
    return where, node


__all__ = ["check_results"]
