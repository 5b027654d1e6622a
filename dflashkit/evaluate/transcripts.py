"""The transcript cache `simulate` replays: the target's greedy continuation of every prompt and its features.

    cache = build_transcripts(target, prompts, "runs/transcripts", max_new_tokens=256, layer_ids=[1, 8, 14, 20, 27])
    cache.load(i)      # → Transcript: input_ids (T,) and the requested layers' features

`build_transcripts` runs the target once per prompt (greedy, `decode.generate(method="ar")`), then one forward over
prompt + continuation capturing the union of the requested layers. Each prompt is one file `pNNNNN.safetensors`
with `input_ids` (T,) and one tensor per layer, `layer{L}` (T, H), stored **separately**, so drafters reading
different layer sets run from the same cache. The embedding table and LM head (which every drafter borrows) are
stored once in `head.safetensors`. `manifest.json` records the target (source, fingerprint, layers, hidden size),
the layers stored, the generation settings and every finished prompt (with its category); a rerun skips finished
prompts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dflashkit.decode.generate import DecodeSettings, generate
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import DataError, TargetError
from dflashkit.evaluate.file_schemas import transcripts_problem
from dflashkit.evaluate.stats import Prompt, prompt_sha, target_info
from dflashkit.io_utils import atomic_path, atomic_write_text
from dflashkit.target.model import Target

FORMAT, VERSION = "dflashkit.transcripts", 1
MANIFEST, HEAD_FILE = "manifest.json", "head.safetensors"


def _as_prompts(prompts: Sequence[Prompt | Sequence[int]]) -> list[Prompt]:
    return [p if isinstance(p, Prompt) else Prompt(str(i), [int(t) for t in p]) for i, p in enumerate(prompts)]


# ---------------------------------------------------------------------------------------------- the cache
@dataclass
class Transcript:
    id: str
    ids: list[int]  # prompt + the target's greedy continuation
    prompt_len: int
    stop_reason: str
    layers: dict[int, Tensor]  # layer id → (T, H) output of that decoder layer

    def features(self, layer_ids: Sequence[int]) -> Tensor:
        """(1, T, K·H): the requested layers concatenated in the drafter's order (as Target.forward does)."""
        return torch.cat([self.layers[int(i)] for i in layer_ids], dim=-1)[None]


class TranscriptCache:
    """A transcript directory written by `build_transcripts`; every read is checked against the manifest."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        mpath = self.path / MANIFEST
        if not mpath.is_file():
            raise DataError(
                f"{self.path}: no {MANIFEST} (expected a transcript cache written by build_transcripts "
                f"/ `dflashkit simulate --cache`)"
            )
        try:
            m = json.loads(mpath.read_text())
            ok = (
                m.get("format") == FORMAT
                and isinstance(m.get("prompts"), list)
                and isinstance(m.get("layer_ids"), list)
            )
        except (json.JSONDecodeError, AttributeError):
            ok = False
        if not ok:
            raise DataError(
                f"{mpath}: not a dflashkit transcript manifest (expected format {FORMAT!r} with "
                f"'prompts' and 'layer_ids'); delete {self.path} to rebuild it"
            )
        if m.get("version") != VERSION:
            raise DataError(
                f"{mpath}: transcript cache version {m.get('version')}, this dflashkit reads {VERSION}; "
                f"delete {self.path} to rebuild it"
            )
        why = transcripts_problem(m)
        if why:
            raise DataError(f"{mpath}: damaged transcript manifest ({why}); delete {self.path} to rebuild it")
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
            raise DataError(
                f"{file}: tensor 'input_ids' missing or not of shape ({t_len},) as the manifest says; "
                f"delete {self.path} to rebuild the cache"
            )
        layers = {}
        for layer in self.layer_ids:
            t = tensors.get(f"layer{layer}")
            if t is None or tuple(t.shape) != (t_len, hidden):
                raise DataError(
                    f"{file}: tensor 'layer{layer}' missing or not of shape ({t_len}, {hidden}); delete "
                    f"{self.path} to rebuild the cache"
                )
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
            raise DataError(
                f"{file}: unreadable target head ({exc}); delete {self.path} to rebuild the cache"
            ) from None

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
            problems.append(
                f"target layers {missing} are not in the cache (it stores {self.layer_ids}; rebuild it "
                f"with the union of every drafter's layers)"
            )
        if problems:
            raise TargetError(
                f"{source} does not fit the transcripts in {self.path} ({tgt['source']}): " + "; ".join(problems)
            )


def build_transcripts(
    target: Target,
    prompts: Sequence[Prompt | Sequence[int]],
    out_dir: str | Path,
    *,
    max_new_tokens: int,
    layer_ids: Sequence[int],
    stop_token_ids: Sequence[int] = (),
    progress: bool = True,
) -> TranscriptCache:
    """Greedy target transcripts + per-layer features of `prompts` in `out_dir` (resumable per prompt)."""
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if max_new_tokens < 1:
        raise DataError(f"max_new_tokens={max_new_tokens}: expected a positive integer")
    layers = sorted({int(i) for i in layer_ids})
    target.check_layer_ids(layers)
    stops = sorted({int(t) for t in stop_token_ids})
    m = _open_manifest(target, out, layers, max_new_tokens, stops)
    done = {e["id"]: e for e in m["prompts"]}
    prompts = _as_prompts(prompts)
    if len({p.id for p in prompts}) != len(prompts):
        raise DataError("prompt ids must be unique (they key the transcript cache)")
    todo = []
    for p in prompts:
        e = done.get(p.id)
        if e is None:
            todo.append(p)
        elif e["prompt_sha"] != prompt_sha(p.ids):
            raise DataError(
                f"{out / MANIFEST}: prompt {p.id!r} is cached with different token ids; use another cache "
                f"directory or delete this one"
            )
    for p in tqdm(todo, desc="transcripts", unit="prompt", disable=not progress or not todo):
        m["prompts"].append(_write_transcript(target, p, out, len(m["prompts"]), m["layer_ids"], max_new_tokens, stops))
        atomic_write_text(out / MANIFEST, json.dumps(m, indent=1) + "\n")
    if not (out / MANIFEST).exists():
        atomic_write_text(out / MANIFEST, json.dumps(m, indent=1) + "\n")
    return TranscriptCache(out)


def _open_manifest(target: Target, out: Path, layers: list[int], max_new_tokens: int, stops: list[int]) -> dict:
    """The manifest of an existing cache (checked against this run: target, settings, layers), or a fresh one
    (then the target's embedding table and LM head are written to head.safetensors first)."""
    from safetensors.torch import save_file

    fresh = {
        "format": FORMAT,
        "version": VERSION,
        "target": target_info(target),
        "layer_ids": layers,
        "max_new_tokens": int(max_new_tokens),
        "stop_token_ids": stops,
        "prompts": [],
    }
    if not (out / MANIFEST).exists():
        head = {"embed": target.embed_weight.detach().cpu().contiguous()}
        tied = target.lm_head_weight.data_ptr() == target.embed_weight.data_ptr()
        if not tied:
            head["lm_head"] = target.lm_head_weight.detach().cpu().contiguous()
        with atomic_path(out / HEAD_FILE) as tmp:
            save_file(head, str(tmp))
        fresh["head"] = {"file": HEAD_FILE, "tied": tied}
        return fresh
    m = TranscriptCache(out).manifest
    for key, want, have in (
        ("target.fingerprint", fresh["target"]["fingerprint"], m["target"].get("fingerprint")),
        ("max_new_tokens", fresh["max_new_tokens"], m.get("max_new_tokens")),
        ("stop_token_ids", stops, m.get("stop_token_ids")),
    ):
        if want != have:
            raise DataError(
                f"{out / MANIFEST}: cache built with {key} = {have}, this run asks for {want}; "
                f"use another cache directory or delete this one"
            )
    if not set(layers) <= set(m["layer_ids"]):
        raise DataError(
            f"{out / MANIFEST}: cache stores layers {m['layer_ids']}, this run needs {layers}; use "
            f"another cache directory or delete this one (build it with the union of all layers)"
        )
    m["layer_ids"] = [int(i) for i in m["layer_ids"]]
    return m


@torch.no_grad()
def transcript_of(
    target: Target,
    prompt: Prompt,
    layer_ids: Sequence[int],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
) -> Transcript:
    """One prompt's transcript in memory: the target's greedy continuation (`decode.generate(method="ar")`) and the
    features of prompt + continuation at `layer_ids` (one forward), on CPU."""
    layers = sorted({int(i) for i in layer_ids})
    try:
        res = generate(
            target,
            prompt.ids,
            settings=DecodeSettings(method="ar", max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids),
        )
    except ValueError as e:
        raise DataError(f"prompt {prompt.id!r}: {e}") from None
    full = torch.tensor(prompt.ids + res.tokens, dtype=torch.long)[None]  # (1, T)
    feats = target.forward(full, layer_ids=layers, logits=False).features[0]  # (T, K·H)
    hidden = target.hidden_size
    per_layer = {layer: feats[:, j * hidden : (j + 1) * hidden].detach().cpu() for j, layer in enumerate(layers)}
    return Transcript(prompt.id, full[0].tolist(), len(prompt.ids), res.stop_reason, per_layer)  # layers (T, H)


def _write_transcript(
    target: Target, p: Prompt, out: Path, index: int, layers: list[int], max_new_tokens: int, stops: list[int]
) -> dict[str, Any]:
    """The target's greedy continuation of one prompt and the features of prompt + continuation, written to
    pNNNNN.safetensors; returns its manifest entry."""
    from safetensors.torch import save_file

    tr = transcript_of(target, p, layers, max_new_tokens=max_new_tokens, stop_token_ids=stops)
    tensors = {"input_ids": torch.tensor(tr.ids, dtype=torch.long)}
    tensors.update({f"layer{layer}": feats.contiguous() for layer, feats in tr.layers.items()})
    name = f"p{index:05d}.safetensors"
    with atomic_path(out / name) as tmp:
        save_file(tensors, str(tmp), metadata={"id": p.id})
    return {
        "index": index,
        "id": p.id,
        "file": name,
        "prompt_len": len(p.ids),
        "num_tokens": len(tr.ids) - tr.prompt_len,
        "stop_reason": tr.stop_reason,
        "prompt_sha": prompt_sha(p.ids),
        "category": p.category or None,
    }


__all__ = ["HEAD_FILE", "MANIFEST", "Transcript", "TranscriptCache", "build_transcripts", "transcript_of"]
