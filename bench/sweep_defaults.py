"""The sweep behind the quickstart's defaults: train variants under the same wall-clock budget, compare their τ.

    .venv/bin/python bench/sweep_defaults.py                      # every variant below, on runs/quickstart's data
    .venv/bin/python bench/sweep_defaults.py --variants lr3e-3,features3 --train-minutes 4 --sim-prompts 8
    .venv/bin/python bench/sweep_defaults.py --variants base,topk32,warm_start --seeds 0,1   # docs/studies.md, levers

Each variant is the quickstart's training stage (`quickstart.stage_train`: warmup + cosine over the training time
itself, so every variant ends with its learning rate decayed) with one setting changed, on the data of a finished
quickstart run (`--base`, default runs/quickstart: its regenerated responses, tokens and captured features).
Variants that change the amount of regenerated data rebuild it from the base run's responses (a prefix of them, in
regeneration order) or extend it by regenerating more (the same prompts order the quickstart uses), then capture
again. Lever variants may capture the base tokens again with the target's top-k log-probs (`capture_topk`), add the
ORIGINAL ShareGPT assistant text of further conversations (`original_text`: teacher-forced, the target's own argmax
as labels; capture is far cheaper than regeneration), capture them again with the target's final layer for a DSpark
drafter (`capture_final`), change TrainConfig fields (`train`: loss, labels, ...) or
warm-start the drafter from the target's top layers (`settings.warm_start`). Shared data of a plan lives in
OUT/_data/PLAN and is built once (its capture minutes are reported next to the variant). With `--seeds 0,1` every
variant is trained once per seed, in alternating order (seed 0 in table order, seed 1 reversed, ...), so slow drift
of the machine hits all variants alike; the table gives the mean and the half-range over seeds (the noise a
difference must beat). All drafters are then scored by one teacher-forced simulation (`dflashkit simulate`: chain
and DDTree budgets) on held-out prompts of each `--sim-datasets` entry (MT-Bench turn 1 and HumanEval by default);
the table prints τ per dataset and method next to the training stats of each variant.

Variants run one after another (the machine must otherwise be idle: budgets are wall-clock) and are resumable: a
variant whose `OUT/NAME/done.json` (seed 0) or `OUT/NAME-sS/done.json` exists is not trained again. "base" is the
base run's own drafter when its settings are the current defaults (it is the same training), else it is trained here
like the others. Writes OUT/sweep.json and OUT/sweep.md (plus the simulation's results.json, report.md and PNGs in
OUT/sim).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from dflashkit.data.original_text import ID_PREFIX, used_conversation_ids, write_original_text
from dflashkit.quickstart.run import QuickstartSettings, stage_capture, stage_prepare, stage_train, step_seconds

# `prepare --data long-context-train` for the long-context variants: prompts per length (512, 1024, 2048 and the
# longest that leaves room for the reply within max_length), the reply's length
LONG_DATA = {"per_length": 8, "max_length": 4096, "max_new_tokens": 128}
# name → (settings changes, data plan, TrainConfig changes). Data plan: "fraction" keeps that share of the base
# responses, "more_regen_minutes" regenerates that much more, "capture_topk" captures the base tokens again with
# the target's top-k log-probs, "original_text" adds that many further ShareGPT conversations with their ORIGINAL
# first assistant turn (labels then come from the target: `train.labels = "target"`), "drop_regen" leaves the
# regenerated responses out; "train_scale" multiplies the training budget (the regeneration/training split: the
# quickstart's defaults give 6 minutes to regeneration and 9 to training).
VARIANTS: dict[str, dict[str, Any]] = {
    "base": {},
    "lr3e-3": {"settings": {"lr": 3e-3}},
    "features3": {"settings": {"drafter_extra": {"num_features": 3}}},
    "mlp896": {"settings": {"drafter_extra": {"intermediate_size": 896}}},
    "regen9_train6": {"more_regen_minutes": 3.0, "train_scale": 6 / 9},
    "regen10": {"more_regen_minutes": 4.0},  # the quickstart's spare minutes spent on more regenerated data
    "regen3_train12": {"fraction": 0.5, "train_scale": 12 / 9},
    "lr7.5e-4": {"settings": {"lr": 7.5e-4}},
    "block4_anchors128": {"settings": {"block_size": 4, "max_anchors": 128}},  # same block tokens per row
    "seed1": {"settings": {"seed": 1}},  # the base again with another seed: how large is the noise?
    # τ-per-training-minute levers (docs/studies.md, "Levers per training minute")
    "topk32": {"capture_topk": 32, "train": {"loss": "topk"}},
    "topk32_ce": {"capture_topk": 32, "train": {"loss": "topk", "topk_ce_weight": 0.5}},
    "warm_start": {"settings": {"warm_start": True}},
    "orig_mix": {"original_text": 300, "train": {"labels": "target"}},
    "orig_only": {"original_text": 300, "drop_regen": True, "train": {"labels": "target"}},
    "layers1": {"settings": {"num_hidden_layers": 1}},  # the default: more steps in the same minutes
    "layers2": {"settings": {"num_hidden_layers": 2}},  # what the default is compared against
    "vocab4096": {"settings": {"draft_vocab": 4096}},
    "train13_eval5": {"train_scale": 13 / 9},  # the budget split: 4 of the 9 evaluation minutes moved to training
    # D-PACE position weights instead of the exponential decay, same data and budget
    "dpace": {"train": {"position_weights": "dpace"}},
    # a DSpark drafter at the same block size (so 4 drafts a round to DFlash's 3), same data; its loss
    # needs the target's final layer, captured again with the base tokens. DeepSpec's defaults (rank 256, CE 0.1),
    # named explicitly: the quickstart's own DSpark preset (dflashkit.quickstart.run.DSPARK_*_PRESET) is dspark_r64_ce1
    "dspark": {
        "settings": {"drafter_extra": {"kind": "dspark", "markov_rank": 256}},
        "train": {"dspark_ce_weight": 0.1},
        "capture_final": True,
    },
    # the same with a Markov head of rank 64: DeepSpec's 256 makes W1 (49152 × r) 2.6× the SmolLM2 drafter's backbone
    "dspark_r64": {
        "settings": {"drafter_extra": {"kind": "dspark", "markov_rank": 64}},
        "train": {"dspark_ce_weight": 0.1},
        "capture_final": True,
    },
    # rank 64 with the CE term at full weight (DeepSpec's 0.1 is tuned for long runs; at a few hundred steps the
    # label's CE is the stronger signal, the L1 to the target's distribution a weak one): the quickstart's preset
    "dspark_r64_ce1": {
        "settings": {"drafter_extra": {"kind": "dspark", "markov_rank": 64}},
        "train": {"dspark_ce_weight": 1.0},
        "capture_final": True,
    },
    # the quickstart's DSpark with D-PACE weights on its CE term (speculators' DSpark + D-PACE when the L1 weight is
    # 0; here the L1 and confidence terms keep exp(−k/4), so only the CE weighting differs from dspark_r64_ce1)
    "dspark_r64_ce1_dpace": {
        "settings": {"drafter_extra": {"kind": "dspark", "markov_rank": 64}},
        "train": {"dspark_ce_weight": 1.0, "position_weights": "dpace"},
        "capture_final": True,
    },
    # the acceptance-rate objectives against the target's distribution (the target runs every step; they need the
    # full vocabulary, so they compare with full_vocab, DFlash + CE over the full vocabulary)
    "full_vocab": {"settings": {"draft_vocab": 0}},
    "tv": {"settings": {"draft_vocab": 0}, "train": {"loss": "tv"}},
    "lk_hybrid": {"settings": {"draft_vocab": 0}, "train": {"loss": "lk_hybrid"}},
    "lk_lambda": {"settings": {"draft_vocab": 0}, "train": {"loss": "lk_lambda"}},
    # DFlash2 (convolutions + candidate selector) with the selector's two rules, and a rank-64 selector (A over the
    # 49,152-token vocabulary at rank 256 is 2.2× the SmolLM2 drafter's backbone)
    "dflash2": {"settings": {"drafter_extra": {"kind": "dflash2"}}},
    "dflash2_strict": {"settings": {"drafter_extra": {"kind": "dflash2"}}, "train": {"selector_rule": "strict"}},
    "dflash2_r64": {"settings": {"drafter_extra": {"kind": "dflash2", "selector_rank": 64}}},
    # Domino (a GRU over the previous tokens correcting the later slots; every slot drafts, as DSpark), at the
    # quickstart's preset (GRU and correction width 128)
    "domino": {"settings": {"drafter_extra": {"kind": "domino"}}},
    # XPress (a rank-r causal refiner, K Jacobi passes) at the quickstart's preset (rank 64; CE, the draft vocabulary),
    # and with speculators' objective (0.1·CE + 0.9·TV against the target: the full vocabulary, compare with tv)
    "xpress": {"settings": {"drafter_extra": {"kind": "xpress"}}},
    "xpress_tv": {"settings": {"draft_vocab": 0, "drafter_extra": {"kind": "xpress"}}, "train": {"loss": "tv"}},
    # the base run's regeneration minutes spent through llama-server (the quickstart's server route,
    # F32 GGUF, 8 slots) from scratch — first turns, or every turn of each conversation
    "server_regen": {"server_regen_minutes": 6.0},
    "server_regen_all": {"server_regen_minutes": 6.0, "regen_turns": "all"},
    # the server route as the quickstart runs it: slots measured at the start (8 or 16), chunks of 8 × slots
    # cut at the deadline (`regenerate(stop_at=…)`)
    "server_regen_measured": {"server_regen_minutes": 6.0, "server_slots": "measured"},
    # regularisation at the quickstart's budget (the drafter fits its few tens of K tokens far better than held-out
    # ones): Gaussian noise on the target features going into fc (absolute std; the five captured layers' median
    # |x| is 0.8–10 on SmolLM2), and AdamW weight decay
    "fcnoise0.3": {"train": {"noise_std": 0.3}},
    "wd0.5": {"train": {"weight_decay": 0.5}},
    # long contexts (bench/long_context.py): the base data plus the target's replies to long training prompts
    # (`prepare --data long-context-train`), rows of up to 4096 tokens; and the same with the drafter's layer a
    # sliding-window one (window 1024: the quickstart's row length)
    "long_rows": {"long_context": LONG_DATA, "train": {"max_tokens": 4096}},
    "long_rows_swa": {
        "long_context": LONG_DATA,
        "train": {"max_tokens": 4096},
        "settings": {"drafter_extra": {"layer_types": ["sliding_attention"], "sliding_window": 1024}},
    },
}
_DATA_KEYS = (
    "fraction",
    "more_regen_minutes",
    "capture_topk",
    "original_text",
    "drop_regen",
    "capture_final",
    "server_regen_minutes",
    "long_context",
)


def _say(msg: str) -> None:
    print(f"[sweep] {msg}", flush=True)


def _link(src: Path, dst: Path) -> None:
    if not dst.exists():
        dst.symlink_to(src.resolve(), target_is_directory=src.is_dir())


def _measured_slots(target: Any, s: QuickstartSettings) -> int:
    """The llama-server slot count the quickstart would choose on this machine (its first 32 training prompts)."""
    from dflashkit.quickstart.run import _train_prompts
    from dflashkit.quickstart.server import server_rates

    prompts = [ids for _, (_, ids) in zip(range(32), _train_prompts(target, s), strict=False)]
    rates = server_rates(target, prompts)
    _say(f"llama-server tokens/s by slots: {rates}")
    return max(rates, key=rates.__getitem__)


def _keep_base_original(tokens_file: Path, base: Path) -> int:
    """Append the base run's original-text samples (its tokens.jsonl lines) to `tokens_file`, for variants that
    change only the regenerated part. Returns how many."""
    lines = [
        line
        for line in (base / "data" / "tokens.jsonl").read_text().splitlines()
        if json.loads(line)["id"].startswith(ID_PREFIX)
    ]
    with open(tokens_file, "a") as f:
        f.writelines(line + "\n" for line in lines)
    return len(lines)


def _shared_data(
    target: Any, spec: dict[str, Any], s: QuickstartSettings, base: Path, root: Path, layer_ids: list[int]
) -> tuple[Path, dict[str, Any]]:
    """Data + features of a top-k / original-text plan, built once under OUT/_data/PLAN (all seeds share it)."""
    from dflashkit.data.regenerate import read_regenerated
    from dflashkit.data.samples import read_tokens
    from dflashkit.features.capture import CaptureSettings, capture

    keys = ("more_regen_minutes", "capture_topk", "original_text", "drop_regen", "capture_final", "long_context")
    plan = {k: spec[k] for k in (*keys, "server_regen_minutes", "regen_turns", "server_slots") if k in spec}
    if plan.get("capture_final"):  # DSpark: the target's log-sum-exp per position too, as the quickstart captures
        plan["target_lse"] = True
    name = (
        "-".join(k if isinstance(v, dict) else f"{k}{v}" for k, v in plan.items())
        + "-"
        + hashlib.sha1(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:6]
    )
    d = root / "_data" / name
    info_file = d / "info.json"
    if info_file.is_file():
        return d, json.loads(info_file.read_text())
    (d / "data").mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {"plan": plan}
    tokens = base / "data" / "tokens.jsonl"
    if "server_regen_minutes" not in plan:
        shutil.copyfile(base / "data" / "regenerated.jsonl", d / "data" / "regenerated.jsonl")
    else:  # from scratch through llama-server, the quickstart's own prepare stage on its server route
        t0 = time.monotonic()
        turns = str(plan.get("regen_turns", "first"))
        srv = replace(s, regen_minutes=float(plan["server_regen_minutes"]), original_text=0, regen_turns=turns)
        rates: dict[str, Any] = {"regen_route": "llama-server", "regen_batch": 32}
        if plan.get("server_slots") == "measured":  # as the quickstart's stage_rates chooses them
            rates["regen_server_slots"] = info["server_slots"] = _measured_slots(target, s)
        prep = stage_prepare(target, srv, d, time.monotonic() + 60 * srv.regen_minutes, rates)
        info.update({"regen_minutes": round((time.monotonic() - t0) / 60, 2), "responses": prep["conversations"]})
        info["regen_tokens_per_s"] = prep.get("regen_tokens_per_s")
        tokens = d / "data" / "tokens.jsonl.regen"
        (d / "data" / "tokens.jsonl").replace(tokens)
        _keep_base_original(tokens, base)
    if "more_regen_minutes" in plan:  # the quickstart's own prepare stage continues the base run's responses
        t0 = time.monotonic()
        more = replace(s, regen_minutes=float(plan["more_regen_minutes"]), original_text=0)
        rates = json.loads((base / "quickstart.json").read_text()).get("rates") or {}
        prep = stage_prepare(target, more, d, time.monotonic() + 60 * more.regen_minutes, rates)
        info.update({"regen_minutes_added": round((time.monotonic() - t0) / 60, 2), "responses": prep["conversations"]})
        tokens = d / "data" / "tokens.jsonl.regen"
        (d / "data" / "tokens.jsonl").replace(tokens)
        _keep_base_original(tokens, base)
    if "long_context" in plan:  # the target's replies to long training prompts, after the base samples
        t0 = time.monotonic()
        long_tokens = _long_context_samples(d / "long", plan["long_context"])
        merged = d / "data" / "tokens.jsonl.long"
        merged.write_text(tokens.read_text() + long_tokens.read_text())
        tokens = merged
        info.update(
            long_samples=len(long_tokens.read_text().splitlines()), long_minutes=round((time.monotonic() - t0) / 60, 2)
        )
    if "original_text" in plan:
        # conversations the base run did not use (neither regenerated nor, under the current defaults, as original text)
        used = {r["id"] for r in read_regenerated(d / "data" / "regenerated.jsonl")} | used_conversation_ids(
            [json.loads(line)["id"] for line in tokens.read_text().splitlines()]
        )
        orig = d / "data" / "original.jsonl"
        rep = write_original_text(
            target.tokenizer, int(plan["original_text"]), orig, exclude=used, max_prompt_tokens=s.max_prompt_tokens
        )
        lines = [] if plan.get("drop_regen") else tokens.read_text().splitlines()
        lines += orig.read_text().splitlines()
        (d / "data" / "tokens.jsonl").write_text("".join(line + "\n" for line in lines))
        info.update({"original_conversations": rep.written, "original_supervised_tokens": rep.supervised})
    else:
        shutil.copyfile(tokens, d / "data" / "tokens.jsonl")
    samples, _ = read_tokens(d / "data" / "tokens.jsonl")
    info["supervised_tokens"] = int(sum(int(x.loss_mask.sum()) for x in samples))
    t0 = time.monotonic()
    capture(
        target,
        samples,
        d / "features",
        tokens_file=d / "data" / "tokens.jsonl",
        log=_say,
        settings=CaptureSettings(
            layer_ids=layer_ids,
            dtype="bf16",
            store_topk=int(plan.get("capture_topk", 0)),
            store_target_lse=bool(plan.get("target_lse")),
        ),
    )
    info["capture_minutes"] = round((time.monotonic() - t0) / 60, 2)
    info_file.write_text(json.dumps(info, indent=1) + "\n")
    return d, info


def _long_context_samples(out: Path, spec: dict[str, Any]) -> Path:
    """tokens.jsonl of `dflashkit prepare --data long-context-train` as `spec` (LONG_DATA) says, in `out`."""
    from dflashkit.cli import main as cli

    argv = ["prepare", "--target", "default", "--data", "long-context-train", "--out", str(out)]
    argv += ["--limit", str(spec["per_length"]), "--max-length", str(spec["max_length"])]
    if cli([*argv, "--max-new-tokens", str(spec["max_new_tokens"])]) != 0:
        raise SystemExit(f"error: prepare --data long-context-train failed (see above); output in {out}")
    return out / "tokens.jsonl"


def _prepare_data(target: Any, spec: dict[str, Any], s: QuickstartSettings, base: Path, out: Path) -> dict[str, Any]:
    """Data and features of a variant in `out` (links to the base run's unless the variant changes the data)."""
    from dflashkit.data.regenerate import read_regenerated
    from dflashkit.data.tokens_file import write_tokens
    from dflashkit.drafter.capture_needs import capture_layer_ids
    from dflashkit.drafter.defaults import default_drafter_config

    layer_ids = capture_layer_ids(default_drafter_config(target, **s.drafter_overrides(target)))
    if not any(k in spec for k in _DATA_KEYS):
        _link(base / "data", out / "data")
        _link(base / "features", out / "features")
        return {"data": "base"}
    shared_keys = (
        "more_regen_minutes",
        "capture_topk",
        "original_text",
        "capture_final",
        "server_regen_minutes",
        "long_context",
    )
    if any(k in spec for k in shared_keys):
        shared, info = _shared_data(target, spec, s, base, out.parent, layer_ids)
        _link(shared / "data", out / "data")
        _link(shared / "features", out / "features")
        return info
    data = out / "data"  # "fraction": a prefix of the base run's responses, tokenised as the quickstart does
    data.mkdir(parents=True, exist_ok=True)
    records = read_regenerated(base / "data" / "regenerated.jsonl")
    records = records[: max(1, round(spec["fraction"] * len(records)))]
    with open(data / "regenerated.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    tokens = write_tokens(
        target.tokenizer,
        [(r["id"], r["messages"], r["response_token_ids"]) for r in records],
        data / "tokens.jsonl",
        max_length=1024,
        min_supervised=2,
    )
    info: dict[str, Any] = {
        "responses": len(records),
        "supervised_tokens": tokens.supervised,
        "original_samples_kept": _keep_base_original(data / "tokens.jsonl", base),
    }
    t0 = time.monotonic()
    stage_capture(target, layer_ids, out, s.capture_topk, s.head.reads_target_lse(s.draft_vocab or None, target))
    info["capture_minutes"] = round((time.monotonic() - t0) / 60, 2)
    return info


def run_name(name: str, seed: int) -> str:
    """Directory (and simulation drafter) name of one variant·seed: the plain name for seed 0."""
    return name if seed == 0 else f"{name}-s{seed}"


def run_variant(
    target: Any, name: str, spec: dict[str, Any], base: Path, out_root: Path, train_minutes: float, seed: int = 0
) -> dict[str, Any]:
    rname = run_name(name, seed)
    out = out_root / rname
    done = out / "done.json"
    if done.is_file():
        return json.loads(done.read_text())
    settings = {**spec.get("settings", {})}
    if seed:
        settings["seed"] = seed
    s = QuickstartSettings(**{**asdict(QuickstartSettings()), **settings})
    if spec.get("train"):
        s = replace(s, train_overrides={**s.train_overrides, **spec["train"]})
    base_state = base / "quickstart.json"
    minutes = train_minutes * float(spec.get("train_scale", 1.0))
    if name == "base" and seed == 0 and minutes == s.train_minutes and base_state.is_file():
        state = json.loads(base_state.read_text())
        if {**asdict(s), **state.get("settings", {}), "out": s.out} == asdict(s) and "train" in state.get("done", {}):
            result = {
                "name": rname,
                "variant": name,
                "seed": seed,
                "drafter": str(base / "drafter"),
                "train": state["done"]["train"],
                "data": {"data": "base"},
                "seconds_per_step": step_seconds(base / "train" / "metrics.jsonl"),
                "train_minutes": s.train_minutes,
                "reused": str(base),
            }
            out.mkdir(parents=True, exist_ok=True)
            done.write_text(json.dumps(result, indent=1) + "\n")
            return result
    out.mkdir(parents=True, exist_ok=True)
    _say(f"{rname}: data")
    data = _prepare_data(target, spec, s, base, out)
    _say(f"{rname}: training for {minutes:g} min")
    train = stage_train(target, s, out, minutes)
    # the drafter the quickstart would export: its best validation pass (keep_best), else the last step
    result = {
        "name": rname,
        "variant": name,
        "seed": seed,
        "drafter": train.get("best", train["final"]),
        "train": train,
        "data": data,
        "train_minutes": minutes,
        "seconds_per_step": step_seconds(out / "train" / "metrics.jsonl"),
        "settings_changed": {**spec.get("settings", {}), **({"train": spec["train"]} if spec.get("train") else {})},
    }
    done.write_text(json.dumps(result, indent=1) + "\n")
    return result


def interleaved(names: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """(variant, seed) in run order: seed index 0 in table order, 1 reversed, 2 in order, ..."""
    return [(n, sd) for i, sd in enumerate(seeds) for n in (names if i % 2 == 0 else names[::-1])]


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / 2 if len(values) > 1 else float("nan")


def _table(rows: list[dict[str, Any]], names: list[str], methods: list[str]) -> str:
    lines = [
        "| variant | change | seeds | train min | steps | s/step | " + " | ".join(f"τ {m}" for m in methods) + " |",
        "|---" * (6 + len(methods)) + "|",
    ]
    for name in names:
        rs = [r for r in rows if r["variant"] == name]
        change = "—" if name == "base" else f"`{json.dumps({k: v for k, v in VARIANTS[name].items()})}`"
        cells = []
        for m in methods:
            vals = [r["tau"][m] for r in rs]
            noise = _spread(vals)
            cells.append(f"{statistics.fmean(vals):.3f}" + ("" if noise != noise else f" ± {noise:.3f}"))
        steps = "/".join(str(r["train"]["steps"]) for r in rs)
        sps = statistics.fmean(r["seconds_per_step"] for r in rs)
        lines.append(
            f"| {name} | {change} | {len(rs)} | {rs[0]['train_minutes']:g} | {steps} | {sps:.2f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base", default=QuickstartSettings().out, help="a finished quickstart run (its data)")
    p.add_argument("--out", default="runs/sweep")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {list(VARIANTS)}")
    p.add_argument("--seeds", default="0", help="comma-separated training seeds per variant (e.g. 0,1)")
    p.add_argument("--train-minutes", type=float, default=QuickstartSettings().train_minutes)
    p.add_argument("--sim-prompts", type=int, default=16, help="held-out prompts to simulate per dataset")
    p.add_argument("--sim-datasets", default="mtbench,humaneval", help="comma-separated held-out datasets")
    p.add_argument("--sim-max-new-tokens", type=int, default=QuickstartSettings().eval_max_new_tokens)
    p.add_argument("--sim-cache", default="runs/sim_cache", help="transcript cache (built once, reused)")
    p.add_argument("--budgets", default="4,8")
    args = p.parse_args(argv)

    import torch

    from dflashkit.cli import main as cli
    from dflashkit.target.model import Target

    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"error: --variants: unknown {unknown}; expected names from {list(VARIANTS)}")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --seeds {args.seeds!r}: expected comma-separated integers") from None
    base, out_root = Path(args.base), Path(args.out)
    if not (base / "features" / "manifest.json").is_file() or not (base / "data" / "regenerated.jsonl").is_file():
        raise SystemExit(
            f"error: --base {base}: not a finished quickstart run (needs data/regenerated.jsonl and "
            f"features/); run `dflashkit quickstart --out {base}` first"
        )
    torch.manual_seed(0)
    target = Target.load("default")
    rows = [
        run_variant(target, n, VARIANTS[n], base, out_root, args.train_minutes, sd)
        for n, sd in interleaved(names, seeds or [0])
    ]
    datasets = [d.strip() for d in args.sim_datasets.split(",") if d.strip()]
    budgets = [b for b in args.budgets.split(",") if b]
    methods = []
    for ds in datasets:
        short = Path(ds).stem if ds.endswith(".jsonl") else ds  # a prompts file: its name
        sim = out_root / ("sim" if ds == "mtbench" else f"sim-{short}")
        cli(
            [
                "simulate",
                "--dataset",
                ds,
                "--limit",
                str(args.sim_prompts),
                "--max-new-tokens",
                str(args.sim_max_new_tokens),
                "--cache",
                args.sim_cache,
                "--budgets",
                args.budgets,
                "--out",
                str(sim),
                "--quiet",
                *[a for r in rows for a in ("--drafter", f"{r['name']}={r['drafter']}")],
            ]
        )
        doc = json.loads((sim / "results.json").read_text())
        here = [f"{short} {m}" for m in ("chain", *[f"ddtree:{b}" for b in budgets])]
        methods += here
        for r in rows:
            r.setdefault("variant", r["name"])
            r.setdefault("tau", {}).update(
                {col: doc["results"][r["name"]][col.split(" ", 1)[1]]["tau_macro"] for col in here}
            )
    table = _table(rows, names, methods)
    summary = {
        n: {m: round(statistics.fmean(r["tau"][m] for r in rows if r["variant"] == n), 4) for m in methods}
        for n in names
    }
    (out_root / "sweep.json").write_text(
        json.dumps({"rows": rows, "summary": summary, "seeds": seeds, "datasets": datasets}, indent=1) + "\n"
    )
    (out_root / "sweep.md").write_text(
        f"# Quickstart default sweep (τ macro, mean ± half-range over seeds "
        f"{seeds}, {args.sim_prompts} held-out prompts of {', '.join(datasets)}, "
        f"teacher-forced)\n\n{table}\n"
    )
    print(table)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
