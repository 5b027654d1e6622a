"""`dflashkit diff A B`: every architectural difference between two drafter checkpoints, in plain words, plus
weight statistics where shapes match.

    dflashkit diff runs/a/final runs/b/final
    dflashkit diff ours/ zlab/ --target default --json

Architecture comes from `inspect_checkpoint` (so the fc width is the one the fc weight really has). The target's
attention geometry is known when `--target` is given, from `extra.target_geometry` recorded in a checkpoint, or
from `KNOWN_TARGET_GEOMETRY` when the checkpoint records its target architecture and hidden size; a drafter
whose heads and head_dim equal its target's is called out (docs/troubleshooting.md#pitfall-geometry), never
guessed without a target.
Weight statistics: per shared tensor, cosine similarity and norm ratio ‖B‖/‖A‖; the most different are listed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dflashkit.diagnose.inspect_checkpoint import CheckpointReport, inspect_checkpoint

# Standard attention geometry (heads, head_dim) of common target families, by (architecture prefix, hidden size).
KNOWN_TARGET_GEOMETRY: dict[tuple[str, int], tuple[int, int]] = {
    ("Qwen3_5", 5120): (24, 256),  # Qwen3.6-27B / Qwen3.5 27B (its 24 heads × 256, the copy to catch)
    ("Qwen3", 4096): (32, 128),  # Qwen3-8B
    ("Qwen3", 2560): (32, 128),  # Qwen3-4B
    ("Llama", 4096): (32, 128),  # Llama-3.1-8B
    ("Llama", 576): (9, 64),  # SmolLM2-135M
}


def target_geometry(facts: dict[str, Any], target: Any = None) -> tuple[int, int, str] | None:
    """(heads, head_dim, where it came from) of the drafter's target, or None when unknown."""
    if target is not None:
        tc = target.text_config
        heads = int(tc.num_attention_heads)
        return heads, int(getattr(tc, "head_dim", None) or tc.hidden_size // heads), "the --target"
    extra = facts.get("extra") or {}
    rec = extra.get("target_geometry") or extra.get("target_attention")
    if isinstance(rec, dict):
        heads = rec.get("num_attention_heads", rec.get("heads"))
        hd = rec.get("head_dim")
        if heads and hd:
            return int(heads), int(hd), "recorded in the checkpoint"
    arch = str(extra.get("target_architecture") or "")
    for (prefix, hidden), geo in KNOWN_TARGET_GEOMETRY.items():
        if (
            arch.startswith(prefix)
            and hidden == facts.get("hidden_size")
            and not (prefix == "Qwen3" and arch.startswith("Qwen3_5"))
        ):
            return geo[0], geo[1], f"the standard geometry of {arch} at hidden {hidden}"
    return None


@dataclass
class DiffReport:
    a: str
    b: str
    differences: list[str] = field(default_factory=list)
    same: list[str] = field(default_factory=list)
    weights: dict[str, Any] = field(default_factory=dict)
    problems: dict[str, list[str]] = field(default_factory=dict)
    compared: bool = True  # False: A or B could not be read as a drafter, so nothing was compared

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "compared": self.compared,
            "differences": self.differences,
            "same": self.same,
            "weights": self.weights,
            "problems": self.problems,
        }


def _ids_words(name: str, ids: list[int]) -> str:
    return f"{name} reads target layers {ids}"


def _fc_lines(fa: dict[str, Any], fb: dict[str, Any]) -> list[str]:
    out = []
    ia, ib = fa["target_layer_ids"] or [], fb["target_layer_ids"] or []
    ka, kb = fa["fc_features"], fb["fc_features"]

    def fc(f: dict[str, Any]) -> str:
        s = f["fc_shape"]
        return f"{s[1]} → {s[0]}" if s else "no fc weight"

    if ka != kb or (fa["fc_shape"] != fb["fc_shape"]):
        line = f"A's fc reads {ka} target layers ({fc(fa)}), B's reads {kb} ({fc(fb)})"
        only_b, only_a = sorted(set(ib) - set(ia)), sorted(set(ia) - set(ib))
        if only_b:
            line += f": A leaves out layer{'s' if len(only_b) > 1 else ''} {', '.join(map(str, only_b))}"
        if only_a:
            line += (
                f"{';' if only_b else ':'} B leaves out layer{'s' if len(only_a) > 1 else ''} "
                f"{', '.join(map(str, only_a))}"
            )
        out.append(line)
    elif sorted(ia) != sorted(ib):
        out.append(f"A reads target layers {ia}, B reads {ib} (same count, different layers)")
    elif ia != ib:
        out.append(
            f"A and B read the same target layers in a different order ({ia} vs {ib}): the fc columns "
            f"are not interchangeable"
        )
    for name, f in (("A", fa), ("B", fb)):
        ids = f["target_layer_ids"] or []
        if isinstance(f["fc_features"], int) and ids and f["fc_features"] != len(ids):
            out.append(f"{name}'s config names {len(ids)} target layers {ids} but its fc reads {f['fc_features']}")
    return out


def _geometry_lines(fa: dict[str, Any], fb: dict[str, Any], target: Any) -> list[str]:
    out = []
    ga = (fa["num_attention_heads"], fa["head_dim"], fa["num_key_value_heads"], fa["intermediate_size"])
    gb = (fb["num_attention_heads"], fb["head_dim"], fb["num_key_value_heads"], fb["intermediate_size"])
    ta, tb = target_geometry(fa, target), target_geometry(fb, target)
    copied = {
        n: t is not None and (f["num_attention_heads"], f["head_dim"]) == t[:2]
        for n, f, t in (("A", fa, ta), ("B", fb, tb))
    }
    if copied["A"] != copied["B"]:
        c, o = ("A", "B") if copied["A"] else ("B", "A")
        fc_, fo = (fa, fb) if c == "A" else (fb, fa)
        out.append(
            f"{c}'s attention geometry equals its target's (head_dim {fc_['head_dim']}, "
            f"{fc_['num_attention_heads']} heads; target geometry from {(ta if c == 'A' else tb)[2]}), "
            f"{o} uses its own ({fo['head_dim']}, {fo['num_attention_heads']})"
        )
    elif copied["A"]:
        out.append(
            f"both A and B use their target's attention geometry (head_dim {fa['head_dim']}, "
            f"{fa['num_attention_heads']} heads) — a drafter should have its own "
            "(docs/troubleshooting.md#pitfall-geometry)"
        )
    if ga[:3] != gb[:3] and not out:
        out.append(
            f"attention: A has {ga[0]} heads × {ga[1]} with {ga[2]} kv heads, B has {gb[0]} × {gb[1]} with {gb[2]}"
        )
    elif ga[:3] != gb[:3]:
        out.append(f"attention: A {ga[0]} × {ga[1]} ({ga[2]} kv), B {gb[0]} × {gb[1]} ({gb[2]} kv)")
    if ga[3] != gb[3]:
        out.append(f"MLP width: A {ga[3]}, B {gb[3]}")
    return out


def _field_lines(fa: dict[str, Any], fb: dict[str, Any], same: list[str]) -> list[str]:
    out = []
    words = {
        "kind": "drafter kind (dflash: bs − 1 drafts a round; dspark: bs, with a Markov head)",
        "heads": "the head's own parts (DSpark: Markov and confidence heads)",
        "hidden_size": "hidden size",
        "vocab_size": "vocabulary",
        "num_target_layers": "target depth",
        "block_size": "block size",
        "sliding_window": "sliding window",
        "rope_theta": "rope θ",
        "rms_norm_eps": "norm ε",
        "draft_vocab_size": "draft vocabulary",
        "is_causal": "is_causal override",
        "num_hidden_layers": "decoder layers",
        "max_position_embeddings": "max positions",
    }
    for key, word in words.items():
        if fa.get(key) != fb.get(key):
            out.append(f"{word}: A {fa.get(key)}, B {fb.get(key)}")
        else:
            same.append(f"{word} {fa.get(key)}")
    if fa.get("dtypes") != fb.get("dtypes"):
        out.append(f"tensor dtypes: A {', '.join(fa.get('dtypes') or [])}, B {', '.join(fb.get('dtypes') or [])}")
    if fa.get("layer_types") != fb.get("layer_types"):
        out.append(f"layer types: A {fa.get('layer_types')}, B {fb.get('layer_types')}")
    ma, mb = fa["mask"], fb["mask"]

    def mask(m: dict[str, Any]) -> str:
        return "a learned mask embedding" if m["learned_embedding_tensor"] else f"mask token {m['mask_token_id']}"

    if mask(ma) != mask(mb):
        out.append(f"mask: A uses {mask(ma)}, B uses {mask(mb)}")
    else:
        same.append(mask(ma))
    ea, eb = fa.get("extra") or {}, fb.get("extra") or {}
    for key in sorted(set(ea) | set(eb)):
        if ea.get(key) != eb.get(key):
            out.append(f"recorded {key}: A {ea.get(key)!r}, B {eb.get(key)!r}")
    return out


def weight_stats(a: CheckpointReport, b: CheckpointReport, *, top: int = 5) -> dict[str, Any]:
    """Cosine similarity and norm ratio ‖B‖/‖A‖ per tensor present in both with equal shapes."""
    shared = sorted(k for k in set(a.tensors) & set(b.tensors) if a.shape(k) == b.shape(k))
    rows = []
    handles: dict[str, Any] = {}
    try:
        for key in shared:
            ta, tb = _load(a, key, handles), _load(b, key, handles)
            if ta is None or tb is None or not ta.is_floating_point():
                continue
            ta, tb = ta.double().flatten(), tb.double().flatten()
            na, nb = float(ta.norm()), float(tb.norm())
            cos = float(ta @ tb / (na * nb)) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
            rows.append(
                {
                    "tensor": key,
                    "cosine": cos,
                    "norm_ratio": nb / na if na > 0 else math.inf,
                    "identical": bool(torch.equal(ta, tb)),
                }
            )
    finally:
        handles.clear()
    rows.sort(key=lambda r: (r["cosine"], -abs(math.log(r["norm_ratio"])) if 0 < r["norm_ratio"] < math.inf else 0))
    return {
        "compared": len(rows),
        "identical": sum(r["identical"] for r in rows),
        "mean_cosine": sum(r["cosine"] for r in rows) / len(rows) if rows else None,
        "most_different": rows[:top],
        "shape_mismatch": sorted(k for k in set(a.tensors) & set(b.tensors) if a.shape(k) != b.shape(k)),
        "only_in_a": sorted(set(a.tensors) - set(b.tensors)),
        "only_in_b": sorted(set(b.tensors) - set(a.tensors)),
    }


def _load(report: CheckpointReport, key: str, handles: dict[str, Any]) -> torch.Tensor | None:
    info = report.tensors[key]
    path = str(Path(report.path) / info["file"])
    try:
        if path not in handles:
            handles[path] = safe_open(path, framework="pt")
        return handles[path].get_tensor(info["stored_as"])
    except Exception:
        return None


def diff_checkpoints(a: str | Path, b: str | Path, *, target: Any = None, weights: bool = True) -> DiffReport:
    """Compare two checkpoints (z-lab, dflashkit or speculators format); `target` is an optional `Target`."""
    ra, rb = inspect_checkpoint(a, check_values=False), inspect_checkpoint(b, check_values=False)
    report = DiffReport(a=str(a), b=str(b))
    for name, r in (("A", ra), ("B", rb)):
        bad = [f.line() for f in r.findings if f.status == "FAIL"]
        if bad:
            report.problems[name] = bad
    if not ra.facts or not rb.facts:
        report.compared = False  # never "no differences" between a drafter and something that is not one
        return report
    fa, fb = ra.facts, rb.facts
    report.differences += _fc_lines(fa, fb)
    report.differences += _geometry_lines(fa, fb, target)
    report.differences += _field_lines(fa, fb, report.same)
    if weights:
        report.weights = weight_stats(ra, rb)
    return report


def render_diff(report: DiffReport) -> str:
    lines = [f"A = {report.a}", f"B = {report.b}"]
    for name, bad in report.problems.items():
        lines.append(f"{name} has problems of its own:")
        lines += [f"  {x}" for x in bad]
    if not report.compared:
        unread = " and ".join(n for n, r in (("A", report.a), ("B", report.b)) if n in report.problems) or "A or B"
        lines.append(f"Not compared: {unread} could not be read as a drafter checkpoint (above)")
        return "\n".join(lines)
    lines.append(
        "Architecture: " + ("no differences" if not report.differences else f"{len(report.differences)} difference(s)")
    )
    lines += [f"  - {d}" for d in report.differences]
    w = report.weights
    if w:
        lines.append(
            f"Weights: {w['compared']} tensors with equal shapes compared, {w['identical']} identical"
            + (f", mean cosine {w['mean_cosine']:.4f}" if w["mean_cosine"] is not None else "")
        )
        for r in w["most_different"]:
            if not r["identical"]:
                lines.append(f"  {r['tensor']:<44} cosine {r['cosine']:+.4f}  ‖B‖/‖A‖ {r['norm_ratio']:.3f}")
        for key, word in (
            ("shape_mismatch", "different shapes"),
            ("only_in_a", "only in A"),
            ("only_in_b", "only in B"),
        ):
            if w[key]:
                more = f" … ({len(w[key])})" if len(w[key]) > 8 else ""
                lines.append(f"  {word}: {', '.join(w[key][:8])}{more}")
    return "\n".join(lines)


__all__ = [
    "KNOWN_TARGET_GEOMETRY",
    "DiffReport",
    "diff_checkpoints",
    "render_diff",
    "target_geometry",
    "weight_stats",
]
