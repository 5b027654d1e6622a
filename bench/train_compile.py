"""What `torch.compile` costs and saves on the quickstart's training step and on a capture on this machine: the
compile choice's own trials (`compile: auto` with train_compile=measure; `capture --compile auto` with
capture_compile=measure, both in DFLASHKIT_CHOICES) run inside a real training run at the quickstart's geometry and a
real capture with the default target, and what they found.

    .venv/bin/python bench/train_compile.py                 # fp32 and bf16 (dtype), one run each
    .venv/bin/python bench/train_compile.py --dtypes fp32 --samples 24

The rows are random token sequences (the quickstart's 1,024-token rows) with the default target's real features;
the drafter is the quickstart's (one layer, block 4, its anchors) with a draft vocabulary of `--draft-vocab` tokens
built from those rows, as the quickstart builds its own. Each run takes the trial's steps (eager, the compile,
ABBA rounds of compiled and eager) plus a few more, in a scratch directory with its own store of choices and a cold
inductor cache (`TORCHINDUCTOR_CACHE_DIR`: the compile times are first compiles). Prints per
precision: eager and compiled ms a step, the compile time, and the minutes of eager training a run must have left
for the compile to pay back (compile ÷ the fraction a step saves); then the capture's trial over `--capture-samples`
samples of 128–1,024 random tokens (fp32, one sample a forward; ms per 1,000 tokens) — then ONE final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--samples", type=int, default=24)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--extra-steps", type=int, default=4)
    p.add_argument("--capture-samples", type=int, default=40, help="the capture's trial over this many (0: none)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="train-compile-"))
    # a cold inductor cache: the compile times are a first compile's, as on a machine that never compiled these
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(scratch / "inductor")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from dflashkit.cpu_products.choice import ENV, with_override
    from dflashkit.cpu_products.compile_choice import EAGER_STEPS, ROUNDS, WARM_STEPS
    from dflashkit.cpu_products.machine import machine_line
    from dflashkit.data.samples import Sample
    from dflashkit.quickstart.run import QuickstartSettings, build_initial_drafter
    from dflashkit.target.model import Target
    from dflashkit.train.compile_choice import TRAIN_COMPILE
    from dflashkit.train.config import TrainConfig
    from dflashkit.train.loop import train
    from dflashkit.train.metrics import read_metrics

    os.environ[ENV] = with_override("store", None, with_override("train_compile", "measure"))
    try:
        target = Target.load("default")
        # the choices' stores from here on (the target was loaded from the user's cache)
        os.environ["DFLASHKIT_CACHE"] = str(scratch / "cache")
        s = QuickstartSettings(draft_vocab=args.draft_vocab)
        rng = random.Random(0)
        tokens = scratch / "tokens.jsonl"
        docs = [[rng.randrange(3, target.vocab_size) for _ in range(1024)] for _ in range(args.samples)]
        tokens.write_text("".join(json.dumps({"id": f"r{i}", "input_ids": d, "loss_mask": [0] * 64 + [1] * 960})
                                  + "\n" for i, d in enumerate(docs)))  # fmt: skip
        init = scratch / "init"
        build_initial_drafter(target, s, tokens, init)
        from dflashkit.drafter.checkpoint import load_config

        layers = load_config(init).target_layer_ids
        samples = []
        with torch.no_grad():
            for i, d in enumerate(docs):
                ids = torch.tensor(d)
                out = target.forward(ids[None], layer_ids=layers, logits=True)
                mask = torch.zeros(len(d), dtype=torch.bool)
                mask[64:] = True
                samples.append(Sample(f"r{i}", ids, mask, out.features[0], out.logits[0].argmax(-1)))
        steps = WARM_STEPS + EAGER_STEPS + 2 + 2 * ROUNDS + args.extra_steps
        results = []
        for dtype in [d for d in args.dtypes.split(",") if d]:
            out = scratch / f"run-{dtype}"
            cfg = TrainConfig.from_dict(
                {"target": "default", "out": str(out), "init_from": str(init), "max_tokens": 1024,
                 "max_anchors": s.max_anchors, "lr": s.lr, "max_steps": steps, "save_every": 0, "val_samples": 0,
                 "tensorboard": False, "progress": False, "dtype": dtype, "compile": "auto"},
                source="bench",
            )  # fmt: skip
            train(cfg, dataset=samples, target=target)
            (entry,) = [e for k, e in TRAIN_COMPILE.stored_choices().items() if f":{dtype}:" in k]
            step_s = [r["step_s"] for r in read_metrics(out / "metrics.jsonl") if r["split"] == "train"]
            saved = 1 - entry["compiled_ms"] / entry["eager_ms"]
            pays_min = entry["compile_s"] / saved / 60 if saved > 0 else None
            results.append({"dtype": dtype, **{k: entry[k] for k in ("choice", "eager_ms", "compiled_ms", "compile_s")},
                            "pays_after_eager_min": None if pays_min is None else round(pays_min, 1),
                            "step_s": [round(x, 3) for x in step_s]})  # fmt: skip
            print(f"{dtype}: eager {entry['eager_ms']:.0f} ms, compiled {entry['compiled_ms']:.0f} ms a step, "
                  f"{entry['compile_s']:.0f} s to compile → {entry['choice']}"
                  + (f"; pays back after {pays_min:.1f} min of eager training" if pays_min else "; never pays back"),
                  flush=True)  # fmt: skip
        capture = _capture_trial(target, args.capture_samples, scratch) if args.capture_samples else None
        print(json.dumps({"machine": machine_line(), "threads": torch.get_num_threads(), "runs": results,
                          "capture": capture}))  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _capture_trial(target, n: int, scratch: Path) -> dict:
    """The capture's compile trial (`capture --compile auto`, capture_compile=measure) over `n` samples of
    random lengths from 128 to 1,024 tokens, fp32, one sample a forward."""
    import torch

    from dflashkit.cpu_products.choice import ENV, with_override
    from dflashkit.data.samples import Sample
    from dflashkit.features.capture import CaptureSettings, capture
    from dflashkit.features.capture_compile import CAPTURE_COMPILE, compile_key

    os.environ[ENV] = with_override("capture_compile", "measure")
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(128, 1025, (n,), generator=g).tolist()
    samples = [Sample(f"c{i}", torch.randint(3, target.vocab_size, (t,), generator=g), torch.ones(t, dtype=torch.bool))
               for i, t in enumerate(lengths)]  # fmt: skip
    layers = tuple(range(1, target.num_layers, max(1, target.num_layers // 5)))[:5]
    capture(target, samples, scratch / "features", settings=CaptureSettings(layer_ids=layers, precision="fp32"),
            progress=False)  # fmt: skip
    entry = CAPTURE_COMPILE.stored_choices()[compile_key(target, "fp32")]
    print(f"capture fp32: eager {entry['eager_ms']:.0f} ms, compiled {entry['compiled_ms']:.0f} ms per 1k tokens, "
          f"{entry['compile_s']:.0f} s to compile → {entry['choice']}", flush=True)  # fmt: skip
    return {"samples": n, "tokens": sum(lengths), **entry}


if __name__ == "__main__":
    main()
