"""Runs inside .venv-speculators and never imports dflashkit: speculators' own DFlash training step on a batch that
bench/train_step_vs_reference.py wrote, timed step by step, for that bench to set beside dflashkit's.

    .venv-speculators/bin/python bench/reference_step_speculators.py EXPORT_DIR BATCH.pt OUT.json --anchors 128

EXPORT_DIR: a `dflashkit convert --to speculators` export, loaded with `SpeculatorModel.from_pretrained` (embeddings,
LM head and final norm from the verifier the export names). Attention runs eagerly over speculators' float mask
(`create_float_mask`; its default flex attention compiles, which a CPU benchmark need not).
BATCH.pt:   features (1, T, K·H), final (1, T, H) the verifier's pre-norm last layer, ids (1, T), loss_mask (1, T).

One step is what speculators' trainer does per batch, without autocast (float32 on CPU) and gradient clipping:
the model's `forward` (anchors drawn by `select_anchors` from the loss mask, mask, draft layers, the verifier's
logits as targets, the loss of `compute_metrics` with `get_trainer_kwargs`' loss config: `--loss-fn ce`, eager),
zero_grad, backward, and the step of the optimizer `build_optimizers` makes (AdamW). The global RNG is reseeded
before every step, so every step draws the same anchors; the first (untimed) step records them and the labels its
loss used (the argmax of the targets) for the caller to check against its own.

OUT.json: step_s (timed steps), losses (every step, the untimed first included), anchors, target_ids and slot_mask
(per block slot: the label and whether it counts), memory in MiB of this process's own address space (/proc/self/status:
rss_built_mib once the model, the optimizer and the batch are built, step_peak_mib the peak over the steps — the peak is
restarted after building — and peak_rss_mib over the whole run), versions and the model class.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from types import SimpleNamespace

import torch
from speculators import SpeculatorModel
from speculators.models.attention import create_float_mask
from speculators.models.dflash import core
from speculators.train.optimizers import build_optimizers
from speculators.version import version as speculators_version


def _memory() -> tuple[float, float]:
    """(resident now, resident at its peak) in MiB of this process's own address space (/proc/self/status VmRSS,
    VmHWM). Not ru_maxrss: a child started by vfork inherits there the peak of the process that started it."""
    try:
        with open("/proc/self/status") as f:
            status = dict(line.split(":", 1) for line in f)
        return int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024
    except (OSError, KeyError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return peak, peak


def _reset_peak() -> bool:
    """Restart the peak (VmHWM) from the present resident memory (Linux /proc/self/clear_refs); False if it can't."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _memory_record(rss_built: float, load_peak: float, peak_reset: bool) -> dict:
    step_peak = _memory()[1]
    return {
        "rss_built_mib": rss_built,  # resident once the model, optimizer and batch are built
        "step_peak_mib": step_peak,  # the peak over the steps (over the whole run when peak_reset is false)
        "peak_rss_mib": max(load_peak, step_peak),  # the peak over the whole run, loading included
        "peak_reset": peak_reset,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export_dir")
    p.add_argument("batch")
    p.add_argument("out")
    p.add_argument("--anchors", type=int, required=True, help="max_anchors: blocks drawn from the loss mask")
    p.add_argument("--steps", type=int, default=5, help="timed steps, after one untimed step")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="global RNG seed set before every step (the anchors)")
    p.add_argument("--gamma", type=float, default=4.0, help="dflash_decay_gamma")
    p.add_argument("--weights", choices=("fixed-exp-decay", "dpace"), default="fixed-exp-decay")
    p.add_argument("--dpace-alpha", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=1e-4)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    model = SpeculatorModel.from_pretrained(args.export_dir).float().train()
    model.config.transformer_layer_config._attn_implementation = "eager"
    model._attn_impl, model._create_mask_fn = "eager", create_float_mask
    call_kwargs, _ = type(model).get_trainer_kwargs(
        loss_fn="ce",
        loss_implementation="eager",
        dflash_decay_gamma=args.gamma,
        max_anchors=args.anchors,
        per_position_loss_weight=args.weights,
        dpace_alpha=args.dpace_alpha,
    )
    optimizers = build_optimizers(model, SimpleNamespace(optimizer="adamw", lr=args.lr, weight_decay=0.0))
    data = torch.load(args.batch)
    seq = data["ids"].shape[1]
    batch = {
        "hidden_states": data["features"],  # (1, T, K·H)
        "input_ids": data["ids"],  # (1, T)
        "loss_mask": data["loss_mask"],  # (1, T)
        "verifier_last_hidden_states": data["final"],  # (1, T, H)
        "document_ids": torch.zeros(1, seq, dtype=torch.long),  # one document
        "position_ids": torch.arange(seq)[None],
    }
    rss_built, load_peak = _memory()
    peak_reset = _reset_peak()  # from here the peak is the steps' own

    # The untimed first step also records what speculators chose: its anchors and its loss's labels and mask.
    seen: dict[str, torch.Tensor] = {}
    select_anchors, compute_metrics = core.select_anchors, core.compute_metrics

    def record_anchors(*a, **kw):
        anchors, valid = select_anchors(*a, **kw)
        seen["anchors"], seen["anchor_valid"] = anchors.clone(), valid.clone()
        return anchors, valid

    def record_labels(logits, targets, loss_mask, *a, **kw):
        seen["target_ids"], seen["slot_mask"] = targets.argmax(-1)[0], loss_mask[0].clone()
        return compute_metrics(logits, targets, loss_mask, *a, **kw)

    times, losses = [], []
    for i in range(args.steps + 1):
        if i == 0:
            core.select_anchors, core.compute_metrics = record_anchors, record_labels
        torch.manual_seed(args.seed)  # the same anchors every step
        t0 = time.perf_counter()
        _, loss, _ = model(**batch, **call_kwargs)
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        for opt in optimizers:
            opt.step()
        elapsed = time.perf_counter() - t0
        if i == 0:
            core.select_anchors, core.compute_metrics = select_anchors, compute_metrics
        else:
            times.append(elapsed)
        losses.append(float(loss.detach()))
    if not bool(seen["anchor_valid"].all()):
        raise SystemExit(f"the loss mask has fewer than {args.anchors} anchor candidates: padded anchors were drawn")

    out = {
        "impl": "speculators",
        "precision": "fp32",
        "model_class": f"{type(model).__module__}.{type(model).__name__}",
        "step_s": times,
        "losses": losses,
        **_memory_record(rss_built, load_peak, peak_reset),
        "anchors": seen["anchors"].tolist(),
        "target_ids": seen["target_ids"].tolist(),
        "slot_mask": seen["slot_mask"].tolist(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "speculators": speculators_version,
        "dflashkit_imported": "dflashkit" in sys.modules,
    }
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
