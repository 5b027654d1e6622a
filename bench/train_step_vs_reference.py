"""dflashkit's DFlash training step against vllm-project/speculators' own (0.9.0), on the same batch, weights, anchors
and loss: seconds per step, peak memory, and the two losses, which must agree.

    .venv/bin/python bench/train_step_vs_reference.py                  # 1,024 tokens, 128 blocks of 4, 5 steps
    .venv/bin/python bench/train_step_vs_reference.py --tokens 256 --anchors 16 --steps 2     # a quick check
    .venv/bin/python bench/train_step_vs_reference.py --repeats 3 --threads 2 --weights dpace

Needs .venv-speculators (scripts/setup_speculators.sh; or $DFLASHKIT_SPECULATORS_PYTHON), where
bench/reference_step_speculators.py runs speculators' step without ever importing dflashkit.

The geometry is the quickstart's drafter on the embedded SmolLM2-135M-Instruct target (`default_drafter_config`,
block size 4, --layers 1 draft layer, the target's full vocabulary as the head), over one packed row of --tokens
tokens (one document; the first eighth an unsupervised prompt) with --anchors blocks. Features are random (1, T, K·H)
tensors (seeded), so no capture is needed. The same weights run on both sides: the drafter is saved, converted with
`dflashkit.export.convert.convert(..., to="speculators", target=…)` and loaded by speculators'
`SpeculatorModel.from_pretrained` (the export names the target's directory, where speculators takes the embeddings,
the LM head and the final norm), float32, eager attention over its float mask (`create_float_mask`) on CPU.

The same anchors: speculators draws its anchors itself (`select_anchors`: a random permutation of the loss mask's
positions from the global RNG), so its process reseeds that RNG before every step and reports what it drew; dflashkit
then takes exactly those (`build_blocks(anchors=…)`). (A loss mask holding only the anchors would force them too, but
speculators reads the labels' validity from the same mask — slot k of anchor a counts only where a + k is itself an
anchor — so most draft slots would carry no loss.)

The same loss, speculators' DFlash default of its trainer (`--loss-fn ce`, eager) with fixed exponential position
weights (or `--weights dpace`, D-PACE, α = --dpace-alpha):
    loss = Σ_{blocks, k ≥ 1, valid} w_k · CE_k / (n_valid + 1e-5),  w_k = exp(−(k − 1)/γ),  γ = --gamma (default 4)
where n_valid counts the valid draft slots (not Σ w; D-PACE: w from the drafter's own detached confidence). γ is
speculators' default, not dflashkit's (2 at block size 4). speculators' label at slot k is the argmax of the verifier's
logits at a + k − 1 (it has no label path), dflashkit's the token at a + k: the row's tokens are made so that both are
the same (token j + 1 = the argmax of the verifier's logits over random final-layer states at j, each with a clear
margin). dflashkit computes it with `block_loss` and `LossSpec(weights=decay_weights(bs, γ), normalizer=n_valid + 1e-5)`
(D-PACE: `LossSpec(position_weights="dpace", dpace_alpha=α)`, the same normalizer).

One step, timed: forward (dflashkit: blocks, masks, drafter, chunked `block_loss`; speculators: its `forward` with
anchor choice, mask, the verifier's target logits and `compute_metrics`) + backward + AdamW step + zero_grad, no
gradient clipping on either side; the median of --steps steps after one untimed step. AdamW: lr 1e-4, betas (0.9,
0.999), no weight decay on both sides — speculators' `build_optimizers` (torch's default AdamW: a per-tensor loop on
CPU), dflashkit's `make_adamw` (--adamw, foreach). dflashkit runs in float32 and under bf16 autocast (forward and
loss, bf16 masks); speculators in float32. With --repeats R the runs alternate (speculators, dflashkit fp32, dflashkit
bf16, …) so the machine's drift hits all of them.

Each run is its own subprocess with --threads torch threads, so its memory is its own: peak RSS is the peak resident
memory of its address space over the whole run, loading included (VmHWM of /proc/self/status; a child's ru_maxrss
would also hold the peak of this process, which loads the target), and step memory is the peak over the steps (the
peak restarted once built, /proc/self/clear_refs) minus the resident memory once the model, optimizer and batch are
built: activations, gradients, AdamW's state, the loss's logits.

Exits 1 when the float32 losses of the first step (identical weights) differ by more than --tolerance (relative), or
when the anchors or labels differ. Prints a header naming the machine, a Markdown table, then ONE final JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HELPER = Path(__file__).resolve().parent / "reference_step_speculators.py"
SPECULATORS_PYTHON_ENV = "DFLASHKIT_SPECULATORS_PYTHON"
PRECISIONS = ("fp32", "bf16")  # dflashkit's; speculators runs float32
WEIGHTS = {"decay": "fixed-exp-decay", "dpace": "dpace"}  # --weights → speculators' per_position_loss_weight
MARGIN = 1e-3  # relative gap between the verifier's two largest logits at every position: no argmax near a tie


def _memory() -> tuple[float, float]:
    """(resident now, resident at its peak) in MiB of this process's own address space (/proc/self/status VmRSS,
    VmHWM). Not ru_maxrss: a child started by vfork inherits there the peak of the process that started it."""
    try:
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024
    except (OSError, KeyError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return peak, peak


def _reset_peak() -> bool:
    """Restart the peak (VmHWM) from the present resident memory (Linux /proc/self/clear_refs); False if it can't."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _speculators_python() -> Path | None:
    env = os.environ.get(SPECULATORS_PYTHON_ENV)
    path = Path(env) if env else ROOT / ".venv-speculators" / "bin" / "python"
    return path if path.is_file() else None


# ---------------------------------------------------------------------------------------------- the batch
def _verifier_top2(final: torch.Tensor, norm_weight: torch.Tensor, head: torch.Tensor, eps: float) -> torch.Tensor:
    """(n, H) pre-norm states → (n, 2) values and (n,) argmax of the verifier's logits, as speculators forms its
    targets: RMS norm (eps of the draft layers' config, weight of the target's final norm), then the LM head."""
    values, ids = [], []
    for rows in final.split(256):
        x = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps) * norm_weight
        top = (x @ head.t()).topk(2, dim=-1)  # (r, 2)
        values.append(top.values)
        ids.append(top.indices[:, 0])
    return torch.cat(values), torch.cat(ids)


def _labelled_row(target, eps: float, tokens: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random final-layer states (T, H) and token ids (T,) with token j + 1 = the argmax of the verifier's logits at
    j, each argmax ahead of the runner-up by MARGIN (relative; weaker rows are drawn again)."""
    weight = target.final_norm.weight.detach().float()
    head = target.lm_head_weight.detach().float()
    final = torch.randn(tokens, target.hidden_size, generator=g)
    values, ids = _verifier_top2(final, weight, head, eps)
    for _ in range(100):
        weak = (values[:, 0] - values[:, 1]) < MARGIN * values[:, 0].abs().clamp_min(1.0)
        if not bool(weak.any()):
            break
        final[weak] = torch.randn(int(weak.sum()), target.hidden_size, generator=g)
        values[weak], ids[weak] = _verifier_top2(final[weak], weight, head, eps)
    else:
        raise SystemExit("could not draw final-layer states with a clear argmax at every position")
    first = torch.randint(0, target.vocab_size, (1,), generator=g)
    return final, torch.cat([first, ids[:-1]])


# ---------------------------------------------------------------------------------------------- dflashkit's step
def _dflashkit_child(args: argparse.Namespace) -> dict:
    """One implementation's run (this process: dflashkit at `args.child` precision) → its record."""
    torch.set_num_threads(args.threads)
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.train.blocks import attention_masks, build_blocks
    from dflashkit.train.losses import LossSpec, block_loss, decay_weights
    from dflashkit.train.optimizer_choice import make_adamw

    work = Path(args.workdir)
    bf16 = args.child == "bf16"
    drafter = load_drafter(work / "ours").train()
    cfg, bs = drafter.config, drafter.config.block_size
    data = torch.load(work / "batch.pt")
    head = torch.load(work / "head.pt")
    embed, lm_head = head["embed"], head["lm_head"]  # (V, H) each, the target's (frozen)
    anchors = torch.load(work / "anchors.pt")  # (1, N) speculators' draw
    features, ids, loss_mask = data["features"], data["ids"], data["loss_mask"]  # (1, T, K·H), (1, T), (1, T)
    positions = torch.arange(ids.shape[1])[None]  # (1, T)
    optimizer = make_adamw(drafter.parameters(), args.adamw, lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0)
    weights = decay_weights(bs, args.gamma) if args.weights == "decay" else None  # D-PACE: its default slot marks
    spec = LossSpec(weights=weights, position_weights=args.weights, dpace_alpha=args.dpace_alpha)
    rss_built, load_peak = _memory()
    peak_reset = _reset_peak()  # from here the peak is the steps' own
    times, losses = [], []
    for i in range(args.steps + 1):
        t0 = time.perf_counter()
        blocks = build_blocks(ids, torch.zeros_like(ids), positions, loss_mask, block_size=bs, anchors=anchors)
        masks = attention_masks(cfg, blocks, torch.bfloat16 if bf16 else torch.float32)
        labels = blocks.labels.reshape(-1, bs)  # (N, bs), −100 where invalid
        n_valid = (labels[:, 1:] != -100).sum()  # speculators' denominator: the valid draft slots (+ 1e-5)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            embeds = drafter.block_embeddings(blocks.first_tokens, embed, bs)  # (1, Nq, H)
            hidden = drafter(
                features, embeds, context_positions=blocks.context_positions,
                block_positions=blocks.block_positions, attention_mask=masks, block_len=bs,
            )  # fmt: skip
            states = hidden.reshape(-1, bs, cfg.hidden_size)  # (N, bs, H)
            loss = block_loss(states, lm_head, labels, dataclasses.replace(spec, normalizer=n_valid + 1e-5)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        if i:
            times.append(elapsed)
        losses.append(float(loss.detach()))
    return {
        "impl": "dflashkit",
        "precision": args.child,
        "step_s": times,
        "losses": losses,
        "rss_built_mib": rss_built,  # resident once the drafter, optimizer and batch are built
        "step_peak_mib": _memory()[1],  # the peak over the steps (over the whole run when peak_reset is false)
        "peak_rss_mib": max(load_peak, _memory()[1]),  # the peak over the whole run, loading included
        "peak_reset": peak_reset,
        "threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------------------------------- the runs
def _run(cmd: list[str], out: Path, what: str, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env={**env, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0 or not out.is_file():
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _speculators_run(args: argparse.Namespace, python: Path, work: Path, n: int) -> dict:
    out = work / f"speculators-{n}.json"
    cmd = [str(python), str(HELPER), str(work / "spec"), str(work / "batch.pt"), str(out)]
    cmd += ["--anchors", str(args.anchors), "--steps", str(args.steps), "--threads", str(args.threads)]
    cmd += ["--seed", str(args.seed), "--gamma", str(args.gamma), "--weights", WEIGHTS[args.weights]]
    cmd += ["--dpace-alpha", str(args.dpace_alpha), "--lr", str(args.lr)]
    rec = _run(cmd, out, "speculators' step", cwd=work)  # run from the scratch folder: dflashkit is not importable
    if rec["dflashkit_imported"]:
        raise SystemExit("the speculators process imported dflashkit")
    return rec


def _dflashkit_run(args: argparse.Namespace, work: Path, precision: str, n: int) -> dict:
    out = work / f"dflashkit-{precision}-{n}.json"
    cmd = [sys.executable, __file__, "--child", precision, "--workdir", str(work), "--out", str(out)]
    for flag in ("steps", "threads", "gamma", "weights", "dpace_alpha", "lr", "adamw"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return _run(cmd, out, f"dflashkit's {precision} step", cwd=ROOT)


def _check_labels(spec: dict, ids: torch.Tensor, loss_mask: torch.Tensor, bs: int) -> list[str]:
    """Where speculators' first step supervised other slots or other labels than dflashkit's blocks do."""
    from dflashkit.train.blocks import build_blocks

    anchors = torch.tensor(spec["anchors"])[None]  # (1, N)
    positions = torch.arange(ids.shape[1])[None]
    blocks = build_blocks(ids, torch.zeros_like(ids), positions, loss_mask, block_size=bs, anchors=anchors)
    labels = blocks.labels.reshape(-1, bs)  # (N, bs)
    ours = labels != -100
    ours[:, 0] = False  # slot 0 is the given anchor token: no loss on either side
    theirs = torch.tensor(spec["slot_mask"]).reshape(-1, bs) > 0
    target_ids = torch.tensor(spec["target_ids"]).reshape(-1, bs)
    problems = []
    if not torch.equal(ours, theirs):
        problems.append(f"supervised slots differ: dflashkit {int(ours.sum())}, speculators {int(theirs.sum())}")
    elif not torch.equal(labels[ours], target_ids[ours]):
        problems.append(f"labels differ at {int((labels[ours] != target_ids[ours]).sum())} of {int(ours.sum())} slots")
    return problems


def _summary(name: str, precision: str, recs: list[dict]) -> dict:
    steps = [s for r in recs for s in r["step_s"]]
    return {
        "implementation": name,
        "precision": precision,
        "s_per_step": statistics.median(steps),
        "step_s": steps,
        "peak_rss_mib": max(r["peak_rss_mib"] for r in recs),
        "step_memory_mib": max(r["step_peak_mib"] - r["rss_built_mib"] for r in recs),
        "peak_reset": all(r["peak_reset"] for r in recs),
        "rss_built_mib": max(r["rss_built_mib"] for r in recs),
        "loss": recs[0]["losses"][0],  # the first step's, before any update: the same weights on every side
        "last_loss": recs[0]["losses"][-1],
    }


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default="default", help="target: an HF directory, or the embedded default")
    p.add_argument("--tokens", type=int, default=1024, help="tokens in the packed row (one document)")
    p.add_argument("--anchors", type=int, default=128, help="blocks (anchors) per step")
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--layers", type=int, default=1, help="draft layers (num_hidden_layers)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run, after one untimed step")
    p.add_argument("--repeats", type=int, default=1, help="runs per implementation, alternating")
    p.add_argument("--threads", type=int, default=2, help="torch threads in every run")
    p.add_argument("--gamma", type=float, default=4.0, help="decay γ of the position weights (speculators' default 4)")
    p.add_argument("--weights", choices=tuple(WEIGHTS), default="decay", help="position weights: decay or D-PACE")
    p.add_argument("--dpace-alpha", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--adamw", choices=("foreach", "fused", "default"), default="foreach", help="dflashkit's AdamW")
    p.add_argument("--tolerance", type=float, default=1e-4, help="largest relative difference of the fp32 losses")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", choices=PRECISIONS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    for flag in ("tokens", "anchors", "layers", "steps", "repeats", "threads"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"error: --{flag} must be ≥ 1")
    if args.child:
        Path(args.out).write_text(json.dumps(_dflashkit_child(args)))
        return
    python = _speculators_python()
    if python is None:
        raise SystemExit(
            f"no speculators environment: run scripts/setup_speculators.sh (or set ${SPECULATORS_PYTHON_ENV})"
        )
    prompt = args.tokens // 8
    if args.tokens - prompt - args.block_size < args.anchors:
        raise SystemExit(
            f"error: --anchors {args.anchors} needs more than {args.anchors + prompt + args.block_size} tokens "
            f"(anchors come from the supervised {args.tokens - prompt} tokens, not the last block's)"
        )
    torch.set_num_threads(args.threads)

    from dflashkit.cpu_products.machine import machine_line
    from dflashkit.drafter.checkpoint import save_drafter
    from dflashkit.drafter.defaults import default_drafter_config
    from dflashkit.drafter.model import DFlashDrafter
    from dflashkit.export.convert import convert
    from dflashkit.target.model import Target

    target = Target.load(args.target)
    dcfg = default_drafter_config(target, block_size=args.block_size, num_hidden_layers=args.layers)
    torch.manual_seed(args.seed)
    drafter = DFlashDrafter(dcfg)
    g = torch.Generator().manual_seed(args.seed)
    t, width = args.tokens, dcfg.num_features * dcfg.hidden_size
    final, ids = _labelled_row(target, dcfg.rms_norm_eps, t, g)
    features = torch.randn(1, t, width, generator=g)  # (1, T, K·H), the target layers in target_layer_ids order
    loss_mask = torch.ones(1, t, dtype=torch.long)
    loss_mask[:, :prompt] = 0  # an unsupervised prompt
    ids = ids[None]  # (1, T)
    results, problems, runs = [], [], {}
    with tempfile.TemporaryDirectory(prefix="dflashkit-vs-speculators-") as tmp:
        work = Path(tmp)
        save_drafter(drafter, work / "ours")
        report = convert(work / "ours", work / "spec", to="speculators", target=target)
        torch.save({"features": features, "final": final[None], "ids": ids, "loss_mask": loss_mask}, work / "batch.pt")
        torch.save({"embed": target.embed_weight.detach(), "lm_head": target.lm_head_weight.detach()}, work / "head.pt")
        source, vocab = target.source, target.vocab_size
        del target, drafter
        for n in range(args.repeats):
            spec = _speculators_run(args, python, work, n)
            if n == 0:
                torch.save(torch.tensor(spec["anchors"])[None], work / "anchors.pt")
                problems += _check_labels(spec, ids, loss_mask, args.block_size)
            elif spec["anchors"] != runs["speculators"][0]["anchors"]:
                problems.append(f"speculators drew other anchors in repeat {n + 1}")
            runs.setdefault("speculators", []).append(spec)
            for precision in PRECISIONS:
                runs.setdefault(precision, []).append(_dflashkit_run(args, work, precision, n))
    spec = runs["speculators"][0]
    results.append(_summary(f"speculators {spec['speculators']} ({spec['model_class'].rsplit('.', 1)[-1]})", "fp32",
                            runs["speculators"]))  # fmt: skip
    results += [_summary("dflashkit", precision, runs[precision]) for precision in PRECISIONS]
    reference = results[0]
    for r in results:
        r["ratio_to_speculators"] = r["s_per_step"] / reference["s_per_step"]
        r["loss_rel_diff"] = abs(r["loss"] - reference["loss"]) / max(abs(reference["loss"]), 1e-30)
    rel = results[1]["loss_rel_diff"]  # dflashkit fp32 against speculators
    if rel > args.tolerance:
        problems.append(f"fp32 losses differ by {rel:.2e} (relative) > tolerance {args.tolerance:g}")

    n_slots = args.anchors * (args.block_size - 1)
    weight_param = f"γ {args.gamma:g}" if args.weights == "decay" else f"α {args.dpace_alpha:g}"
    loss_definition = {"kind": "ce", "weights": args.weights, "gamma": args.gamma, "dpace_alpha": args.dpace_alpha}
    loss_definition["normalizer"] = "valid draft slots + 1e-5"
    print(f"machine: {machine_line()}")
    print(
        f"target {source}, vocab {vocab} (full); drafter {args.layers} layer(s), block size {args.block_size}; "
        f"1 row of {t} tokens, {args.anchors} anchors ({n_slots} draft slots); {args.steps} steps × {args.repeats}"
    )
    print(
        f"loss: CE, {args.weights} position weights ({weight_param}), / (valid draft slots + 1e-5); "
        f"fp32 relative difference {rel:.2e} (tolerance {args.tolerance:g})"
    )
    if not all(r["peak_reset"] for r in results):
        print("note: the peak was not restarted once built (/proc/self/clear_refs): step memory may be loading's")
    print()
    print("| implementation | precision | s/step | × speculators | peak RSS MiB | step memory MiB | loss |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['implementation']} | {r['precision']} | {r['s_per_step']:.3f} | {r['ratio_to_speculators']:.2f} | "
            f"{r['peak_rss_mib']:.0f} | {r['step_memory_mib']:.0f} | {r['loss']:.6f} |"
        )
    print()
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    print(
        json.dumps(
            {
                "bench": "train_step_vs_reference",
                "machine": machine_line(),
                "target": source,
                "vocab": vocab,
                "tokens": t,
                "anchors": args.anchors,
                "block_size": args.block_size,
                "layers": args.layers,
                "steps": args.steps,
                "repeats": args.repeats,
                "threads": args.threads,
                "loss": loss_definition,
                "dflashkit_adamw": args.adamw,
                "speculators_version": spec["speculators"],
                "speculators_model_class": spec["model_class"],
                "export_notes": report.notes,
                "results": results,
                "fp32_loss_rel_diff": rel,
                "tolerance": args.tolerance,
                "problems": problems,
                "ok": not problems,
            }
        )
    )
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
