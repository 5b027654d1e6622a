"""Held-out prompts of SECOND and later turns, with the target's own earlier answers in context: the evaluation set
of "does training on every turn help later turns" (docs/studies.md, "Every turn against first turns").

    .venv/bin/python bench/later_turns.py                          # → runs/later_turns/later_turns.jsonl
    .venv/bin/python bench/later_turns.py --conversations 48 --out runs/later_turns
    .venv/bin/python bench/sweep_defaults.py --variants base,server_regen,server_regen_all --seeds 0,1 \\
        --sim-datasets mtbench,humaneval,runs/later_turns/later_turns.jsonl

Takes the first `--conversations` ShareGPT held-out conversations (`sharegpt-heldout`, never trained on) with at least
two user turns, lets the target answer every turn in order (`dflashkit.data.regenerate`, `turns="all"`: through the
target's F32 GGUF on llama-server when scripts/build_llamacpp.sh has built it, else in process), and writes one
pre-tokenised prompt per later turn — `{"id": "<conversation>-t<k>", "prompt_ids": [...]}`: the chat template on the
conversation up to the k-th user turn, with the target's k − 1 replies, and the generation prompt — which `dflashkit
simulate` / `eval` read as a dataset. Prompts longer than `--max-prompt-tokens` are left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflashkit.data.conversations import encode_prompt
from dflashkit.data.datasets import load_dataset
from dflashkit.data.regenerate import RegenSettings, read_regenerated, regenerate
from dflashkit.data.turns import turn_segments
from dflashkit.target.model import Target


def later_turn_prompts(tokenizer: object, record: dict, max_prompt_tokens: int) -> list[dict]:
    """Prompts of turns 2.. of one regenerated conversation (the target's own earlier replies in context)."""
    msgs = record["messages"]
    replies = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    out = []
    for k, i in enumerate(replies[1:], start=2):
        ids = encode_prompt(tokenizer, msgs[:i])
        if len(ids) <= max_prompt_tokens:
            out.append({"id": f"{record['id']}-t{k}", "prompt_ids": ids})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--conversations", type=int, default=32, help="held-out conversations with ≥ 2 user turns")
    p.add_argument("--max-new-tokens", type=int, default=192, help="reply length cap (the quickstart's)")
    p.add_argument(
        "--max-prompt-tokens", type=int, default=896, help="later-turn prompts longer than this are left out"
    )
    p.add_argument("--out", default="runs/later_turns")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    convs = [c for c in load_dataset("sharegpt-heldout", None)[0] if len(turn_segments(c, "all")) >= 2]
    convs = convs[: args.conversations]
    target = Target.load("default")
    from dflashkit.quickstart.server import regen_pool, server_built

    route = "llama-server" if server_built() else "in-process"
    with regen_pool({"regen_route": route}) as pool:
        stats = regenerate(
            target,
            convs,
            out / "regenerated.jsonl",
            servers=pool,
            settings=RegenSettings(
                max_new_tokens=args.max_new_tokens,
                turns="all",
                max_prompt_length=args.max_prompt_tokens,
                concurrency=8,
                batch_size=8,
            ),
        )
    prompts = [q for r in read_regenerated(out / "regenerated.jsonl") for q in later_turn_prompts(
        target.tokenizer, r, args.max_prompt_tokens)]  # fmt: skip
    (out / "later_turns.jsonl").write_text("".join(json.dumps(q) + "\n" for q in prompts))
    print(
        f"{len(convs)} conversations ({route}: {stats.turns} replies, {stats.new_tokens} tokens) → {len(prompts)} "
        f"later-turn prompts in {out / 'later_turns.jsonl'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
