"""Evaluation: real speculative decoding of many drafters × methods against the AR baseline, on the same prompts.

    prompts, skipped = load_prompts(target, "mtbench", limit=20, max_new_tokens=256)
    settings = EvalSettings(methods=["ar", "chain", "ddtree:8"], max_new_tokens=256)
    results = evaluate(target, {"ours": drafter}, prompts, out_dir="runs/eval", settings=settings)

Per prompt: the AR baseline runs once (drafter-independent) through the same `decode.generate(method="ar")`, then
every (drafter, method). At temperature 0 each output must equal the AR output; a divergence is triaged
(`triage.py`: numerical near-tie or bug). Each finished prompt is appended to `out_dir/progress.jsonl` (one JSON
line) and skipped when the run is resumed with the same settings; `out_dir/results.json` (the source of truth for
reports; statistics from `aggregate.py`) is rewritten at the end. A resumed run aggregates timings measured in
different runs; rerun with resume=False for clean timings.

`ddtree:auto` runs DDTree with the budget that gives each drafter the most tokens/s on this machine, chosen before
anything is timed (`budget_choice.py`: replayed τ per budget × measured round times, on `budget_prompts` — by
default the first two prompts of the evaluation); the choice is kept in `out_dir/budget_choice.json` (a resumed run
keeps it) and in results.json next to the method's statistics. Each ddtree:auto run records its budget in
progress.jsonl; a resumed run whose choice differs (measured again after damage) runs those prompts again.

`compile` says whether the target's decoder layers run through torch.compile while decoding (`decode_compile.py`:
`auto` is timed in the warm-up where the planned work can repay the compile, never inside a timed prompt); results.json
records the choice and why (`decode_compile`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflashkit.cpu_products import stock_products
from dflashkit.cpu_products.machine import describe_machine
from dflashkit.data.conversations import default_stop_token_ids
from dflashkit.decode.generate import DecodeSettings, GenerationResult, generate
from dflashkit.decode.hybrid_tree import resolve_mode
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import ConfigError, DataError
from dflashkit.evaluate.aggregate import ar_stats, drafted_totals, method_stats, run_record
from dflashkit.evaluate.budget_choice import BudgetChoice, choose_tree_budget
from dflashkit.evaluate.decode_compile import DecodeCompile, start_choice
from dflashkit.evaluate.file_schemas import budget_choice_problem, progress_problem
from dflashkit.evaluate.groups import PromptGroups, with_groups
from dflashkit.evaluate.stats import (
    Method,
    Prompt,
    context_notes,
    drafter_fingerprint,
    drafter_info,
    parse_methods,
    prompt_sha,
    target_info,
    verify_width,
)
from dflashkit.evaluate.triage import default_triage_threshold, triage_divergence
from dflashkit.evaluate.warm_up import SETTLE_TOKENS, settle
from dflashkit.io_utils import atomic_write_text
from dflashkit.output_dir import one_writer
from dflashkit.sampling import GREEDY, SamplingParams
from dflashkit.target.devices import synchronize
from dflashkit.target.model import Target, check_drafter_fits

PROGRESS, RESULTS, BUDGET_CHOICE = "progress.jsonl", "results.json", "budget_choice.json"
AR_METHOD = Method("ar", "ar")  # the baseline every prompt runs first


@dataclass(frozen=True)
class EvalSettings:
    """How `evaluate` decodes and times each prompt (the prompts, drafters and output directory are its arguments).

    methods: "ar", "chain", "ddtree:B", "ddtree:auto" (comma-separated or a list); AR runs for every prompt anyway.
    block_size / tree_top_k: None = each drafter's own / the tree budget. stop_token_ids: None = the target's
    end-of-turn tokens. triage_threshold: the top-2 margin below which a divergence is a numerical near-tie
    (None: by the target's dtype). warmup: untimed runs first (on CPU they also settle the product choices).
    hf_baseline: also time HF `generate` as a second AR baseline. length_buckets: prompt-token edges for the
    per-length statistics (`by_length`; None: none). thinking: the thinking mode the prompts were rendered in
    (recorded in the report's header). resume: continue progress.jsonl when its settings match. deadline: a
    `time.monotonic()` value; once it has passed, no further prompt is started (at least one is always evaluated)
    and the results cover the prompts done, in order — `dataset.time_boxed` then says how many of how many.
    A resumed run continues with the rest. compile: the target's decoder layers through torch.compile while
    decoding — "auto" (timed in the warm-up where the planned work repays it: decode_compile.py), "on", "off".
    """

    methods: str | Sequence[str] = ("ar", "chain", "ddtree:8")
    max_new_tokens: int = 128
    sampling: SamplingParams = GREEDY
    block_size: int | None = None
    tree_top_k: int | None = None
    stop_token_ids: Sequence[int] | None = None
    triage_threshold: float | None = None
    seed: int = 0
    warmup: bool = True
    hf_baseline: bool = False
    length_buckets: Sequence[int] | None = None
    thinking: str | None = None
    resume: bool = True
    progress: bool = True
    deadline: float | None = None
    compile: str = "auto"


def evaluate(
    target: Target,
    drafters: dict[str, DFlashDrafter],
    prompts: Sequence[Prompt],
    *,
    out_dir: str | Path,
    settings: EvalSettings = EvalSettings(),
    dataset: str = "",
    skipped: dict[str, str] | None = None,
    drafter_sources: dict[str, str] | None = None,
    budget_prompts: Sequence[Prompt] | None = None,
    budget_choices: dict[str, BudgetChoice] | None = None,
) -> dict[str, Any]:
    """Run AR + every (drafter, method) on `prompts` as `settings` says; write progress.jsonl and results.json;
    return results.

    budget_prompts: the calibration prompts of `ddtree:auto` (default: the first two of `prompts`);
    budget_choices: drafter name → a choice already made (e.g. by the quickstart for several datasets), not measured.
    """
    from tqdm import tqdm

    es = settings

    all_methods = parse_methods(es.methods)
    prompts = list(prompts)
    stops = sorted(
        {int(t) for t in (default_stop_token_ids(target) if es.stop_token_ids is None else es.stop_token_ids)}
    )
    ev = _Evaluation(
        target=target,
        drafters=drafters,
        spec=[m for m in all_methods if m.kind != "ar"],
        sampling=es.sampling,
        max_new_tokens=es.max_new_tokens,
        block_size=es.block_size,
        tree_top_k=es.tree_top_k,
        stops=stops,
        threshold=default_triage_threshold(target.dtype) if es.triage_threshold is None else float(es.triage_threshold),
        hf_baseline=es.hf_baseline,
    )
    _check_arguments(ev, prompts)
    recorded = {
        "methods": [m.name for m in all_methods],
        "max_new_tokens": int(es.max_new_tokens),
        "sampling": {"temperature": es.sampling.temperature, "top_p": es.sampling.top_p, "top_k": es.sampling.top_k},
        "block_size": es.block_size,
        "tree_top_k": int(es.tree_top_k) if es.tree_top_k else None,
        "stop_token_ids": stops,
        "seed": int(es.seed),
        "triage_threshold": ev.threshold,
        "hf_baseline": bool(es.hf_baseline),
        **({"thinking": es.thinking} if es.thinking is not None else {}),  # older progress files: no such key
    }
    t_info = target_info(target)
    key = _settings_key(recorded, t_info, drafters)
    recorded["thinking"] = es.thinking  # None: the template's default (reports say so)
    recorded["length_buckets"] = sorted(int(e) for e in es.length_buckets) if es.length_buckets else None
    out = Path(out_dir)
    with one_writer(out, "dflashkit eval"):
        ppath = out / PROGRESS
        records = _resumed_records(ppath, key, prompts, es.resume)
        for d in drafters.values():
            d.eval()
        if any(m.is_auto for m in ev.spec):
            calibration = budget_prompts or prompts
            ev.auto, measured = _auto_budgets(ev, out, key, calibration, budget_choices or {}, es.resume, es.progress)
            records = _records_of_these_budgets(records, ev, measured, ppath, es.progress)
        todo = [p for p in prompts if p.id not in records]
        ev.decode = _decode_choice(ev, len(todo), es)
        if es.warmup and todo:  # first calls pay one-off allocation costs: keep them out of the timings
            ev.warm_up(todo[0], es.seed)
        elif ev.decode is not None:  # a compiled choice compiles before anything is timed, warm-up or not
            ev.decode.pay_compile(ev.round_of_every_method(todo[0], es.seed))
        index = {p.id: i for i, p in enumerate(prompts)}
        bar = tqdm(todo, desc="evaluate", unit="prompt", disable=not es.progress or not todo)
        with open(ppath, "a", encoding="utf-8") as f:
            for p in bar:
                s = None if es.sampling.greedy else es.seed + index[p.id]
                rec = {"key": key, "id": p.id, "prompt_sha": prompt_sha(p.ids), "prompt_len": len(p.ids)}
                rec.update(ev.prompt_record_alike(p, s))
                f.write(json.dumps(rec) + "\n")
                f.flush()
                os.fsync(f.fileno())
                records[p.id] = rec
                if es.deadline is not None and time.monotonic() > es.deadline:
                    break
        bar.close()
        doc = ev.results_doc(prompts, records, recorded, t_info, dataset, skipped, drafter_sources)
        atomic_write_text(out / RESULTS, json.dumps(doc, indent=1) + "\n")
        return doc


@dataclass
class _Evaluation:
    """What every run of one evaluation shares: the target, the drafters and methods, the decoding settings."""

    target: Target
    drafters: dict[str, DFlashDrafter]
    spec: list[Method]  # the speculative methods (AR runs for every prompt anyway)
    sampling: SamplingParams
    max_new_tokens: int
    block_size: int | None
    tree_top_k: int | None
    stops: list[int]
    threshold: float
    hf_baseline: bool
    auto: dict[str, BudgetChoice] = field(default_factory=dict)  # drafter name → the budget of ddtree:auto
    decode: DecodeCompile | None = None  # the target's layers compiled or not (None: eager, no choice made)

    def method_for(self, name: str, m: Method) -> Method:
        """`m` as drafter `name` runs it: ddtree:auto with that drafter's chosen budget."""
        return m.with_budget(self.auto[name].budget) if m.is_auto else m

    def run(
        self, prompt: Prompt, drafter: DFlashDrafter | None, method: Method, max_new_tokens: int, seed: int | None
    ) -> tuple[GenerationResult, float]:
        """One `generate` call, timed (CUDA synchronised before and after), its layers compiled or not as the compile
        choice says (a compiled run that fails runs again eagerly: the time is the eager run's)."""
        if self.decode is None:
            return self._run(prompt, drafter, method, max_new_tokens, seed, compiled=False)
        return self.decode.run(lambda compiled: self._run(prompt, drafter, method, max_new_tokens, seed, compiled))

    def _run(
        self,
        prompt: Prompt,
        drafter: DFlashDrafter | None,
        method: Method,
        max_new_tokens: int,
        seed: int | None,
        compiled: bool,
    ) -> tuple[GenerationResult, float]:
        synchronize(self.target.device)
        t0 = time.perf_counter()
        try:
            res = generate(
                self.target,
                prompt.ids,
                drafter=drafter,
                settings=DecodeSettings(
                    method=method.kind,
                    max_new_tokens=max_new_tokens,
                    block_size=self.block_size,
                    tree_budget=method.budget or 16,
                    tree_top_k=self.tree_top_k,
                    sampling=self.sampling,
                    stop_token_ids=self.stops,
                    seed=seed,
                ),
            )
        except ValueError as e:  # e.g. a prompt too long for the context window (load_prompts skips those)
            if compiled:  # a compiled run's failure is the compile choice's to handle (it reruns the run eagerly)
                raise
            raise DataError(f"prompt {prompt.id!r}: {e}") from None
        synchronize(self.target.device)
        return res, time.perf_counter() - t0

    def warm_up(self, prompt: Prompt, seed: int) -> None:
        """Untimed runs of every method before anything is timed: a few tokens each pay the one-off allocation costs;
        then, on CPU, runs until the products of the method's widths are settled (warm_up.py); then the compile
        choice's trial and compile, in rounds of every method (decode_compile.py)."""
        runs = self._every_run()
        for d, m in runs:
            self._run(prompt, d, m, min(4, self.max_new_tokens), seed, compiled=False)
        last: dict[int, tuple[float, int]] = {}  # each method's last settling run: (seconds, tokens)

        def settling(i: int, d: DFlashDrafter | None, m: Method, n: int) -> None:
            res, wall = self._run(prompt, d, m, n, seed, compiled=False)
            last[i] = (wall, len(res.tokens))

        for i, (d, m) in enumerate(runs):
            settle(lambda n, i=i, d=d, m=m: settling(i, d, m, n), self.max_new_tokens, self.target.device)
        decode = self.decode
        if decode is None or (decode.trial.settled and not decode.compiled):
            return
        if len(last) < len(runs) and not decode.trial.settled:  # no settling runs (products not measured): time one
            for i, (d, m) in enumerate(runs):
                settling(i, d, m, min(SETTLE_TOKENS, self.max_new_tokens))
        tokens = sum(t for _, t in last.values())
        rate = 1e3 * sum(s for s, _ in last.values()) / tokens if tokens else None  # eager s per 1,000 tokens
        decode.warm_up(self.round_of_every_method(prompt, seed), rate)

    def _every_run(self) -> list[tuple[DFlashDrafter | None, Method]]:
        """AR, then every (drafter, method) as it runs (ddtree:auto with its chosen budget)."""
        return [(None, AR_METHOD)] + [(d, self.method_for(n, m)) for n, d in self.drafters.items() for m in self.spec]

    def round_of_every_method(self, prompt: Prompt, seed: int | None) -> Callable[[bool], int]:
        """`round(compiled)`: AR and every (drafter, method) once for a few tokens, untimed → tokens generated (the
        compile choice's warm-up rounds)."""
        runs = self._every_run()
        n = min(SETTLE_TOKENS, self.max_new_tokens)

        def one_round(compiled: bool) -> int:
            return sum(len(self._run(prompt, d, m, n, seed, compiled)[0].tokens) for d, m in runs)

        return one_round

    def prompt_record_alike(self, p: Prompt, seed: int | None) -> dict[str, Any]:
        """`prompt_record`, every run of it compiled or every run eager: a compiled run that failed mid-prompt settled
        the choice on eager, so the prompt runs again (AR and the methods alike); the record says which."""
        decode = self.decode
        compiled = decode is not None and decode.compiled
        rec = self.prompt_record(p, seed)
        if compiled and not decode.compiled:
            rec = self.prompt_record(p, seed)
            compiled = False
        return {**rec, "compiled": compiled}

    def prompt_record(self, p: Prompt, seed: int | None) -> dict[str, Any]:
        """One prompt: AR once, HF generate when asked, then every (drafter, method), each triaged against AR at
        temperature 0."""
        ar_res, ar_wall = self.run(p, None, AR_METHOD, self.max_new_tokens, seed)
        rec: dict[str, Any] = {"ar": run_record(ar_res, ar_wall), "runs": {}}
        if self.hf_baseline:
            hf_tokens, hf_wall = _hf_generate(self.target, p, self.max_new_tokens, self.stops)
            rec["hf"] = {"n_tokens": len(hf_tokens), "wall_s": hf_wall, "equal_to_ar": hf_tokens == ar_res.tokens}
        for name, d in self.drafters.items():
            rec["runs"][name] = {}
            for m in self.spec:
                res, wall = self.run(p, d, self.method_for(name, m), self.max_new_tokens, seed)
                r = run_record(res, wall)
                if m.is_auto:
                    r["budget"] = self.auto[name].budget  # a resumed run re-runs the prompt if the choice changed
                if self.sampling.greedy:
                    r["divergence"] = triage_divergence(
                        self.target, p.ids, ar_res.tokens, res.tokens, threshold=self.threshold
                    )
                    r["greedy_equal"] = r["divergence"] is None
                rec["runs"][name][m.name] = r
        return rec

    def results_doc(
        self,
        prompts: list[Prompt],
        records: dict[str, dict[str, Any]],
        settings: dict[str, Any],
        t_info: dict[str, Any],
        dataset: str,
        skipped: dict[str, str] | None,
        drafter_sources: dict[str, str] | None,
    ) -> dict[str, Any]:
        """results.json: AR and per-(drafter, method) statistics over the prompts done (all, unless time-boxed)."""
        requested = len(prompts)
        prompts = [p for p in prompts if p.id in records]  # all of them unless the deadline cut the run short
        chosen = [records[p.id] for p in prompts]
        groups = PromptGroups.of(
            ((p.id, _category(p, dataset), len(p.ids)) for p in prompts), settings["length_buckets"]
        )
        ar = ar_stats([r["ar"] for r in chosen], [r["hf"] for r in chosen if "hf" in r])
        results: dict[str, dict[str, Any]] = {}
        for name, d in self.drafters.items():
            bs = verify_width(d, self.block_size)
            results[name] = {}
            for m in self.spec:
                method = self.method_for(name, m)
                runs = [dict(r["runs"][name][m.name], prompt_id=r["id"]) for r in chosen]
                st = method_stats(runs, method, bs, ar, self.sampling.greedy)
                lengths = {r["prompt_id"]: r["acceptance_lengths"] for r in runs}
                counts = drafted_totals(runs)
                drafted = None if counts is None else dict(zip(lengths, counts, strict=True))
                st = with_groups(st, lengths, groups, method.max_length(bs), drafted)
                if m.is_auto:
                    st |= {"budget": self.auto[name].budget, "budget_choice": self.auto[name].as_dict()}
                results[name][m.name] = st
        notes = context_notes(self.drafters, max(len(p.ids) for p in prompts) + self.max_new_tokens)
        if self.target.is_hybrid and any(m.kind == "tree" for m in self.spec):
            notes.append(
                f"hybrid target: DDTree verifies the whole tree exactly (Gated DeltaNet states followed per "
                f"node, '{resolve_mode(self.target, 'auto')}' mode)"
            )
        time_boxed = (
            {"time_boxed": {"requested": requested, "evaluated": len(prompts)}} if len(prompts) < requested else {}
        )
        return {
            "schema": "dflashkit.eval/1",
            "kind": "evaluate",
            "target": t_info,
            "dataset": {
                "name": str(dataset),
                "n_prompts": len(prompts),
                "prompt_ids": [p.id for p in prompts],
                "categories": {p.id: _category(p, dataset) for p in prompts},
                "prompt_lengths": {p.id: len(p.ids) for p in prompts},
                "skipped": dict(skipped or {}),
                **time_boxed,
            },
            "settings": settings,
            "drafters": {
                n: drafter_info(d, source=(drafter_sources or {}).get(n), block_size=self.block_size)
                for n, d in self.drafters.items()
            },
            "ar": ar,
            "results": results,
            "notes": notes,
            "machine": describe_machine(),  # what the timings ran on (CPU, BLAS, torch, threads)
            **(
                {"decode_compile": self.decode.as_dict(sum(bool(r.get("compiled")) for r in chosen))}
                if self.decode is not None
                else {}
            ),
        }


def _decode_choice(ev: _Evaluation, prompts_left: int, es: EvalSettings) -> DecodeCompile | None:
    """The compile choice of this evaluation's decoding (None: nothing left to run). Its work left is every planned
    token (each prompt's AR and (drafter, method) runs at max_new_tokens) at the rate timed, capped by the deadline."""
    if not prompts_left:
        return None
    tokens = prompts_left * len(ev._every_run()) * ev.max_new_tokens

    def seconds_left(rate_per_1k: float) -> float:
        work = tokens / 1000 * rate_per_1k
        return work if es.deadline is None else max(0.0, min(work, es.deadline - time.monotonic()))

    return start_choice(ev.target, _widths(ev), es.compile, seconds_left, warm_up=es.warmup)


def _widths(ev: _Evaluation) -> list[str]:
    """What the runs verify, by method: "ar", "chain:<verify width>", "ddtree:<budget>" (ddtree:auto's chosen one)."""
    return [
        "ar" if d is None else f"ddtree:{m.budget}" if m.kind == "tree" else f"chain:{verify_width(d, ev.block_size)}"
        for d, m in ev._every_run()
    ]


def _category(prompt: Prompt, dataset: str) -> str:
    """A prompt's category; prompts made without one take the dataset's name (a file's: its stem)."""
    return prompt.category or (Path(dataset).stem if dataset else "all")


def _auto_budgets(
    ev: _Evaluation,
    out: Path,
    key: str,
    calibration: Sequence[Prompt],
    given: dict[str, BudgetChoice],
    resume: bool,
    progress: bool,
) -> tuple[dict[str, BudgetChoice], set[str]]:
    """The ddtree:auto budget of every drafter: given, kept from an earlier run with the same settings
    (budget_choice.json, when resuming), or measured now (and kept); and the names of the drafters measured now. A
    given budget that differs from the one the kept records were evaluated with is refused."""
    path = out / BUDGET_CHOICE
    kept: dict[str, Any] = {}
    if resume and path.is_file():
        try:
            doc = json.loads(path.read_text())
            kept = doc["drafters"] if doc.get("key") == key else {}
            kept = {name: e for name, e in kept.items() if budget_choice_problem(e) is None}  # damaged: measured again
        except (ValueError, KeyError, TypeError, AttributeError):
            kept = {}  # damaged: measured again
    choices, measured = {}, set()
    for name, d in ev.drafters.items():
        if name in given:
            if name in kept and int(kept[name]["budget"]) != given[name].budget and (out / PROGRESS).is_file():
                raise DataError(
                    f"{out / PROGRESS}: drafter {name!r} was evaluated with ddtree:auto budget {kept[name]['budget']}, "
                    f"this run gives {given[name].budget}; use another output directory or disable resume"
                )
            choices[name] = given[name]
        elif name in kept:
            choices[name] = BudgetChoice.from_dict(kept[name])
        else:
            choices[name] = choose_tree_budget(
                ev.target,
                d,
                calibration,
                max_new_tokens=ev.max_new_tokens,
                block_size=ev.block_size,
                tree_top_k=ev.tree_top_k,
                stop_token_ids=ev.stops,
                progress=progress,
            )
            measured.add(name)
        if progress:
            print(f"ddtree:auto for {name!r}: {choices[name].describe()}", flush=True)
    doc = {"key": key, "drafters": {n: c.as_dict() for n, c in choices.items()}}
    atomic_write_text(path, json.dumps(doc, indent=1) + "\n")
    return choices, measured


def _records_of_these_budgets(
    records: dict[str, dict[str, Any]], ev: _Evaluation, measured: set[str], ppath: Path, progress: bool
) -> dict[str, dict[str, Any]]:
    """The resumed records whose ddtree:auto runs used the budgets chosen now. A record whose run names another
    budget — or names none (written before runs kept it) while that drafter's budget was measured anew, e.g. after a
    damaged budget_choice.json — is left out: its prompt runs again, so no statistic mixes two budgets."""
    auto = [m.name for m in ev.spec if m.is_auto]

    def ran_with_the_choice(name: str, run: dict[str, Any]) -> bool:
        recorded = run.get("budget")
        return name not in measured if recorded is None else recorded == ev.auto[name].budget

    kept, again = {}, 0
    for pid, rec in records.items():
        runs = [(name, rec["runs"].get(name, {}).get(m)) for name in ev.auto for m in auto]
        if all(run is None or ran_with_the_choice(name, run) for name, run in runs):
            kept[pid] = rec
        else:
            again += 1
    if again and progress:
        print(f"{ppath}: {again} prompt(s) were evaluated with another ddtree:auto budget; they run again", flush=True)
    return kept


def _check_arguments(ev: _Evaluation, prompts: list[Prompt]) -> None:
    if ev.spec and not ev.drafters:
        raise ConfigError(f"methods {[m.name for m in ev.spec]} need at least one drafter")
    for name, d in ev.drafters.items():
        check_drafter_fits(d.config, ev.target, source=f"drafter {name!r}")
    if ev.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens = {ev.max_new_tokens}: expected an integer ≥ 1")
    if ev.block_size is not None and ev.block_size < 2:
        raise ConfigError(f"block_size = {ev.block_size}: expected an integer ≥ 2 (or None: each drafter's own)")
    if not math.isfinite(ev.threshold) or ev.threshold < 0:
        raise ConfigError(f"triage_threshold = {ev.threshold}: expected a finite number ≥ 0")
    if not prompts:
        raise DataError("no prompts to evaluate")
    if len({p.id for p in prompts}) != len(prompts):
        raise DataError("prompt ids must be unique")


def _settings_key(settings: dict[str, Any], t_info: dict[str, Any], drafters: dict[str, DFlashDrafter]) -> str:
    """What a resumed run must share with the records it continues: settings, target and drafter fingerprints."""
    blob = {
        "settings": settings,
        "target": t_info["fingerprint"],
        "drafters": {n: drafter_fingerprint(d) for n, d in sorted(drafters.items())},
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


@torch.no_grad()
def _hf_generate(target: Target, prompt: Prompt, max_new_tokens: int, stops: list[int]) -> tuple[list[int], float]:
    from transformers import GenerationConfig

    ids = torch.tensor([prompt.ids], device=target.device)
    synchronize(target.device)
    t0 = time.perf_counter()
    # An explicit config: with no stop ids HF must not fall back to the model's own eos (the AR loop does not stop).
    cfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=list(stops) or None,
        pad_token_id=stops[0] if stops else 0,
    )
    with stock_products():  # HF as users run it: stock F.linear products (dflashkit.cpu_products.products)
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    synchronize(target.device)
    return out[0, ids.shape[1] :].tolist(), time.perf_counter() - t0


def read_progress(path: Path, *, repair: bool = False) -> list[dict[str, Any]]:
    """Records of progress.jsonl. A last line without its newline (a kill mid-write) is ignored, and cut from the
    file when `repair` (so that appends start on a fresh line); a damaged complete line raises DataError."""
    if not path.exists():
        return []
    data = path.read_bytes()
    complete, sep, tail = data.rpartition(b"\n")
    out = []
    for lineno, line in enumerate(complete.split(b"\n") if sep else [], start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not {"key", "id", "prompt_sha", "ar", "runs"} <= set(rec):
                raise ValueError("expected an object with key, id, prompt_sha, ar and runs")
            why = progress_problem(rec)
            if why:
                raise ValueError(why)
        except ValueError as e:
            raise DataError(
                f"{path}:{lineno}: damaged progress record ({e}); delete that line (its prompt runs again) or the file"
            ) from None
        out.append(rec)
    if repair and tail:
        with open(path, "r+b") as f:
            f.truncate(len(data) - len(tail))
    return out


def _resumed_records(ppath: Path, key: str, prompts: list[Prompt], resume: bool) -> dict[str, dict[str, Any]]:
    """Prompt id → record of progress.jsonl from an earlier run with the same settings (`key`); refuses a file
    written with other settings or other prompt token ids. Without `resume` the file is removed first."""
    if not resume and ppath.exists():
        ppath.unlink()
    records = {}
    for k, rec in enumerate(read_progress(ppath, repair=True), start=1):
        if rec.get("key") != key:
            raise DataError(
                f"{ppath}:{k}: written by a run with other settings, target or drafters; use another "
                f"output directory, delete the file, or disable resume"
            )
        records[rec["id"]] = rec
    for p in prompts:
        done = records.get(p.id)
        if done is not None and done["prompt_sha"] != prompt_sha(p.ids):
            raise DataError(
                f"{ppath}: prompt {p.id!r} was evaluated with different token ids; use another output "
                f"directory or disable resume"
            )
    return records


__all__ = ["AR_METHOD", "BUDGET_CHOICE", "PROGRESS", "RESULTS", "evaluate", "read_progress"]
