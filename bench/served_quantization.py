"""One drafter's acceptance where llama-server serves the target at the precisions users serve: F32, Q8_0, the shipped
Q4_1 and two re-quantized 4-bit types (Q4_0, Q4_K_M, made by llama-quantize from the F32 GGUF) — per position, from
the server's own counters, through `serve-check --server` (export/served.py).

    scripts/build_llamacpp.sh                                     # once
    .venv/bin/python bench/served_quantization.py --drafter runs/quickstart/drafter --prompts 8 --max-new-tokens 64

Per target type: llama-server (`-md drafter.gguf --spec-type draft-dflash --spec-draft-n-max block−1 --metrics`, one
slot, 2 threads), MT-Bench turn-1 prompts (`--dataset`), greedy. Columns: the engine's drafts, accepted per position
and τ; dflashkit's τ on the server's own output (what the drafter accepts on that output with the trained target's
features); the share of prompts whose output equals the fp32 target's greedy output; the causes serve-check names.
The F32 row is the reference: the engine equals dflashkit there. Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TYPES = ("F32", "Q8_0", "Q4_1", "Q4_0", "Q4_K_M")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", required=True, help="a drafter checkpoint for the embedded SmolLM2 target")
    ap.add_argument("--dataset", default="mtbench")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--types", default=",".join(TYPES), help=f"target GGUF types (of {', '.join(TYPES)})")
    args = ap.parse_args()

    import tempfile

    from dflashkit.cpu_products.machine import machine_line
    from dflashkit.data.conversations import prompt_messages
    from dflashkit.evaluate.stats import prompts_for, read_prompts
    from dflashkit.export import llamacpp
    from dflashkit.export.convert import load_any_drafter
    from dflashkit.export.gguf_export import export_gguf
    from dflashkit.export.llama_server import LlamaServer
    from dflashkit.export.serve_check import tau
    from dflashkit.export.served import ServedSettings, check_server
    from dflashkit.target.default import gguf_path
    from dflashkit.target.model import Target

    target = Target.load("default")
    drafter = load_any_drafter(args.drafter, target=target).eval()
    records = read_prompts(args.dataset, limit=args.prompts)
    prompts, _ = prompts_for(target, records, max_new_tokens=args.max_new_tokens)
    chats = {c.id: prompt_messages(c) for c in (records.conversations or [])}
    items = [SimpleNamespace(id=p.id, ids=list(p.ids), messages=chats.get(p.id)) for p in prompts]
    n_max = drafter.config.block_size - drafter.first_draft_slot()
    print(f"# {machine_line()}; llama.cpp {llamacpp.VERSION}; drafter {args.drafter}; {len(items)} prompts × "
          f"{args.max_new_tokens} tokens, greedy", flush=True)  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory(prefix="dflashkit-quant-") as tmp:
        gguf = Path(tmp) / "drafter.gguf"
        export_gguf(args.drafter, gguf, target=llamacpp.f32_target_gguf(), outtype="f32")
        for kind in args.types.split(","):
            path = gguf_path() if kind == "Q4_1" else llamacpp.target_gguf(kind)
            extra = ["-md", str(gguf), "--spec-type", drafter.head.format.llamacpp_spec_type or "draft-dflash"]
            extra += ["--spec-draft-n-max", str(n_max), "--metrics"]
            t0 = time.monotonic()
            with LlamaServer(path, slots=1, threads=2, extra_args=extra) as srv:
                report = check_server(target, drafter, srv.url, items, settings=ServedSettings(args.max_new_tokens))
            s = report.summary()
            row = {
                "type": kind,
                "drafts": s["engine"]["drafts"],
                "accepted_per_pos": s["engine"]["accepted_per_pos"],
                "tau_engine": s["engine"]["tau"],
                "tau_dflashkit_on_output": s["dflashkit_on_server_output"]["tau"],
                "tau_dflashkit_fp32": round(tau([p.own for p in report.prompts]), 4),
                "same_output": sum(p.same_tokens for p in report.prompts),
                "causes": [f.cause for f in report.findings],
                "seconds": round(time.monotonic() - t0, 1),
            }
            rows.append(row)
            same = f"{row['same_output']}/{len(items)}"
            print(f"{kind:<7} drafts {row['drafts']:>4}  accepted/pos {row['accepted_per_pos']!s:<18} τ engine "
                  f"{row['tau_engine']:.3f}  τ dflashkit on its output {row['tau_dflashkit_on_output']:.3f}  "
                  f"same output {same}  causes {row['causes'] or '—'}", flush=True)  # fmt: skip
    print(json.dumps({"bench": "served_quantization", "machine": machine_line(), "drafter": args.drafter,
                      "prompts": len(items), "max_new_tokens": args.max_new_tokens, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
