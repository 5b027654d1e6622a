"""`dflashkit generate`, `eval`, `simulate` and `report`.

    dflashkit generate --drafter CKPT --prompt "…" [--method chain|tree|ar] [--max-new-tokens N]
                       [--temperature T --top-p P --top-k K] [--tree-budget B --tree-top-k K] [--target …]
    dflashkit eval --drafter NAME=CKPT [--drafter …] --dataset mtbench|humaneval|sharegpt-heldout|sharegpt|PATH
                   [--limit N] [--on-error stop|skip] [--methods ar,chain,ddtree:8,ddtree:auto]
                   [--budget-prompts DATASET] [--max-new-tokens N] [--temperatures 0,1] [--by-length [EDGES]]
                   [--compile auto|on|off] --out DIR [--target …]
    dflashkit simulate --drafter NAME=CKPT [--drafter …] --dataset … --cache DIR [--budgets 4,8,16]
                       [--by-length [EDGES]] --out DIR
    dflashkit report RESULTS.json [MORE.json …] [--out DIR]

Datasets: a bundled name or a JSONL file. Targets without a tokenizer take pre-tokenised prompts: JSONL lines
`{"id": "...", "prompt_ids": [3, 14, 15]}` (and `generate --prompt-ids 3,14,15`); a `category` field on either kind
of line groups the statistics. `long-context` builds prompts of several lengths for the target (data/long_context.py).
`eval` writes DIR/results.json (source of truth), DIR/progress.jsonl (per prompt; a rerun resumes), DIR/report.md
and the PNG plots; with --temperatures, one such directory per temperature and DIR/compare.md. `simulate` writes
the transcript cache (reused by later runs), then DIR/results.json + report. `eval --compile`: whether the target's
decoder layers run through torch.compile while decoding — auto (the default: timed in the warm-up where the planned
work repays the compile; DFLASHKIT_CHOICES=decode_compile=on|off|measure overrides;
dflashkit.evaluate.decode_compile), on, off.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dflashkit.cli import command, compile_arg, target_args
from dflashkit.decode.generate import DecodeSettings
from dflashkit.errors import ConfigError
from dflashkit.output_dir import output_dir
from dflashkit.validation import (
    BlockSize,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    Probability,
    Seed,
    Temperature,
    Text,
    TokenCount,
    TreeBudget,
    UnitInterval,
    flag,
    float_list,
    int_list,
    key_value_flag,
    text_flag,
)

DEFAULT_TREE_BUDGET = 16


def _drafter_specs(values: list[str] | None) -> dict[str, str]:
    """['name=ckpt', 'ckpt2'] → {name: path}; a bare path is named after its directory."""
    out: dict[str, str] = {}
    for v in values or []:
        name, sep, path = v.partition("=")
        if not sep:
            name, path = Path(v).name or v, v
        if not name or not path:
            raise ConfigError(f"--drafter {v!r}: expected NAME=CHECKPOINT_DIR or CHECKPOINT_DIR")
        if name in out:
            raise ConfigError(f"--drafter: name {name!r} given twice (use NAME=CKPT to tell them apart)")
        out[name] = path
    return out


def _drafter_arg(p: argparse.ArgumentParser, help_text: str) -> None:
    p.add_argument(
        "--drafter",
        type=key_value_flag("NAME=CHECKPOINT_DIR", key_optional=True),
        action="append",
        default=[],
        metavar="NAME=CKPT",
        help=help_text,
    )


def _dataset_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dataset",
        type=flag(Text),
        required=True,
        help="mtbench, humaneval, sharegpt-heldout, sharegpt, long-context, or a JSONL file",
    )


def _methods(text: str) -> str:
    """argparse `type=` of --methods: every method a known form, each ddtree budget in range."""
    from dflashkit.evaluate.stats import parse_methods
    from dflashkit.validation import show

    try:
        parse_methods(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(f"{show(text)}: {e}") from None
    return text


_methods.expect = "comma-separated methods: ar, chain, ddtree:B (B from 1 to 4096), ddtree:auto"  # type: ignore[attr-defined]


def thinking_arg(p: argparse.ArgumentParser) -> None:
    from dflashkit.data.thinking import THINKING_MODES

    p.add_argument(
        "--thinking",
        choices=THINKING_MODES,
        default=None,
        help="reasoning models: the thinking mode to render prompts in; must be the mode the drafters' data was "
        "prepared with (default: the template's default)",
    )


def thinking_kwargs(args: argparse.Namespace, target: Any, drafters: dict[str, Any]) -> dict[str, Any]:
    """Chat template kwargs of --thinking, after refusing drafters whose data was prepared in another mode."""
    from dflashkit.data.thinking import check_same_thinking, template_kwargs

    for name, d in drafters.items():
        if "data" in d.config.extra:  # recorded at training (older checkpoints: unknown, not checked)
            trained = (d.config.extra.get("data") or {}).get("thinking")
            check_same_thinking(trained, args.thinking, where=f"drafter {name!r}")
    if target.tokenizer is None:
        return {}
    return template_kwargs(args.thinking, target.tokenizer, target.source)


def _read(args: argparse.Namespace) -> Any:
    """The dataset's records, read before anything loads (a malformed line is named in seconds). The long-context
    set is reported per length bucket unless --by-length says otherwise."""
    from dflashkit.data.long_context import NAME
    from dflashkit.evaluate.groups import LENGTH_BUCKETS
    from dflashkit.evaluate.stats import read_prompts

    if args.dataset == NAME and args.by_length is None:
        args.by_length = list(LENGTH_BUCKETS)
    return read_prompts(args.dataset, limit=args.limit, on_error=args.on_error, lengths=args.by_length)


def _prompts(
    args: argparse.Namespace, records: Any, target: Any, drafters: dict[str, Any]
) -> tuple[list[Any], dict[str, str]]:
    """The dataset's prompts for eval / simulate, rendered in the thinking mode the drafters were trained in."""
    from dflashkit.evaluate.stats import prompts_for

    kwargs = thinking_kwargs(args, target, drafters)
    return prompts_for(target, records, max_new_tokens=args.max_new_tokens, chat_template_kwargs=kwargs)


def _check_dataset(name: str) -> None:
    """Refuse an unknown dataset name before loading anything."""
    from dflashkit.data.datasets import DATASETS
    from dflashkit.data.long_context import NAME
    from dflashkit.errors import DataError

    if name not in DATASETS and name != NAME and not Path(name).expanduser().is_file():
        raise DataError(
            f"unknown dataset {name!r}: expected one of {', '.join([*DATASETS, NAME])} or a path to a JSONL "
            f'file (chat records, or pre-tokenised lines {{"prompt_ids": [...]}})'
        )


def _load_drafters(specs: dict[str, str], device: str) -> dict[str, Any]:
    from dflashkit.drafter.checkpoint import load_drafter

    return {name: load_drafter(path, device=device) for name, path in specs.items()}


def _sampling(args: argparse.Namespace, temperature: float | None = None) -> Any:
    """--temperature / --top-p / --top-k (or the given temperature) as SamplingParams."""
    from dflashkit.sampling import SamplingParams

    t = args.temperature if temperature is None else temperature
    top_p, top_k = 1.0 if args.top_p is None else args.top_p, args.top_k or 0
    try:
        return SamplingParams(temperature=t, top_p=top_p, top_k=top_k)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=flag(Temperature), default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=flag(Probability), default=None, help="with a temperature > 0 (default 1)")
    p.add_argument(
        "--top-k", type=flag(NonNegativeInt), default=None, help="with a temperature > 0; 0 = no top-k cut (default)"
    )


def _check_sampling_pairs(args: argparse.Namespace, temperatures: list[float]) -> None:
    """--top-p / --top-k shape sampling only: refused when every temperature is 0 (greedy ignores them)."""
    if all(t == 0 for t in temperatures):
        for name, value in (("--top-p", args.top_p), ("--top-k", args.top_k)):
            if value is not None:
                raise ConfigError(f"{name} {value:g} applies when sampling; expected a temperature > 0 with it")


_top_k = flag(NonNegativeInt)


def _top_k_value(text: str) -> int | None:
    """--tree-top-k: K ≥ 1, or 0 for "= the tree budget" (None)."""
    return _top_k(text) or None


_top_k_value.expect = "an integer ≥ 0 and < 2^31 (0: the tree budget)"  # type: ignore[attr-defined]


def _tree_top_k_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tree-top-k",
        type=_top_k_value,
        default=None,
        metavar="K",
        help="tokens per depth DDTree considers (default: = the tree budget, as the DDTree reference, "
        "so the tree is the B most probable prefixes; give K to cap the branching)",
    )


def _by_length_arg(p: argparse.ArgumentParser) -> None:
    from dflashkit.evaluate.groups import LENGTH_BUCKETS

    p.add_argument(
        "--by-length",
        nargs="?",
        type=int_list(PositiveInt, what="comma-separated prompt-token bucket edges, e.g. 512,1024,2048"),
        const=list(LENGTH_BUCKETS),
        default=None,
        metavar="EDGES",
        help="also report τ per prompt-length bucket (default edges "
        f"{','.join(map(str, LENGTH_BUCKETS))}) and plot it against the context length",
    )


def _stops(args: argparse.Namespace, target: Any) -> list[int]:
    from dflashkit.data.conversations import default_stop_token_ids

    return [] if args.ignore_eos else default_stop_token_ids(target)


# ---------------------------------------------------------------------------------------------- generate
def _generate_args(p: argparse.ArgumentParser) -> None:
    target_args(p)
    p.add_argument(
        "--drafter", type=flag(Text), default=None, help="drafter checkpoint directory (not needed for --method ar)"
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--prompt", type=text_flag, help="user message (rendered with the chat template when the target has one)"
    )
    which.add_argument(
        "--prompt-ids",
        type=int_list(what="comma-separated token ids"),
        help="pre-tokenised prompt, comma-separated ids (targets without a tokenizer)",
    )
    p.add_argument("--method", choices=("chain", "tree", "ar"), default="chain")
    p.add_argument("--max-new-tokens", type=flag(TokenCount), default=128)
    _sampling_args(p)
    p.add_argument(
        "--tree-budget",
        type=flag(TreeBudget),
        default=None,
        help=f"--method tree: DDTree node budget B (verify length 1 + B; default {DEFAULT_TREE_BUDGET})",
    )
    _tree_top_k_arg(p)
    p.add_argument("--block-size", type=flag(BlockSize), default=None, help="override the drafter's block size")
    p.add_argument(
        "--confidence-min",
        type=flag(UnitInterval),
        default=None,
        metavar="P",
        help="DSpark drafters: draft only while the confidence head's predicted prefix acceptance is ≥ P",
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-turn tokens")
    p.add_argument("--seed", type=flag(Seed), default=0)


@command("generate", "generate from one prompt with speculative decoding; print the text and τ", _generate_args)
def _generate(args: argparse.Namespace) -> int:
    import time

    from dflashkit.data.conversations import encode_prompt
    from dflashkit.decode.generate import generate
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.errors import DataError
    from dflashkit.target.model import Target

    if args.method != "ar" and not args.drafter:
        raise ConfigError(f"--method {args.method} needs --drafter CKPT (or use --method ar)")
    for name, value in (("--tree-budget", args.tree_budget), ("--tree-top-k", args.tree_top_k)):
        if value is not None and args.method != "tree":
            raise ConfigError(f"{name} applies to --method tree; --method is {args.method}")
    _check_sampling_pairs(args, [args.temperature])
    drafter = load_drafter(args.drafter, device=args.device) if args.drafter else None  # seconds: before the target
    target = Target.load(args.target, device=args.device, trust_remote_code=args.trust_remote_code)
    tok = target.tokenizer
    if args.prompt_ids is not None:
        ids = args.prompt_ids
        if not all(0 <= t < target.vocab_size for t in ids):
            raise DataError(f"--prompt-ids: expected token ids in [0, {target.vocab_size}) (the target's vocabulary)")
    elif tok is None:
        raise DataError(f"target {target.source} has no tokenizer: pass --prompt-ids instead of --prompt")
    elif getattr(tok, "chat_template", None):
        ids = encode_prompt(tok, [{"role": "user", "content": args.prompt}])
    else:
        ids = list(tok(args.prompt, add_special_tokens=True)["input_ids"])
    sampling = _sampling(args)
    t0 = time.perf_counter()
    try:
        res = generate(
            target,
            ids,
            drafter=drafter,
            settings=DecodeSettings(
                method=args.method,
                max_new_tokens=args.max_new_tokens,
                block_size=args.block_size,
                tree_budget=args.tree_budget or DEFAULT_TREE_BUDGET,
                tree_top_k=args.tree_top_k,
                sampling=sampling,
                stop_token_ids=_stops(args, target),
                seed=args.seed,
                confidence_min=args.confidence_min,
            ),
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    wall = time.perf_counter() - t0
    print(tok.decode(res.tokens, skip_special_tokens=True) if tok is not None else " ".join(map(str, res.tokens)))
    print(
        f"\n[{args.method}] {len(res.tokens)} tokens in {res.rounds} rounds, τ = {res.tau:.2f}, "
        f"{len(res.tokens) / wall:.1f} tok/s, stop: {res.stop_reason}"
    )
    return 0


# ---------------------------------------------------------------------------------------------- eval
def _eval_args(p: argparse.ArgumentParser) -> None:
    target_args(p)
    thinking_arg(p)
    _drafter_arg(p, "drafter checkpoint, repeatable; NAME= labels it in the results")
    _dataset_arg(p)
    p.add_argument(
        "--limit",
        type=flag(PositiveInt),
        default=None,
        help="use N prompts: the first N (MT-Bench: its categories in turn; long-context: spread over its lengths)",
    )
    p.add_argument(
        "--on-error",
        choices=("stop", "skip"),
        default="stop",
        help="malformed JSONL lines: stop (default) or skip them (recorded in results.json)",
    )
    p.add_argument(
        "--methods",
        type=_methods,
        default="ar,chain,ddtree:8",
        help="comma-separated: ar, chain, ddtree:B, ddtree:auto (the budget with the most tokens/s on this machine, "
        "measured before anything is timed)",
    )
    p.add_argument(
        "--budget-prompts",
        type=flag(Text),
        default=None,
        metavar="DATASET",
        help="ddtree:auto: choose the budget on the first two prompts of this dataset or JSONL file instead of the "
        "first two evaluated (e.g. sharegpt-heldout)",
    )
    p.add_argument("--max-new-tokens", type=flag(TokenCount), default=128)
    _sampling_args(p)
    p.add_argument(
        "--temperatures",
        type=float_list(Temperature, what="comma-separated temperatures, e.g. 0,1"),
        default=None,
        metavar="T,T",
        help="evaluate at each temperature on the same prompts (DIR/T0, DIR/T1, …) and compare them side by side in "
        "DIR/compare.md (replaces --temperature)",
    )
    _by_length_arg(p)
    p.add_argument("--block-size", type=flag(BlockSize), default=None, help="override every drafter's block size")
    _tree_top_k_arg(p)
    p.add_argument("--out", type=flag(Text), required=True, help="output directory")
    p.add_argument("--no-resume", action="store_true", help="start over instead of continuing progress.jsonl")
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the untimed warm-up runs (on CPU they also let the products of each width settle before timing)",
    )
    compile_arg(p, "while decoding")
    p.add_argument("--hf-baseline", action="store_true", help="also time HF generate as a second AR baseline")
    p.add_argument(
        "--triage-threshold",
        type=flag(NonNegativeFloat),
        default=None,
        help="top-2 logit margin below which a greedy divergence is a numerical near-tie",
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-turn tokens")
    p.add_argument("--seed", type=flag(Seed), default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


@command(
    "eval", "evaluate drafters (τ, speedup vs AR, greedy equality) on a dataset; write results + report", _eval_args
)
def _eval(args: argparse.Namespace) -> int:
    from dflashkit.evaluate.evaluate import EvalSettings, evaluate
    from dflashkit.evaluate.report import compare, render, summary_table
    from dflashkit.evaluate.stats import parse_methods, prompts_for, read_prompts
    from dflashkit.target.model import Target

    methods = parse_methods(args.methods)  # user errors before any loading
    if args.temperatures is not None:
        if args.temperature != 0.0:
            raise ConfigError("--temperatures replaces --temperature: give one of them")
        if len({f"{t:g}" for t in args.temperatures}) != len(args.temperatures):  # one directory each
            raise ConfigError(f"--temperatures {','.join(map(str, args.temperatures))}: each temperature once")
    _check_sampling_pairs(args, args.temperatures or [args.temperature])
    if args.tree_top_k is not None and not any(m.kind == "tree" for m in methods):
        raise ConfigError(f"--tree-top-k applies to ddtree methods, which --methods {args.methods} does not name")
    output_dir(args.out, what="--out", create=False)
    _check_dataset(args.dataset)
    if args.budget_prompts is not None:
        if not any(m.is_auto for m in methods):
            raise ConfigError(f"--budget-prompts is for ddtree:auto, which --methods {args.methods} does not name")
        _check_dataset(args.budget_prompts)
    specs = _drafter_specs(args.drafter)
    if any(m.kind != "ar" for m in methods) and not specs:
        raise ConfigError(f"--methods {args.methods} needs at least one --drafter NAME=CKPT")
    records = _read(args)
    budget_records = None if args.budget_prompts is None else read_prompts(args.budget_prompts, limit=2)
    drafters = _load_drafters(specs, args.device)  # a bad checkpoint fails in seconds, before the target loads
    target = Target.load(args.target, device=args.device, trust_remote_code=args.trust_remote_code)
    prompts, skipped = _prompts(args, records, target, drafters)
    budget_prompts = None
    if budget_records is not None:
        budget_prompts = prompts_for(
            target,
            budget_records,
            max_new_tokens=args.max_new_tokens,
            chat_template_kwargs=thinking_kwargs(args, target, drafters),
        )[0]
    temperatures = args.temperatures or [args.temperature]
    runs = {f"T={t:g}": Path(args.out) / f"T{t:g}" if args.temperatures else Path(args.out) for t in temperatures}
    bugs = 0
    chosen = None  # ddtree:auto's budgets, chosen at the first temperature: every temperature compares the same trees
    for t, out in zip(temperatures, runs.values(), strict=True):
        doc = evaluate(
            target,
            drafters,
            prompts,
            out_dir=out,
            dataset=args.dataset,
            skipped=skipped,
            drafter_sources=specs,
            budget_prompts=budget_prompts,
            budget_choices=chosen,
            settings=EvalSettings(
                methods=[m.name for m in methods],
                max_new_tokens=args.max_new_tokens,
                sampling=_sampling(args, t),
                resume=not args.no_resume,
                block_size=args.block_size,
                tree_top_k=args.tree_top_k,
                stop_token_ids=_stops(args, target),
                triage_threshold=args.triage_threshold,
                seed=args.seed,
                warmup=not args.no_warmup,
                compile=args.compile,
                hf_baseline=args.hf_baseline,
                progress=not args.quiet,
                length_buckets=args.by_length,
                thinking=args.thinking,
            ),
        )
        render(doc, out)
        chosen = chosen or _budget_choices(doc)
        if len(runs) > 1:
            print(f"temperature {t:g}:")
        print(summary_table(doc))
        bugs += sum(st["divergence_verdicts"]["bug"] for m in doc["results"].values() for st in m.values())
        for note in doc["notes"]:
            print(f"note: {note}")
        print(f"wrote {out / 'results.json'} and {out / 'report.md'}")
    if skipped:
        print(f"{len(skipped)} prompts skipped (reasons in results.json)")
    if bugs:
        print(f"WARNING: {bugs} greedy divergences not explained by numerical near-ties (see report.md)")
    if len(runs) > 1:
        compare([out / "results.json" for out in runs.values()], out_dir=args.out, labels=list(runs))
        print(f"wrote {Path(args.out) / 'compare.md'}: every method at temperatures {', '.join(map(str, runs))}")
    return 0


def _budget_choices(doc: dict[str, Any]) -> dict[str, Any] | None:
    """Drafter name → the ddtree:auto budget an evaluation chose (None when it ran no ddtree:auto)."""
    from dflashkit.evaluate.budget_choice import BudgetChoice

    found = {
        name: BudgetChoice.from_dict(st["budget_choice"])
        for name, methods in doc["results"].items()
        for st in methods.values()
        if "budget_choice" in st
    }
    return found or None


# ---------------------------------------------------------------------------------------------- simulate
def _simulate_args(p: argparse.ArgumentParser) -> None:
    target_args(p)
    thinking_arg(p)
    _drafter_arg(p, "repeatable")
    _dataset_arg(p)
    p.add_argument("--limit", type=flag(PositiveInt), default=None)
    p.add_argument("--on-error", choices=("stop", "skip"), default="stop", help="malformed JSONL lines")
    p.add_argument("--cache", type=flag(Text), required=True, help="transcript cache directory (built once, reused)")
    p.add_argument(
        "--budgets",
        type=int_list(TreeBudget, what="comma-separated DDTree budgets", allow_empty=True),
        default=[4, 8, 16],
        help="DDTree budgets to simulate (empty: chain only)",
    )
    p.add_argument("--no-chain", action="store_true", help="simulate trees only")
    p.add_argument("--max-new-tokens", type=flag(TokenCount), default=128)
    p.add_argument("--block-size", type=flag(BlockSize), default=None)
    _tree_top_k_arg(p)
    p.add_argument("--ignore-eos", action="store_true")
    _by_length_arg(p)
    p.add_argument("--out", type=flag(Text), required=True)
    p.add_argument("--quiet", action="store_true")


@command(
    "simulate",
    "teacher-forced τ of many drafters (chain and DDTree budgets) from cached target transcripts",
    _simulate_args,
)
def _simulate(args: argparse.Namespace) -> int:
    import json

    from dflashkit.evaluate.report import render, summary_table
    from dflashkit.evaluate.simulate import simulate_many, simulation_results
    from dflashkit.evaluate.transcripts import build_transcripts
    from dflashkit.io_utils import atomic_write_text
    from dflashkit.target.model import Target, check_drafter_fits

    budgets = list(args.budgets)
    if not budgets and args.no_chain:
        raise ConfigError("--no-chain with empty --budgets: nothing to simulate; give budgets or drop --no-chain")
    if not budgets and args.tree_top_k is not None:
        raise ConfigError("--tree-top-k applies to DDTree budgets; --budgets is empty")
    output_dir(args.out, what="--out", create=False)
    output_dir(args.cache, what="--cache", create=False)
    _check_dataset(args.dataset)
    specs = _drafter_specs(args.drafter)
    if not specs:
        raise ConfigError("simulate needs at least one --drafter NAME=CKPT")
    records = _read(args)
    drafters = _load_drafters(specs, args.device)  # a bad checkpoint fails in seconds, before the target loads
    target = Target.load(args.target, device=args.device, trust_remote_code=args.trust_remote_code)
    for name, d in drafters.items():
        check_drafter_fits(d.config, target, source=f"drafter {name!r}")
    prompts, skipped = _prompts(args, records, target, drafters)
    layers = sorted({i for d in drafters.values() for i in d.config.target_layer_ids})
    cache = build_transcripts(
        target,
        prompts,
        args.cache,
        max_new_tokens=args.max_new_tokens,
        layer_ids=layers,
        stop_token_ids=_stops(args, target),
        progress=not args.quiet,
    )
    results = simulate_many(
        drafters,
        cache,
        block_size=args.block_size,
        tree_budgets=budgets,
        tree_top_k=args.tree_top_k,
        chain=not args.no_chain,
        prompt_ids=[p.id for p in prompts],
        progress=not args.quiet,
        categories={p.id: p.category for p in prompts},
        length_buckets=args.by_length,
    )
    doc = simulation_results(
        cache,
        drafters,
        results,
        dataset=args.dataset,
        block_size=args.block_size,
        tree_top_k=args.tree_top_k,
        drafter_sources=specs,
        thinking=args.thinking,
        length_buckets=args.by_length,
    )
    doc["dataset"]["skipped"] = skipped
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", json.dumps(doc, indent=1) + "\n")
    render(doc, out)
    print(summary_table(doc))
    for note in doc["notes"][1:]:  # the first says what a simulation is
        print(f"note: {note}")
    print(f"wrote {out / 'results.json'} and {out / 'report.md'} (transcripts in {args.cache})")
    return 0


# ---------------------------------------------------------------------------------------------- report
def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", type=flag(Text), help="results.json files (or directories holding one)")
    p.add_argument(
        "--out", type=flag(Text), default=None, help="output directory (default: next to a single results.json)"
    )


@command(
    "report", "render results.json as Markdown + PNG plots; several files: a side-by-side comparison", _report_args
)
def _report(args: argparse.Namespace) -> int:
    from dflashkit.evaluate.report import compare, render

    print(render(args.results[0], args.out) if len(args.results) == 1 else compare(args.results, args.out))
    return 0
