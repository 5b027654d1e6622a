"""serve-check's llama.cpp side: the drafter as a GGUF in `llama-speculative-simple` (the build from
scripts/build_llamacpp.sh), round by round against dflashkit's own drafter on the same contexts.

    theirs, ours, ties = llamacpp_side(target, drafter, drafter_gguf, target_gguf, prompt_ids, max_new_tokens)

llama.cpp's loop is not dflashkit's: its first block starts at the last prompt token (dflashkit's prefill makes
the first token), and it drafts no more than the output can still keep. So the rounds themselves differ, and the
check is per llama.cpp round: at each one, dflashkit's drafter (PyTorch, same committed prefix, same first token)
drafts the same slots; both sides' accepted drafts are then counted against the tokens llama.cpp committed.
`theirs` and `ours` are counted over the same rounds and must be equal; the output must equal dflashkit's greedy
output. A slot where the two drafts differ while dflashkit's own top-2 logits are within TIE is a numerical tie
(llama.cpp's F32 kernels sum in another order): it is counted in `ties` and not held against the engine.
The prompt goes to llama.cpp as text (the tool takes no token ids): the ids are decoded with special tokens kept
and must re-encode to themselves, else the check refuses the prompt instead of comparing different inputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflashkit.cpu_products import stock_products
from dflashkit.drafter.heads import BlockSlots
from dflashkit.errors import DFlashError
from dflashkit.export import llamacpp

TIE = 0.02  # |top-1 − top-2| logit margin under which two engines' F32 sums may rank the pair either way


def reference_drafts(
    target: Any, drafter: Any, prompt_ids: list[int], run: llamacpp.SpecRun
) -> list[tuple[list[int], list[float]]]:
    """dflashkit's drafts at each of llama.cpp's rounds (same committed prefix, same first token):
    [(drafts, top-1 − top-2 logit margin per slot)]."""
    cfg = drafter.config
    seq = list(prompt_ids) + run.generated_ids
    pos0 = len(prompt_ids) - 1  # llama.cpp's first block starts at the last prompt token
    out = []
    with torch.no_grad(), stock_products():  # a reference, not a timed path: no product choices measured for it
        for r in run.rounds:
            feats = target.forward(torch.tensor([seq[:pos0]]), layer_ids=cfg.target_layer_ids, logits=False).features
            emb = drafter.block_embeddings(torch.tensor([[seq[pos0]]]), target.embed_weight, cfg.block_size)
            h = drafter(
                feats,
                emb,
                context_positions=torch.arange(pos0)[None],
                block_positions=torch.arange(pos0, pos0 + cfg.block_size)[None],
            )  # (1, block, H)
            first = drafter.first_draft_slot()
            slots = h[0, first : first + r.drafted]  # (n, H)
            logits = drafter.logits(slots, target.lm_head_weight).float()  # (n, V')
            block = BlockSlots(h[0], seq[pos0], seq[pos0 - 1] if pos0 > 0 else seq[pos0])  # as training's first block
            logits = drafter.head.greedy_drafts(drafter, logits, seq[pos0], slots, target.embed_weight, block)[
                1
            ]  # as llama.cpp runs it
            top = logits.topk(2, dim=-1)
            out.append(
                (drafter.to_target_ids(top.indices[:, 0]).tolist(), (top.values[:, 0] - top.values[:, 1]).tolist())
            )
            pos0 += r.accepted + 1
    return out


def prompt_text(tokenizer: Any, ids: list[int]) -> str:
    """The prompt as llama.cpp gets it; refuses ids that do not survive decode → encode."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    again = tokenizer(text, add_special_tokens=False)["input_ids"]
    if list(again) != list(ids):
        raise DFlashError(
            "a prompt's token ids do not re-encode to themselves as text; llama.cpp takes text, so it would run "
            "another prompt — give serve-check prompts from a chat template (the default datasets)"
        )
    return text


def llamacpp_side(
    target: Any,
    drafter: Any,
    drafter_gguf: str | Path,
    target_gguf: str | Path,
    prompt_ids: list[int],
    max_new_tokens: int,
    known_output: list[int] | None = None,
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(theirs, ours, ties): llama.cpp's tokens, rounds and accepted per position, and dflashkit's drafter's
    acceptance on the same rounds (module docstring). `known_output`: dflashkit's greedy output, which fills the
    accepted drafts of rounds llama.cpp does not log (`SpecRun.fill_unlogged`: DFlash2)."""
    slots = drafter.config.block_size - drafter.first_draft_slot()  # drafts a round proposes
    # llama-speculative-simple takes the prompt in one batch and its context defaults to 4096: long prompts need both
    need = len(prompt_ids) + max_new_tokens + slots + 1
    run = llamacpp.run_speculative(
        target_gguf,
        prompt_text(target.tokenizer, prompt_ids),
        drafter=drafter_gguf,
        n_max=slots,
        n_predict=max_new_tokens,
        verbose=True,
        spec_type=drafter.head.format.llamacpp_spec_type,
        extra=["-c", str(max(4096, need)), "-b", str(max(2048, need))],
    )
    if known_output is not None:
        run.fill_unlogged(known_output)
    theirs = {"tokens": run.generated_ids[:max_new_tokens], "drafts": 0, "accepted_per_pos": [0] * slots}
    ours = {"drafts": 0, "accepted_per_pos": [0] * slots}
    ties = 0
    committed = run.generated_ids
    done = 0
    for r, (ref, margin) in zip(run.rounds, reference_drafts(target, drafter, prompt_ids, run), strict=True):
        truth = committed[done : done + r.drafted]  # what the target committed after this round's first token
        if r.drafted:
            theirs["drafts"] += 1
            ours["drafts"] += 1
        for j in range(r.accepted):
            theirs["accepted_per_pos"][j] += 1
        mine = list(ref)
        for j, (a, b) in enumerate(zip(r.draft, ref[: len(r.draft)], strict=True)):  # the logged drafts
            if a != b and margin[j] < TIE:
                ties += 1
                mine[j] = a  # a numerical tie: either ranking is dflashkit's drafter
        k = 0
        while k < len(mine) and k < len(truth) and mine[k] == truth[k]:
            ours["accepted_per_pos"][k] += 1
            k += 1
        done += r.accepted + 1
    return theirs, ours, ties


__all__ = ["TIE", "llamacpp_side", "prompt_text", "reference_drafts"]
