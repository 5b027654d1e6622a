"""How often re-tokenising a regenerated reply's text gives other ids than the target generated — what a server that
returns text only would cost (`dflashkit prepare --server` keeps the server's ids where it returns them).

    .venv/bin/python bench/retokenize.py runs/later_turns/regenerated.jsonl [more regenerated.jsonl …]

For every reply of each file (first-turn `response_token_ids` or every `turn_token_ids` list): decode the ids without
special tokens, tokenise the text again (no special tokens added) and compare with the ids minus the end-of-turn
token. Prints one line per file: replies, how many differ, and the first differing example's position.
"""

from __future__ import annotations

import json
import sys

from dflashkit.data.conversations import end_of_turn_ids
from dflashkit.target.model import TargetText


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        raise SystemExit("usage: bench/retokenize.py REGENERATED.jsonl [...]")
    text = TargetText.load(None)
    tok, stops = text.tokenizer, set(end_of_turn_ids(text.tokenizer, text.eos_token_id))
    for path in paths:
        replies = differ = 0
        example = ""
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                for ids in rec.get("turn_token_ids") or [rec["response_token_ids"]]:
                    body = ids[:-1] if ids and ids[-1] in stops else ids
                    again = tok(tok.decode(ids, skip_special_tokens=True), add_special_tokens=False)["input_ids"]
                    replies += 1
                    if again != body:
                        differ += 1
                        at = next(
                            (i for i, (a, b) in enumerate(zip(again, body, strict=False)) if a != b),
                            min(len(again), len(body)),
                        )
                        example = example or f"{rec['id']}: from token {at} of {len(body)}"
        print(f"{path}: {replies} replies, {differ} re-tokenise to other ids ({100 * differ / max(replies, 1):.1f} %)"
              + (f"; e.g. {example}" if example else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
