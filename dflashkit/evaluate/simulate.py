"""Teacher-forced τ from cached target transcripts: many drafters, chain and DDTree, no target forward at all.

    cache = build_transcripts(target, prompts, "runs/transcripts", max_new_tokens=256, layer_ids=[1, 8, 14, 20, 27])
    results = simulate_many({"a": drafter_a, "b": drafter_b}, cache, tree_budgets=[4, 8, 16])

`build_transcripts` runs the target once per prompt (greedy, `decode.generate(method="ar")`), then one forward over
prompt + continuation capturing the union of the requested layers. Each prompt is one file `pNNNNN.safetensors`
with `input_ids` (T,) and one tensor per layer, `layer{L}` (T, H), stored **separately**, so drafters reading
different layer sets run from the same cache. The embedding table and LM head (which every drafter borrows) are
stored once in `head.safetensors`. `manifest.json` records the target (source, fingerprint, layers, hidden size),
the layers stored, the generation settings and every finished prompt; a rerun skips finished prompts.

Greedy verification is a pure function of the target's greedy continuation: on the accepted path, the target's
argmax at each node *is* the next transcript token, and nodes off the path are never followed. So `simulate`
replays the real loop (decode.py) exactly: bonus at position s, the drafter cache extended with the features of
the tokens committed last round (the prompt first), the full block [token[s], MASK × (bs−1)] at positions s…
(also in the last round), of which the first min(bs − 1, room) drafts are used; chain L = 1 + longest prefix of
those drafts equal to the transcript; DDTree-B builds the tree (depth ≤ room) from their marginals and follows the
transcript's tokens; s advances by L. At temperature 0 it gives the same acceptance lengths as
`generate(method="chain"/"tree")`, up to floating-point near-ties between the transcript's one-pass features and
the loop's incremental ones.

Limits: greedy only. When a transcript ends on a stop token, the target's continuation past it is unknown, so a
final round that accepts through the stop token stops there (the real loop may count more drafts past it). Hybrid
targets (Gated DeltaNet layers) are no exception: `decode.generate(method="tree")` verifies the whole tree exactly
there too (hybrid_tree.py), so the DDTree rows are what the real loop accepts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

from dflashkit.decode.generate import generate
from dflashkit.errors import DataError, TargetError
from dflashkit.evaluate.stats import (Method, Prompt, acceptance_stats, drafter_info, parse_method, parse_methods,
                                  prompt_sha, target_info)
from dflashkit.io_utils import atomic_path, atomic_write_text
from dflashkit.drafter.model import DFlashDrafter, DrafterCache
from dflashkit.target.model import Target
from dflashkit.decode.tree import build_tree

FORMAT, VERSION = "dflashkit.transcripts", 1
MANIFEST, HEAD_FILE = "manifest.json", "head.safetensors"


def _as_prompts(prompts: Sequence[Prompt | Sequence[int]]) -> list[Prompt]:
    return [p if isinstance(p, Prompt) else Prompt(str(i), [int(t) for t in p]) for i, p in enumerate(prompts)]


# ---------------------------------------------------------------------------------------------- the cache
@dataclass
class Transcript:
    id: str
    ids: list[int]                 # prompt + the target's greedy continuation
    prompt_len: int
    stop_reason: str
    layers: dict[int, Tensor]      # layer id → (T, H) output of that decoder layer

    def features(self, layer_ids: Sequence[int]) -> Tensor:
        """(1, T, K·H): the requested layers concatenated in the drafter's order (as Target.forward does)."""
        return torch.cat([self.layers[int(i)] for i in layer_ids], dim=-1)[None]


class TranscriptCache:
    """A transcript directory written by `build_transcripts`; every read is checked against the manifest."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        mpath = self.path / MANIFEST
        if not mpath.is_file():
            raise DataError(f"{self.path}: no {MANIFEST} (expected a transcript cache written by build_transcripts "
                            f"/ `dflashkit simulate --cache`)")
        try:
            m = json.loads(mpath.read_text())
            ok = m.get("format") == FORMAT and isinstance(m.get("prompts"), list) and isinstance(m.get("layer_ids"), list)
        except (json.JSONDecodeError, AttributeError):
            ok = False
        if not ok:
            raise DataError(f"{mpath}: not a dflashkit transcript manifest (expected format {FORMAT!r} with "
                            f"'prompts' and 'layer_ids'); delete {self.path} to rebuild it")
        if m.get("version") != VERSION:
            raise DataError(f"{mpath}: transcript cache version {m.get('version')}, this dflashkit reads {VERSION}; "
                            f"delete {self.path} to rebuild it")
        self.manifest: dict[str, Any] = m

    @property
    def layer_ids(self) -> list[int]:
        return [int(i) for i in self.manifest["layer_ids"]]

    @property
    def max_new_tokens(self) -> int:
        return int(self.manifest["max_new_tokens"])

    @property
    def entries(self) -> list[dict[str, Any]]:
        return self.manifest["prompts"]

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[Transcript]:
        for i in range(len(self)):
            yield self.load(i)

    def load(self, index: int) -> Transcript:
        from safetensors.torch import load_file

        e = self.entries[index]
        file = self.path / e["file"]
        try:
            tensors = load_file(str(file))
        except Exception as exc:  # missing, truncated or not safetensors
            raise DataError(f"{file}: unreadable transcript ({exc}); delete {self.path} to rebuild the cache") from None
        t_len = int(e["prompt_len"]) + int(e["num_tokens"])
        hidden = int(self.manifest["target"]["hidden_size"])
        ids = tensors.get("input_ids")
        if ids is None or tuple(ids.shape) != (t_len,):
            raise DataError(f"{file}: tensor 'input_ids' missing or not of shape ({t_len},) as the manifest says; "
                            f"delete {self.path} to rebuild the cache")
        layers = {}
        for layer in self.layer_ids:
            t = tensors.get(f"layer{layer}")
            if t is None or tuple(t.shape) != (t_len, hidden):
                raise DataError(f"{file}: tensor 'layer{layer}' missing or not of shape ({t_len}, {hidden}); delete "
                                f"{self.path} to rebuild the cache")
            layers[layer] = t
        return Transcript(str(e["id"]), ids.tolist(), int(e["prompt_len"]), str(e["stop_reason"]), layers)

    def head(self) -> tuple[Tensor, Tensor]:
        """(embedding table, LM head weight) of the target, as stored with the transcripts."""
        from safetensors.torch import load_file

        file = self.path / HEAD_FILE
        try:
            t = load_file(str(file))
            embed = t["embed"]
            return embed, t.get("lm_head", embed)
        except Exception as exc:
            raise DataError(f"{file}: unreadable target head ({exc}); delete {self.path} to rebuild the cache") from None

    def check_drafter(self, drafter: DFlashDrafter, source: str = "drafter") -> None:
        """The check_drafter_fits of a cache: hidden size, vocabulary, target depth, and layers stored."""
        cfg, tgt = drafter.config, self.manifest["target"]
        problems = []
        if cfg.hidden_size != tgt["hidden_size"]:
            problems.append(f"hidden_size {cfg.hidden_size} ≠ the target's {tgt['hidden_size']}")
        if cfg.vocab_size != tgt["vocab_size"]:
            problems.append(f"vocab_size {cfg.vocab_size} ≠ the target's {tgt['vocab_size']}")
        if cfg.num_target_layers != tgt["num_layers"]:
            problems.append(f"num_target_layers {cfg.num_target_layers} ≠ the target's {tgt['num_layers']}")
        missing = sorted(set(cfg.target_layer_ids) - set(self.layer_ids))
        if missing:
            problems.append(f"target layers {missing} are not in the cache (it stores {self.layer_ids}; rebuild it "
                            f"with the union of every drafter's layers)")
        if problems:
            raise TargetError(f"{source} does not fit the transcripts in {self.path} ({tgt['source']}): "
                              + "; ".join(problems))


def build_transcripts(target: Target, prompts: Sequence[Prompt | Sequence[int]], out_dir: str | Path, *,
                      max_new_tokens: int, layer_ids: Sequence[int], stop_token_ids: Sequence[int] = (),
                      progress: bool = True) -> TranscriptCache:
    """Greedy target transcripts + per-layer features of `prompts` in `out_dir` (resumable per prompt)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if max_new_tokens < 1:
        raise DataError(f"max_new_tokens={max_new_tokens}: expected a positive integer")
    layers = sorted({int(i) for i in layer_ids})
    target.check_layer_ids(layers)
    stops = sorted({int(t) for t in stop_token_ids})
    fresh = {"format": FORMAT, "version": VERSION, "target": target_info(target), "layer_ids": layers,
             "max_new_tokens": int(max_new_tokens), "stop_token_ids": stops, "prompts": []}
    if (out / MANIFEST).exists():
        m = TranscriptCache(out).manifest
        for key, want, have in (("target.fingerprint", fresh["target"]["fingerprint"], m["target"].get("fingerprint")),
                                ("max_new_tokens", fresh["max_new_tokens"], m.get("max_new_tokens")),
                                ("stop_token_ids", stops, m.get("stop_token_ids"))):
            if want != have:
                raise DataError(f"{out / MANIFEST}: cache built with {key} = {have}, this run asks for {want}; "
                                f"use another cache directory or delete this one")
        if not set(layers) <= set(m["layer_ids"]):
            raise DataError(f"{out / MANIFEST}: cache stores layers {m['layer_ids']}, this run needs {layers}; use "
                            f"another cache directory or delete this one (build it with the union of all layers)")
        layers = [int(i) for i in m["layer_ids"]]
    else:
        m = fresh
        head = {"embed": target.embed_weight.detach().cpu().contiguous()}
        tied = target.lm_head_weight.data_ptr() == target.embed_weight.data_ptr()
        if not tied:
            head["lm_head"] = target.lm_head_weight.detach().cpu().contiguous()
        with atomic_path(out / HEAD_FILE) as tmp:
            save_file(head, str(tmp))
        m["head"] = {"file": HEAD_FILE, "tied": tied}
    done = {e["id"]: e for e in m["prompts"]}
    todo = []
    prompts = _as_prompts(prompts)
    if len({p.id for p in prompts}) != len(prompts):
        raise DataError("prompt ids must be unique (they key the transcript cache)")
    for p in prompts:
        e = done.get(p.id)
        if e is None:
            todo.append(p)
        elif e["prompt_sha"] != prompt_sha(p.ids):
            raise DataError(f"{out / MANIFEST}: prompt {p.id!r} is cached with different token ids; use another cache "
                            f"directory or delete this one")
    hidden = target.hidden_size
    for p in tqdm(todo, desc="transcripts", unit="prompt", disable=not progress or not todo):
        try:
            res = generate(target, p.ids, method="ar", max_new_tokens=max_new_tokens, stop_token_ids=stops)
        except ValueError as e:
            raise DataError(f"prompt {p.id!r}: {e}") from None
        full = torch.tensor(p.ids + res.tokens, dtype=torch.long)[None]           # (1, T)
        feats = target.forward(full, layer_ids=layers, logits=False).features[0]  # (T, K·H)
        tensors = {"input_ids": full[0].contiguous()}
        for j, layer in enumerate(layers):
            tensors[f"layer{layer}"] = feats[:, j * hidden:(j + 1) * hidden].detach().cpu().contiguous()  # (T, H)
        index = len(m["prompts"])
        name = f"p{index:05d}.safetensors"
        with atomic_path(out / name) as tmp:
            save_file(tensors, str(tmp), metadata={"id": p.id})
        m["prompts"].append({"index": index, "id": p.id, "file": name, "prompt_len": len(p.ids),
                             "num_tokens": len(res.tokens), "stop_reason": res.stop_reason,
                             "prompt_sha": prompt_sha(p.ids)})
        atomic_write_text(out / MANIFEST, json.dumps(m, indent=1) + "\n")
    if not (out / MANIFEST).exists():
        atomic_write_text(out / MANIFEST, json.dumps(m, indent=1) + "\n")
    return TranscriptCache(out)


# ---------------------------------------------------------------------------------------------- replay
def _tree_length(draft_logits: Tensor, root: int, truth: list[int], drafter: DFlashDrafter, budget: int,
                 top_k: int | None, force_spine: bool) -> int:
    tree = build_tree(torch.log_softmax(draft_logits, dim=-1), root, budget=budget, top_k=top_k,
                      force_spine=force_spine)
    if drafter.config.draft_vocab_size is not None:
        tree.tokens[1:] = drafter.to_target_ids(tree.tokens[1:])
    tokens, table = tree.tokens.tolist(), tree.child_table()
    cur = depth = 0
    while depth < len(truth):  # the target's token at a node on the true path is the next transcript token
        nxt = next((c for c in table[cur] if tokens[c] == truth[depth]), None)
        if nxt is None:
            break
        cur, depth = nxt, depth + 1
    return depth + 1


@torch.no_grad()
def replay(drafter: DFlashDrafter, transcript: Transcript, *, embed_weight: Tensor, lm_head_weight: Tensor,
           max_new_tokens: int, method: Method, block_size: int | None = None, tree_top_k: int | None = None,
           force_spine: bool = False) -> list[int]:
    """Acceptance lengths (per round, bonus included) of `method` on one fixed greedy transcript."""
    ids, p_len = transcript.ids, transcript.prompt_len
    last = len(ids) - 1
    bs = block_size or drafter.config.block_size
    lengths: list[int] = []
    if method.kind == "ar" or bs < 2:  # one token per round, exactly as the loop without a drafter
        return [1] * max(0, min(last, p_len + max_new_tokens - 1) - p_len)
    feats = transcript.features(drafter.config.target_layer_ids).to(drafter.device)  # (1, T, K·H)
    dcache = DrafterCache()
    new_ctx, new_pos = feats[:, :p_len], torch.arange(p_len)[None]
    s = p_len                                                   # position of the bonus token
    while s - p_len + 1 < max_new_tokens and s < last:
        room = max_new_tokens - (s - p_len + 1)
        n_verify = min(bs - 1, room)                            # drafts that can still be committed (as decode.py)
        embeds = drafter.block_embeddings(torch.tensor([[ids[s]]]), embed_weight, bs)  # always the full block
        hidden = drafter(new_ctx, embeds, context_positions=new_pos,
                         block_positions=torch.arange(s, s + bs)[None], cache=dcache)
        draft_logits = drafter.logits(hidden[0, 1:n_verify + 1], lm_head_weight).float()  # (nv, V')
        truth = ids[s + 1: s + 1 + n_verify]                    # the target's greedy tokens at the used draft slots
        if method.kind == "tree":
            L = _tree_length(draft_logits, ids[s], truth, drafter, int(method.budget), tree_top_k, force_spine)
        else:
            drafts = drafter.to_target_ids(draft_logits.argmax(-1)).tolist()
            acc = 0
            while acc < len(truth) and drafts[acc] == truth[acc]:
                acc += 1
            L = acc + 1
        lengths.append(L)
        new_ctx, new_pos = feats[:, s:s + L], torch.arange(s, s + L)[None]
        s += L
    return lengths


def _sim_methods(tree_budgets: Sequence[int], chain: bool, methods: Sequence[str] | None) -> list[Method]:
    if methods is not None:
        out = [m for m in parse_methods(methods) if m.kind != "ar"]
    else:
        out = ([Method("chain", "chain")] if chain else []) + [parse_method(f"ddtree:{b}") for b in tree_budgets]
    if not out:
        raise DataError("nothing to simulate: give chain and/or tree budgets")
    return out


def simulate_many(drafters: dict[str, DFlashDrafter], transcripts: str | Path | TranscriptCache, *,
                  block_size: int | None = None, tree_budgets: Sequence[int] = (4, 8, 16),
                  tree_top_k: int | None = None,
                  chain: bool = True, methods: Sequence[str] | None = None, prompt_ids: Sequence[str] | None = None,
                  force_spine: bool = False, progress: bool = True) -> dict[str, dict[str, dict[str, Any]]]:
    """Teacher-forced acceptance statistics of every drafter × method on one transcript cache.

    Returns {drafter name: {method name: stats}}, stats as `eval_stats.acceptance_stats` plus `per_prompt`
    (prompt id → list of L). Methods: `methods` (names, `ar` ignored) or chain + ddtree:B for each budget.
    """
    from tqdm import tqdm

    cache = transcripts if isinstance(transcripts, TranscriptCache) else TranscriptCache(transcripts)
    todo = _sim_methods(tree_budgets, chain, methods)
    for name, d in drafters.items():
        cache.check_drafter(d, source=f"drafter {name!r}")
    indices = list(range(len(cache)))
    if prompt_ids is not None:
        where = {e["id"]: i for i, e in enumerate(cache.entries)}
        missing = [p for p in prompt_ids if p not in where]
        if missing:
            raise DataError(f"{cache.path}: prompts {missing[:5]} are not in the transcript cache")
        indices = [where[p] for p in prompt_ids]
    embed, head = cache.head()
    per: dict[str, dict[str, dict[str, list[int]]]] = {n: {m.name: {} for m in todo} for n in drafters}
    heads = {}
    for t_index in tqdm(indices, desc="simulate", unit="prompt", disable=not progress):
        tr = cache.load(t_index)
        for name, d in drafters.items():
            if d.device not in heads:
                heads[d.device] = (embed.to(d.device), head.to(d.device))
            e_w, h_w = heads[d.device]
            for m in todo:
                per[name][m.name][tr.id] = replay(d.eval(), tr, embed_weight=e_w, lm_head_weight=h_w,
                                                  max_new_tokens=cache.max_new_tokens, method=m, block_size=block_size,
                                                  tree_top_k=tree_top_k, force_spine=force_spine)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, d in drafters.items():
        bs = block_size or d.config.block_size
        out[name] = {}
        for m in todo:
            lengths = per[name][m.name]
            out[name][m.name] = {**acceptance_stats(list(lengths.values()), m.max_length(bs)),
                                 "n_prompts": len(lengths), "per_prompt": lengths}
    return out


def simulate(drafter: DFlashDrafter, transcripts: str | Path | TranscriptCache, *, block_size: int | None = None,
             tree_budgets: Sequence[int] = (4, 8, 16), tree_top_k: int | None = None, chain: bool = True,
             progress: bool = False, **kw: Any) -> dict[str, dict[str, Any]]:
    """`simulate_many` for one drafter: {method name: stats}."""
    return simulate_many({"drafter": drafter}, transcripts, block_size=block_size, tree_budgets=tree_budgets,
                         tree_top_k=tree_top_k, chain=chain, progress=progress, **kw)["drafter"]


def simulation_results(cache: TranscriptCache, drafters: dict[str, DFlashDrafter], results: dict[str, Any], *,
                       dataset: str = "", block_size: int | None = None, tree_top_k: int | None = None,
                       drafter_sources: dict[str, str] | None = None) -> dict[str, Any]:
    """The results.json document of a simulation (same schema as `evaluate`; `kind` = "simulate", no timings)."""
    m = cache.manifest
    notes = ["teacher-forced simulation on greedy target transcripts: τ only (no wall-clock timings)"]
    return {"schema": "dflashkit.eval/1", "kind": "simulate", "target": m["target"],
            "dataset": {"name": str(dataset), "n_prompts": max((st["n_prompts"] for per in results.values()
                                                                for st in per.values()), default=0),
                        "transcripts": str(cache.path)},
            "settings": {"max_new_tokens": cache.max_new_tokens, "sampling": {"temperature": 0.0},
                         "block_size": block_size, "tree_top_k": tree_top_k or None, "layers_stored": cache.layer_ids,
                         "stop_token_ids": m.get("stop_token_ids", [])},
            "drafters": {n: drafter_info(d, source=(drafter_sources or {}).get(n), block_size=block_size)
                         for n, d in drafters.items()},
            "ar": None, "results": results, "notes": notes}
