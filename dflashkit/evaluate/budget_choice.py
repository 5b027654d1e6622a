"""A DDTree budget chosen by measurement on the machine at hand: τ per budget × the measured round time.

    choice = choose_tree_budget(target, drafter, prompts, max_new_tokens=96, stop_token_ids=stops)
    choice.budget    # the candidate with the most committed tokens per second
    choice.rows      # per candidate: budget, τ, round ms, tokens/s (kept in results.json)

A budget B buys τ with verify width: a round verifies 1 + B rows. What an extra row costs is a property of the
machine, not of the drafter: on a GPU, or a CPU whose few-row products cost about one row, a wide tree is nearly
free; on a CPU where every extra row adds a noticeable share of a one-row pass, a small tree wins (docs/studies.md,
"DDTree budget on a CPU"). So the budget is chosen per machine and drafter, never fixed from one machine:

  τ(B)       teacher-forced replay (`simulate.replay`) of the target's greedy transcripts of `prompts`: every
             candidate on the same rounds, exactly what greedy decoding accepts (no noise from timing);
  round(B)   real `decode.generate(method="tree")` runs of every candidate on the prompt with the longest
             transcript, interleaved (A B C … C B A …) after each candidate's product trials have settled
             (warm_up.settle); a run's round time is its wall minus prefill over its rounds, the median over repeats;
  choice     tokens/s = τ(B) / round(B); the smallest budget within TIE of the fastest wins (a larger tree that is
             not faster beyond the timing noise only adds work).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dflashkit.decode.generate import DecodeSettings, GenerationResult, generate
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import DataError
from dflashkit.evaluate.simulate import replay
from dflashkit.evaluate.stats import Method, Prompt, verify_width
from dflashkit.evaluate.transcripts import Transcript, transcript_of
from dflashkit.evaluate.warm_up import settle
from dflashkit.target.devices import synchronize
from dflashkit.target.model import Target

BUDGET_STEPS = (1, 2, 3, 4, 6, 8, 12, 16)  # candidate budgets, cut to what the block can use (candidate_budgets)
TIE = 0.02  # a larger budget must be this much faster (tokens/s) to be chosen over a smaller one
CALIBRATION_PROMPTS = 2  # prompts whose transcripts give τ(B)
CALIBRATION_TOKENS = 64  # … each at most this long (the evaluation's max_new_tokens if smaller)
TIMED_TOKENS = 24  # tokens per timed run
TIMED_REPEATS = 3  # timed runs per candidate (interleaved)


@dataclass
class BudgetChoice:
    """The chosen budget and what it was chosen from."""

    budget: int
    rows: list[dict[str, float]]  # per candidate: budget, tau, round_ms, tokens_per_s (sorted by budget)
    prompts: list[str] = field(default_factory=list)  # the calibration prompts' ids
    rounds: int = 0  # replayed rounds per candidate, summed over the prompts (of the chosen budget)

    def describe(self) -> str:
        """'budget 3 (tokens/s by budget: 1: 12.6, 2: 10.7, 3: 13.2, …)'."""
        rates = ", ".join(f"{r['budget']}: {r['tokens_per_s']:.1f}" for r in self.rows)
        return f"budget {self.budget} (tokens/s by budget: {rates})"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BudgetChoice:
        return cls(int(d["budget"]), list(d["rows"]), list(d.get("prompts", [])), int(d.get("rounds", 0)))


def candidate_budgets(draft_slots: int) -> list[int]:
    """Budgets worth timing for a drafter with `draft_slots` drafted positions a round: up to 3 nodes a depth
    (a tree of depth d rarely uses more), at most 16, at least [1]."""
    limit = max(1, min(16, 3 * draft_slots))
    return [b for b in BUDGET_STEPS if b <= limit]


def best_budget(taus: dict[int, float], round_seconds: dict[int, float], tie: float = TIE) -> int:
    """The smallest budget whose tokens/s (τ / round time) is within `tie` of the fastest candidate's."""
    if not taus or set(taus) != set(round_seconds):
        raise ValueError(f"τ and round times must cover the same budgets: {sorted(taus)} vs {sorted(round_seconds)}")
    rate = {b: taus[b] / round_seconds[b] for b in taus}
    fastest = max(rate.values())
    return min(b for b in rate if rate[b] >= fastest * (1.0 - tie))


def round_times(
    run: Callable[[int, int], tuple[GenerationResult, float]],
    budgets: Sequence[int],
    *,
    repeats: int = TIMED_REPEATS,
    n_tokens: int = TIMED_TOKENS,
) -> dict[int, float]:
    """Median seconds per round of `run(budget, n_tokens)` → (result, wall seconds), the budgets interleaved
    forwards and backwards (ABC CBA ABC …) so a drift of the machine's speed reaches every candidate alike."""
    samples: dict[int, list[float]] = {b: [] for b in budgets}
    for r in range(repeats):
        for b in budgets if r % 2 == 0 else list(reversed(budgets)):
            res, wall = run(b, n_tokens)
            if res.rounds:
                samples[b].append(max(0.0, wall - res.timings.get("prefill", 0.0)) / res.rounds)
    missing = [b for b, s in samples.items() if not s]
    if missing:
        raise DataError(f"budget choice: the timed runs of budgets {missing} made no speculative round")
    return {b: statistics.median(s) for b, s in samples.items()}


def replayed_taus(
    drafter: DFlashDrafter,
    transcripts: Sequence[Transcript],
    budgets: Sequence[int],
    *,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    max_new_tokens: int,
    block_size: int | None = None,
    tree_top_k: int | None = None,
) -> tuple[dict[int, float], dict[int, int]]:
    """τ (tokens per round, micro over the transcripts) and rounds of DDTree-B for each budget, teacher-forced."""
    taus, rounds = {}, {}
    for b in budgets:
        lengths = [
            L
            for tr in transcripts
            for L in replay(
                drafter,
                tr,
                embed_weight=embed_weight,
                lm_head_weight=lm_head_weight,
                max_new_tokens=max_new_tokens,
                method=Method(f"ddtree:{b}", "tree", b),
                block_size=block_size,
                tree_top_k=tree_top_k,
            )
        ]
        rounds[b] = len(lengths)
        taus[b] = sum(lengths) / len(lengths) if lengths else 1.0
    return taus, rounds


@torch.no_grad()
def choose_tree_budget(
    target: Target,
    drafter: DFlashDrafter,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int,
    block_size: int | None = None,
    tree_top_k: int | None = None,
    stop_token_ids: Sequence[int] = (),
    budgets: Sequence[int] | None = None,
    repeats: int = TIMED_REPEATS,
    progress: bool = False,
) -> BudgetChoice:
    """The DDTree budget with the most tokens/s for `drafter` on this machine (see the module docstring).
    `prompts`: calibration prompts (the first CALIBRATION_PROMPTS are used)."""
    from tqdm import tqdm

    prompts = list(prompts)[:CALIBRATION_PROMPTS]
    if not prompts:
        raise DataError("budget choice: no calibration prompts")
    drafter.eval()
    slots = verify_width(drafter, block_size) - drafter.first_draft_slot()
    cands = sorted({int(b) for b in budgets}) if budgets else candidate_budgets(slots)
    n_new = min(max_new_tokens, CALIBRATION_TOKENS)
    layers = drafter.config.target_layer_ids
    # steps: a transcript per prompt, then per candidate its replay, its untimed runs and its timed runs
    bar = tqdm(total=len(prompts) + len(cands) * (2 + repeats), desc="ddtree:auto", unit="step", disable=not progress)
    transcripts = []
    for p in prompts:
        transcripts.append(transcript_of(target, p, layers, max_new_tokens=n_new, stop_token_ids=stop_token_ids))
        bar.update()
    dev = drafter.device
    taus, rounds = replayed_taus(
        drafter,
        transcripts,
        cands,
        embed_weight=target.embed_weight.to(dev),
        lm_head_weight=target.lm_head_weight.to(dev),
        max_new_tokens=n_new,
        block_size=block_size,
        tree_top_k=tree_top_k,
    )
    bar.update(len(cands))
    longest = max(range(len(prompts)), key=lambda i: len(transcripts[i].ids) - transcripts[i].prompt_len)
    timed = prompts[longest]
    if len(transcripts[longest].ids) - transcripts[longest].prompt_len < 2:  # no speculative round to time
        raise DataError(
            f"budget choice: the target answers calibration prompts {[p.id for p in prompts]} with at most one "
            f"token before a stop token; give calibration prompts with longer answers"
        )

    def run(budget: int, n: int) -> tuple[GenerationResult, float]:
        synchronize(target.device)
        t0 = time.perf_counter()
        res = generate(
            target,
            timed.ids,
            drafter=drafter,
            settings=DecodeSettings(
                method="tree",
                max_new_tokens=n,
                block_size=block_size,
                tree_budget=budget,
                tree_top_k=tree_top_k,
                stop_token_ids=stop_token_ids,
            ),
        )
        synchronize(target.device)
        return res, time.perf_counter() - t0

    n_timed = min(TIMED_TOKENS, max_new_tokens)
    for b in cands:  # untimed: one-off costs, then the product trials of the widths each budget verifies
        run(b, min(4, n_timed))
        settle(lambda n, b=b: run(b, n), n_timed, target.device)
        bar.update()

    def counted(budget: int, n: int) -> tuple[GenerationResult, float]:
        bar.update()
        return run(budget, n)

    seconds = round_times(counted, cands, repeats=repeats, n_tokens=n_timed)
    bar.close()
    chosen = best_budget(taus, seconds)
    rows = [
        {
            "budget": b,
            "tau": round(taus[b], 4),
            "round_ms": round(1000 * seconds[b], 3),
            "tokens_per_s": round(taus[b] / seconds[b], 3),
        }
        for b in cands
    ]
    return BudgetChoice(chosen, rows, [p.id for p in prompts], rounds[chosen])


__all__ = [
    "BudgetChoice",
    "best_budget",
    "candidate_budgets",
    "choose_tree_budget",
    "replayed_taus",
    "round_times",
]
