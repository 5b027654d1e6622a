"""Measurement helpers shared by `evaluate` (real decoding) and `simulate` (teacher-forced replay).

- Methods are strings: `ar` (plain autoregressive decoding through the same loop), `chain` (one block, longest
  accepted prefix), `ddtree:B` (DDTree with a budget of B draft nodes; verify length 1 + B).
- Prompts (`Prompt`: an id and token ids) come from a bundled dataset or a chat JSONL rendered with the target's
  chat template (first user turn, `add_generation_prompt=True`), or from a **pre-tokenised JSONL**: lines
  `{"id": "...", "prompt_ids": [3, 14, 15, ...]}` (id optional). Pre-tokenised prompts need no tokenizer, so they
  are the way to evaluate targets that ship none (tiny test models, some exports). Prompts that do not fit the
  context window with `max_new_tokens` are skipped with the reason recorded.
- `acceptance_stats` turns acceptance lengths L (per round, bonus included; one list per prompt) into τ micro
  (Σ L / rounds), τ macro (mean of per-prompt τ), the histogram of L (a list indexed by L), survival
  S(k) = P(L ≥ k + 1) for k = 0 … Lmax − 1, per-position acceptance a_k = S(k) / S(k − 1) (k ≥ 1), the
  full-block fraction (L = Lmax) and the zero-acceptance fraction (L = 1); given the draft tokens the target
  verified (per prompt, counted by the loop: the chain's drafts, the tree's nodes, fewer in a last round cut by
  max_new_tokens), also the accepted / drafted counts (Σ (L − 1), Σ drafted) and their ratio.
- A prompt's `category` (MT-Bench's, a JSONL record's `category` field, else the dataset's name) groups the
  statistics per category (`groups.py`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dflashkit.data.jsonl import LineProblem, read_lines
from dflashkit.data.long_context import NAME as LONG_CONTEXT
from dflashkit.data.long_context import LongContextSpec, long_context_prompts
from dflashkit.drafter.heads import head_of
from dflashkit.errors import ConfigError, DataError
from dflashkit.validation import TreeBudget
from dflashkit.validation import problem as type_problem

METHOD_FORMS = (
    "ar, chain, ddtree:B (B = tree budget, a positive integer, e.g. ddtree:8), ddtree:auto (the budget with the most "
    "tokens/s on this machine, measured: evaluate/budget_choice.py)"
)


# ---------------------------------------------------------------------------------------------- methods
@dataclass(frozen=True)
class Method:
    name: str  # "ar" | "chain" | "ddtree:8" | "ddtree:auto"
    kind: str  # the decode.generate method: "ar" | "chain" | "tree"
    budget: int | None = None  # a tree's budget; None for ddtree:auto until it is chosen (with_budget)

    @property
    def is_auto(self) -> bool:
        """ddtree:auto whose budget is not chosen yet."""
        return self.kind == "tree" and self.budget is None

    def with_budget(self, budget: int) -> Method:
        """ddtree:auto with its chosen budget (the name stays 'ddtree:auto')."""
        return Method(self.name, self.kind, int(budget))

    def max_length(self, block_size: int) -> int:
        """Largest possible acceptance length L (bonus included) for this method and block size."""
        if self.kind == "ar" or block_size < 2:
            return 1
        if self.kind == "tree":
            return 1 + min(int(self.budget or block_size), block_size - 1)
        return block_size


def parse_method(text: str) -> Method:
    s = str(text).strip().lower()
    if s == "ar":
        return Method("ar", "ar")
    if s == "chain":
        return Method("chain", "chain")
    if s in ("ddtree:auto", "ddtree-auto", "tree:auto", "tree-auto"):
        return Method("ddtree:auto", "tree")
    m = re.fullmatch(r"(?:ddtree|tree)[:\-](\d+)", s)
    if m and int(m.group(1)) >= 1:
        why = type_problem(TreeBudget, int(m.group(1)))
        if why:
            raise ConfigError(f"method {text!r}: the budget {why}")
        return Method(f"ddtree:{int(m.group(1))}", "tree", int(m.group(1)))
    raise ConfigError(f"unknown method {text!r}: valid forms are {METHOD_FORMS}")


def parse_methods(spec: str | Sequence[str]) -> list[Method]:
    """'ar,chain,ddtree:8' or a list of such names → Methods (order kept, duplicates dropped)."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[Method] = []
    for item in items:
        if str(item).strip():
            m = parse_method(item)
            if m not in out:
                out.append(m)
    if not out:
        raise ConfigError(f"no methods given: expected a comma-separated list of {METHOD_FORMS}")
    return out


# ---------------------------------------------------------------------------------------------- prompts
@dataclass
class Prompt:
    id: str
    ids: list[int]
    category: str = ""  # MT-Bench's category, a JSONL record's `category`, else the dataset's name


def prompt_sha(ids: Sequence[int]) -> str:
    """Short digest of a prompt's token ids (resumed runs must see the same prompt under the same id)."""
    import hashlib

    return hashlib.sha256(json.dumps([int(t) for t in ids]).encode()).hexdigest()[:16]


def _read_pretokenised(path: Path, limit: int | None, on_error: str = "stop") -> list[tuple[int, Prompt | str]]:
    """(line number, prompt or problem) per line of a pre-tokenised JSONL, in order; ids are not yet checked
    against a vocabulary. Bad lines raise (on_error="stop") or are kept as their problem. With "skip" every line is
    read (a prompt whose ids the target's vocabulary lacks is skipped later and must not count towards `limit`)."""
    out: list[tuple[int, Prompt | str]] = []
    prompts = 0
    seen: set[str] = set()
    for line in read_lines(path):
        if limit is not None and on_error == "stop" and prompts >= limit:
            break
        try:
            rec = line.json()
            ids = rec.get("prompt_ids") if isinstance(rec, dict) else None
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
            ):
                raise ValueError(
                    "field 'prompt_ids': expected a non-empty list of token ids (a file with pre-tokenised prompts "
                    "needs it on every line)"
                )
            pid = str(rec.get("id", f"{path.stem}-{line.number}"))
            if pid in seen:
                raise ValueError(f"field 'id': duplicate id {pid!r}")
            category = rec.get("category", path.stem)
            if not isinstance(category, str) or not category.strip():
                raise ValueError("field 'category': expected a non-empty string")
        except ValueError as e:
            if on_error == "stop":
                raise DataError(f"{path}:{line.number}: {e} (use --on-error skip to skip malformed lines)") from None
            out.append((line.number, f"{path}:{line.number}: {e}"))
            continue
        seen.add(pid)
        out.append((line.number, Prompt(pid, list(ids), category.strip())))
        prompts += 1
    if not prompts:
        raise DataError(f"{path}: no prompts" + (f" ({len(out)} malformed lines, first: {out[0][1]})" if out else ""))
    return out


def _in_vocabulary(records: PromptRecords, vocab_size: int) -> tuple[list[Prompt], list[str]]:
    """The pre-tokenised prompts whose ids all lie in [0, vocab_size), up to the limit; others raise or are
    recorded as problems, as a malformed line is: those of the lines up to the limit, in line order."""
    out: list[Prompt] = []
    problems: list[str] = []
    for number, prompt in records.pretokenised or []:
        if isinstance(prompt, str):  # a malformed line (on_error="skip")
            problems.append(prompt)
            continue
        if all(t < vocab_size for t in prompt.ids):
            out.append(prompt)
            if records.limit is not None and len(out) >= records.limit:
                break  # lines after it are not the run's
            continue
        problem = (
            f"{records.source}:{number}: field 'prompt_ids': expected token ids in [0, {vocab_size}) "
            f"(the target's vocabulary); found {max(prompt.ids)}"
        )
        if records.on_error == "stop":
            raise DataError(f"{problem} (use --on-error skip to skip malformed lines)")
        problems.append(problem)
    if not out:
        raise DataError(
            f"{records.source}: no prompts within the target's vocabulary of {vocab_size} (first: {problems[0]})"
        )
    return out, problems


def _is_pretokenised(path: Path) -> bool:
    """Whether the first readable line of a JSONL file carries "prompt_ids"."""
    if not path.is_file():
        return False
    for line in read_lines(path):
        try:
            rec = line.json()
        except LineProblem:  # unreadable: the reader of either format reports (or skips) it with file:line
            continue
        return isinstance(rec, dict) and "prompt_ids" in rec
    return False


@dataclass
class PromptRecords:
    """A dataset's prompts as read from disk, before any target is at hand: a malformed file fails before a large
    model loads. `prompts_for` turns them into a target's token ids."""

    source: str  # the dataset name or file
    limit: int | None
    on_error: str  # "stop" | "skip"
    conversations: list[Any] | None = None  # chat records (data.conversations.Conversation), rendered later
    pretokenised: list[tuple[int, Prompt | str]] | None = None  # (line, prompt or problem) of a pre-tokenised file
    long_context: Sequence[int] | None = None  # the long-context set's lengths (built from the target's tokenizer)
    problems: list[str] = field(default_factory=list)  # malformed chat records skipped with on_error="skip"


def read_prompts(
    dataset: str | Path, *, limit: int | None = None, on_error: str = "stop", lengths: Sequence[int] | None = None
) -> PromptRecords:
    """Read a dataset name or JSONL path (chat records or pre-tokenised lines) without a target. `long-context`
    (data/long_context.py) is built later, for the target: `lengths` are its prompt lengths; `limit` prompts in all,
    spread over them (default: 6 per length)."""
    from dflashkit.data.datasets import load_dataset

    if limit is not None and limit < 1:
        raise DataError(f"limit={limit}: expected a positive number of prompts")
    if on_error not in ("stop", "skip"):
        raise DataError(f"on_error={on_error!r}: expected 'stop' or 'skip'")
    if str(dataset) == LONG_CONTEXT:  # built per target, in prompts_for
        return PromptRecords(LONG_CONTEXT, limit, on_error, long_context=tuple(lengths or LongContextSpec().lengths))
    path = Path(str(dataset)).expanduser()
    if _is_pretokenised(path):
        return PromptRecords(str(path), limit, on_error, pretokenised=_read_pretokenised(path, limit, on_error))
    conversations, problems = load_dataset(dataset, limit, on_error=on_error, categories=True)  # type: ignore[arg-type]
    return PromptRecords(str(dataset), limit, on_error, conversations=conversations, problems=problems)


def prompts_for(
    target: Any,
    records: PromptRecords,
    *,
    max_new_tokens: int = 128,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[Prompt], dict[str, str]]:
    """The target's prompts of read records. Returns (prompts, skipped: id → reason)."""
    from dflashkit.data.conversations import encode_prompt, prompt_messages

    skipped: dict[str, str] = {}
    problems = list(records.problems)
    max_pos = getattr(target.text_config, "max_position_embeddings", None)
    if records.long_context is not None:
        spec = LongContextSpec(
            lengths=records.long_context,
            max_tokens=None if max_pos is None else max_pos - max_new_tokens,
            max_tokens_why=f"the target's {max_pos} positions minus the {max_new_tokens} new tokens (--max-new-tokens)",
        )
        if records.limit is not None:  # rounds over the lengths: the first `limit` cover them evenly
            spec = replace(spec, per_length=-(-records.limit // max(1, len(spec.targets()))))
        built = long_context_prompts(target.tokenizer, spec, chat_template_kwargs)[: records.limit]
        prompts = [Prompt(p.id, p.ids, p.category) for p in built]
    elif records.conversations is None:
        prompts, vocab_problems = _in_vocabulary(records, int(target.vocab_size))
        problems += vocab_problems
    else:
        tok = target.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise DataError(
                f"target {target.source} has no tokenizer with a chat template; give pre-tokenised "
                f'prompts instead: a JSONL file with lines {{"id": ..., "prompt_ids": [...]}}'
            )
        prompts = []
        default = Path(records.source).stem if Path(records.source).suffix else records.source
        for conv in records.conversations:
            try:
                ids = encode_prompt(tok, prompt_messages(conv), chat_template_kwargs)
                prompts.append(Prompt(conv.id, ids, str(conv.meta.get("category") or default)))
            except DataError as e:
                skipped[conv.id] = str(e)
    for k, problem in enumerate(problems):
        skipped[f"unreadable-record-{k}"] = problem
    kept = []
    for p in prompts:
        if max_pos is not None and len(p.ids) + max_new_tokens > max_pos:
            skipped[p.id] = (
                f"prompt of {len(p.ids)} tokens + max_new_tokens {max_new_tokens} exceeds the context "
                f"window of {max_pos}"
            )
        else:
            kept.append(p)
    if not kept:
        raise DataError(
            f"dataset {records.source}: no usable prompts ({len(skipped)} skipped; first: "
            f"{next(iter(skipped.values()), 'none')})"
        )
    return kept, skipped


def load_prompts(
    target: Any,
    dataset: str | Path,
    *,
    limit: int | None = None,
    max_new_tokens: int = 128,
    chat_template_kwargs: dict[str, Any] | None = None,
    on_error: str = "stop",
) -> tuple[list[Prompt], dict[str, str]]:
    """Prompts of a dataset name or JSONL path for `target` (`read_prompts`, then `prompts_for`). Returns
    (prompts, skipped: id → reason). on_error="skip": malformed JSONL lines are skipped and recorded in `skipped`
    ("unreadable-record-K")."""
    records = read_prompts(dataset, limit=limit, on_error=on_error)
    return prompts_for(target, records, max_new_tokens=max_new_tokens, chat_template_kwargs=chat_template_kwargs)


# ---------------------------------------------------------------------------------------------- statistics
def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def acceptance_stats(
    lengths: Sequence[Sequence[int]], max_length: int, drafted: Sequence[int] | None = None
) -> dict[str, Any]:
    """Statistics of acceptance lengths (one list of L per prompt); `max_length` = the method's largest L;
    `drafted` (the draft tokens verified, one total per prompt) adds the accepted / drafted counts."""
    flat = [int(x) for per in lengths for x in per]
    rounds = len(flat)
    hist = [0] * (max(max_length, max(flat, default=1)) + 1)
    for x in flat:
        hist[x] += 1
    survival = [sum(hist[k + 1 :]) / rounds if rounds else None for k in range(max_length)]  # S(k) = P(L ≥ k+1)
    per_pos: list[float | None] = []
    for k in range(1, max_length):
        prev, cur = survival[k - 1], survival[k]
        per_pos.append(cur / prev if prev else None)
    per_prompt = [sum(per) / len(per) for per in lengths if per]
    return {
        "rounds": rounds,
        "accepted_tokens": sum(flat),
        "tau_micro": sum(flat) / rounds if rounds else None,
        "tau_macro": _mean(per_prompt),
        "max_length": max_length,
        "histogram": hist,
        "survival": survival,
        "per_position_acceptance": per_pos,
        "full_block_fraction": hist[max_length] / rounds if rounds and max_length < len(hist) else None,
        "zero_accept_fraction": hist[1] / rounds if rounds and len(hist) > 1 else None,
        **({} if drafted is None else _draft_counts(flat, sum(drafted))),
    }


def _draft_counts(flat: list[int], drafted: int) -> dict[str, Any]:
    """Accepted drafts Σ (L − 1) (those the output keeps), the drafts verified, and accepted ÷ drafted."""
    accepted = sum(flat) - len(flat)
    return {"accepted_drafts": accepted, "drafted": drafted, "acceptance_rate": accepted / drafted if drafted else None}


# ---------------------------------------------------------------------------------------------- identities
def drafter_fingerprint(drafter: Any) -> str:
    """Cheap identity of a drafter: its config, parameter shapes and the head of every tensor (bf16-rounded)."""
    import hashlib

    import torch

    h = hashlib.sha256(json.dumps(drafter.config.to_dict(), sort_keys=True, default=str).encode())
    for name, t in sorted(drafter.state_dict().items()):
        if name.startswith("rotary_emb."):
            continue
        h.update(f"{name}:{list(t.shape)};".encode())
        head = t.detach().reshape(-1)[:64].cpu()
        h.update((head.to(torch.bfloat16).view(torch.int16) if head.is_floating_point() else head).numpy().tobytes())
    return h.hexdigest()[:16]


def verify_width(drafter: Any, block_size: int | None = None) -> int:
    """1 + the drafts a round proposes — what `Method.max_length` takes as the block size: the block size for DFlash
    (slot 0 holds the given token), one more for DSpark (every slot drafts)."""
    return head_of(drafter.config).verify_width(int(block_size or drafter.config.block_size))


def drafter_info(drafter: Any, *, source: str | None = None, block_size: int | None = None) -> dict[str, Any]:
    cfg = drafter.config
    return {
        "source": source,
        "kind": getattr(cfg, "kind", "dflash"),
        "block_size": int(block_size or cfg.block_size),
        "target_layer_ids": list(cfg.target_layer_ids),
        "num_hidden_layers": cfg.num_hidden_layers,
        "parameters": sum(p.numel() for p in drafter.parameters()),
        "fingerprint": drafter_fingerprint(drafter),
    }


def context_notes(drafters: dict[str, Any], context_tokens: int) -> list[str]:
    """Notes for results.json: per drafter, why it may accept less at the longest context evaluated
    (drafter.context_reach)."""
    from dflashkit.drafter.context_reach import context_warnings

    return [
        f"drafter {name!r}: {w}" for name, d in drafters.items() for w in context_warnings(d.config, context_tokens)
    ]


def target_info(target: Any) -> dict[str, Any]:
    """What results and caches record about the target (the fingerprint keys resumption)."""
    from dflashkit.features.manifest import target_fingerprint

    return {
        "source": target.source,
        "fingerprint": target_fingerprint(target),
        "architecture": target.architecture,
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "dtype": str(target.dtype).replace("torch.", ""),
        "device": str(target.device),
        "hybrid": target.is_hybrid,
    }
