"""`dflashkit doctor --target T --drafter D`: checks to run before anyone spends GPU hours on a drafter.

    dflashkit doctor --target default --drafter runs/smollm2/train/final --prompts 3
    dflashkit doctor --target Qwen/Qwen3-8B --drafter zlab/ --features runs/q3/features

Each finding is one line `OK|WARN|FAIL <check>: <what> — fix: <how>`; the exit status is 1 when any check FAILs.
Checks: the checkpoint itself (inspect), hidden size and vocabulary fit, target_layer_ids in range and distinct,
fc width = named layers, mask token usable, geometry not copied from the target, chat template recorded at
training = the target's now, hook-captured features = `output_hidden_states[i + 1]`, verifier logits = the
target's own logits, a short greedy draft-and-verify run (τ; output = the target's greedy output), and labels or
features shifted by one, found from the checkpoint alone: the drafter runs teacher-forced on the target's greedy
transcript and its slot-k predictions are scored against the token at a+k−1, a+k and a+k+1; with `--context N`,
the drafter's sliding window and longest training context against the context it will draft after; with
`--train-config YAML`, whether one training step of that config fits its device (the estimate `train` refuses with).

The checks, one function each; each returns `Finding`s (OK / WARN / FAIL lines):

    geometry_finding(heads, head_dim, target_heads, target_head_dim, hidden)   # attention geometry copied?
    config_fit(cfg, target, fc_features)            # hidden size, vocabulary, layer ids, fc width, mask row
    chat_template_findings(cfg, target)             # the template recorded at training = the target's now
    manifest_findings(cfg, target, features_dir)    # a capture made from this target, with these layers
    capture_findings(target, layer_ids, ids)        # hooked features = output_hidden_states[i + 1], logits
    label_offset_accuracy(...) / shift_finding(...) # labels or features shifted by one
    mask_finding(cfg, target, …)                    # the mask row is one no chat produces
    context_findings(cfg, context)                  # sliding window / longest training context vs the context
    memory_finding(train_config)                    # one training step fits its device (train.memory_check)
    engine_findings(path, verdicts, target)         # what each serving engine does with the directory

Geometry rule (docs/troubleshooting.md#pitfall-geometry): heads and head_dim different from the target's → OK. Equal →
OK when they are also dflashkit's own default for that hidden size (a coincidence: z-lab's 32 × 128 for Qwen3-8B, or 4
× 16 on a 64-wide test target), or when the checkpoint records a warm start (`extra.warm_start`: its layers were
copied from the target's, which needs the target's geometry); otherwise FAIL on a large target (hidden ≥ 1024), WARN
on a small one, where few head layouts exist and equality may be chance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dflashkit.diagnose.inspect_checkpoint import Finding, inspect_checkpoint
from dflashkit.drafter.config import DrafterConfig, default_geometry
from dflashkit.drafter.context_reach import context_warnings, trained_context
from dflashkit.drafter.heads import BlockSlots
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import CheckpointError, DataError
from dflashkit.shell import shell_line

ORDINARY_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 2024, researchers measured 3.5% growth; "
    "see https://example.com/report?id=42 for details.\n def f(x):\n    return x * 2  # double it"
)
LARGE_HIDDEN = 1024


# ---------------------------------------------------------------------------------------------- pure checks
def geometry_finding(heads: int, head_dim: int, target_heads: int, target_head_dim: int, hidden: int) -> Finding:
    """The geometry rule documented in the module docstring."""
    mine, theirs = f"{heads} heads × {head_dim}", f"{target_heads} heads × {target_head_dim}"
    if (heads, head_dim) != (target_heads, target_head_dim):
        return Finding("OK", "geometry", f"drafter has its own attention geometry ({mine}; target {theirs})")
    default = default_geometry(hidden)
    if (heads, head_dim) == (default["num_attention_heads"], default["head_dim"]):
        return Finding(
            "OK",
            "geometry",
            f"drafter geometry {mine} equals the target's, but it is also dflashkit's "
            f"default for hidden {hidden}: a coincidence, not a copy",
        )
    fix = (
        f"rebuild the drafter with its own geometry (dflashkit's default for hidden {hidden}: "
        f"{default['num_attention_heads']} heads × {default['head_dim']}, {default['num_key_value_heads']} kv)"
    )
    if hidden >= LARGE_HIDDEN:
        return Finding(
            "FAIL",
            "geometry",
            f"drafter attention geometry ({mine}) was copied from the target "
            "(docs/troubleshooting.md#pitfall-geometry)",
            fix,
        )
    return Finding(
        "WARN",
        "geometry",
        f"drafter attention geometry ({mine}) equals the target's; on a small target this may be chance",
        fix,
    )


def config_fit(cfg: DrafterConfig, target: Any, fc_features: int | None) -> list[Finding]:
    out = []
    ok = cfg.hidden_size == target.hidden_size
    out.append(
        Finding(
            "OK" if ok else "FAIL",
            "hidden size",
            f"drafter {cfg.hidden_size}, target {target.hidden_size}",
            "use a drafter built for this target",
        )
    )
    tok = len(target.tokenizer) if target.tokenizer is not None else None
    ok = cfg.vocab_size == target.vocab_size
    out.append(
        Finding(
            "OK" if ok else "FAIL",
            "vocabulary",
            f"drafter {cfg.vocab_size} rows, target "
            f"{target.vocab_size} embedding rows" + (f" (tokenizer {tok})" if tok else ""),
            "use a drafter built for this target's vocabulary",
        )
    )
    ids = cfg.target_layer_ids
    bad = [i for i in ids if not 0 <= i < target.num_layers]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if bad or dup:
        what = (
            f"target_layer_ids {bad} out of range: the target has {target.num_layers} decoder layers"
            if bad
            else f"target_layer_ids repeat {dup}"
        )
        out.append(
            Finding(
                "FAIL",
                "target layers",
                what + f" (ids {ids})",
                "the drafter was trained on another target, or its ids are wrong: retrain or fix them",
            )
        )
    elif cfg.num_target_layers != target.num_layers:
        out.append(
            Finding(
                "FAIL",
                "target layers",
                f"checkpoint was built for a {cfg.num_target_layers}-layer "
                f"target; this one has {target.num_layers} (ids {ids} happen to be in range)",
                "features would come from other depths than in training: use the matching target",
            )
        )
    else:
        out.append(Finding("OK", "target layers", f"{ids} of {target.num_layers}, distinct"))
    if fc_features is not None:
        ok = fc_features == len(ids)
        out.append(
            Finding(
                "OK" if ok else "FAIL",
                "fc width",
                f"fc reads {fc_features} target layers, config names {len(ids)}",
                "retrain with an fc over every named layer (docs/troubleshooting.md#pitfall-fc-layers)",
            )
        )
    tc = target.text_config
    t_heads = int(tc.num_attention_heads)
    t_hd = int(getattr(tc, "head_dim", None) or tc.hidden_size // t_heads)
    warm = cfg.extra.get("warm_start")
    if isinstance(warm, dict) and (cfg.num_attention_heads, cfg.head_dim) == (t_heads, t_hd):
        out.append(
            Finding(
                "OK",
                "geometry",
                f"drafter geometry {t_heads} heads × {t_hd} equals the target's on "
                f"purpose: warm-started from target layers {warm.get('source_layers')}",
            )
        )
    else:
        out.append(geometry_finding(cfg.num_attention_heads, cfg.head_dim, t_heads, t_hd, target.hidden_size))
    return out


def chat_template_findings(cfg: DrafterConfig, target: Any) -> list[Finding]:
    rec, now = cfg.extra.get("chat_template"), target.chat_template_info()
    kwargs = cfg.extra.get("chat_template_kwargs")
    out = []
    if not isinstance(rec, dict):
        out.append(
            Finding(
                "WARN",
                "chat template",
                f"not recorded at training (target now: {now})",
                "confirm by hand that training used this template and thinking mode; dflashkit "
                "training records it in the checkpoint",
            )
        )
    else:
        diff = {k: (rec.get(k), now.get(k)) for k in sorted(set(rec) | set(now)) if rec.get(k) != now.get(k)}
        if diff:
            what = "; ".join(f"{k}: {a!r} at training, {b!r} now" for k, (a, b) in diff.items())
            out.append(
                Finding(
                    "FAIL",
                    "chat template",
                    what,
                    "serve with the template and thinking mode used in "
                    "training, or retrain on responses rendered with the current one",
                )
            )
        else:
            out.append(
                Finding(
                    "OK",
                    "chat template",
                    f"same as at training ({rec})" + (f", template kwargs {kwargs}" if kwargs else ""),
                )
            )
    arch = cfg.extra.get("target_architecture")
    if arch and arch != target.architecture:
        out.append(
            Finding(
                "WARN",
                "target",
                f"trained for {arch}, target is {target.architecture}",
                "check that this is the drafter's target",
            )
        )
    return out


def manifest_findings(cfg: DrafterConfig, target: Any, features_dir: str | Path) -> list[Finding]:
    from dflashkit.features.captured import layer_columns
    from dflashkit.features.manifest import Manifest, target_fingerprint

    try:
        m = Manifest.load(features_dir)
    except DataError as e:
        return [Finding("FAIL", "features", str(e), "pass the directory written by `dflashkit capture`")]
    out = []
    try:  # the rule training applies: a drafter reads any subset of the captured layers
        columns = layer_columns(Path(features_dir), m, cfg.target_layer_ids)
    except DataError as e:
        out.append(
            Finding("FAIL", "features", str(e), "recapture with the checkpoint's target_layer_ids, or train for these")
        )
    else:
        subset = "" if columns is None else f" (it reads {cfg.target_layer_ids} of them)"
        out.append(Finding("OK", "features", f"captured from layers {m.layer_ids}{subset}"))
    if m.target.get("fingerprint") != target_fingerprint(target):
        out.append(
            Finding(
                "WARN",
                "features",
                f"captured from another target ({m.target.get('source')})",
                "recapture with this target",
            )
        )
    return out


# ---------------------------------------------------------------------------------------------- target checks
def _rel_err(a: Tensor, b: Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def _tolerance(target: Any) -> float:
    return 1e-4 if target.dtype == torch.float32 else 3e-2


@torch.no_grad()
def capture_findings(target: Any, layer_ids: list[int], ids: Tensor) -> list[Finding]:
    """Hook capture = output_hidden_states[i + 1] per layer (the last one compared after the final norm, as HF
    normalises its last hidden state); verifier logits = the model's own logits."""
    out = target.forward(ids, layer_ids=layer_ids)
    hs = target.text_model(input_ids=ids.to(target.device), output_hidden_states=True).hidden_states
    h, tol, bad = target.hidden_size, _tolerance(target), []
    for j, i in enumerate(layer_ids):
        feat = out.features[..., j * h : (j + 1) * h]
        ref = hs[i + 1] if i < target.num_layers - 1 else None
        err = _rel_err(feat, ref) if ref is not None else _rel_err(target.final_norm(feat), hs[-1])
        if err > tol:
            best = min(range(len(hs) - 1), key=lambda k: _rel_err(feat, hs[k]))
            bad.append(
                f"layer {i}: differs from output_hidden_states[{i + 1}] by {err:.1e}; closest is "
                f"output_hidden_states[{best}]"
            )
    found = (
        [
            Finding(
                "FAIL",
                "feature capture",
                "; ".join(bad),
                "the hooks read the wrong layer: the feature of layer i must be the output of decoder layer i",
            )
        ]
        if bad
        else [
            Finding(
                "OK", "feature capture", f"hooks on {layer_ids} = output_hidden_states[i + 1] on {ids.shape[1]} tokens"
            )
        ]
    )
    err = _rel_err(out.logits, target.model(input_ids=ids.to(target.device)).logits)
    found.append(
        Finding(
            "OK" if err <= tol else "FAIL",
            "verifier logits",
            f"final norm + LM head over the last layer's output vs the model's logits: max rel. diff {err:.1e}",
            "logits must come from the final layer through the final norm "
            "(docs/troubleshooting.md#pitfall-final-layer-logits)",
        )
    )
    return found


@torch.no_grad()
def greedy_reference(target: Any, prompt: list[int], n: int) -> list[int]:
    """The target's greedy continuation by full recomputation (no cache, no shared code with decode)."""
    ids = list(prompt)
    for _ in range(n):
        logits = target.model(input_ids=torch.tensor([ids], device=target.device)).logits
        ids.append(int(logits[0, -1].float().argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def label_offset_accuracy(
    drafter: DFlashDrafter,
    target: Any,
    transcript: list[int],
    prompt_len: int,
    *,
    max_anchors: int = 8,
    offsets: tuple[int, ...] = (-1, 0, 1),
) -> dict[int, list[int]]:
    """Teacher-forced drafter on a transcript: per offset d, [correct, total] of slot-k predictions vs token a+k+d.

    DSpark drafters count their slot j (which drafts the token at a+j+1, through the Markov head fed the true
    previous token) as slot k = j + 1, so a healthy drafter of either kind peaks at d = 0."""
    cfg = drafter.config
    ids = torch.tensor([transcript])
    feats = target.forward(ids, layer_ids=cfg.target_layer_ids, logits=False).features  # (1, T, K·H)
    t, bs = len(transcript), cfg.block_size
    span = list(range(max(prompt_len, 1), t - 1))
    anchors = span[:: max(1, len(span) // max_anchors)][:max_anchors]
    counts = {d: [0, 0] for d in offsets}
    for a in anchors:
        embeds = drafter.block_embeddings(ids[:, a : a + 1], target.embed_weight, bs)
        hidden = drafter(
            feats[:, :a], embeds, context_positions=torch.arange(a)[None], block_positions=torch.arange(a, a + bs)[None]
        )
        first = drafter.first_draft_slot()
        logits = drafter.logits(hidden[0, first:], target.lm_head_weight).float()  # (n, V')
        prevs = torch.tensor([transcript[min(a + j, t - 1)] for j in range(logits.shape[0])])  # slot j: a+j's
        block = BlockSlots(hidden[0], transcript[a], transcript[a - 1])  # a ≥ 1
        logits = drafter.head.teacher_forced_logits(
            drafter, logits, prevs, hidden[0, first:], target.embed_weight, block
        )
        preds = drafter.to_target_ids(logits.argmax(-1)).tolist()
        for k, p in enumerate(preds, start=1):
            for d in offsets:
                if 0 <= a + k + d < t:
                    counts[d][0] += int(p == transcript[a + k + d])
                    counts[d][1] += 1
    return counts


def shift_finding(counts: dict[int, list[int]]) -> Finding:
    acc = {d: c / n if n else 0.0 for d, (c, n) in counts.items()}
    words = ", ".join(f"a+k{d:+d}: {acc[d]:.2f}".replace("+0", "") for d in sorted(acc))
    best = max(acc, key=lambda d: acc[d])
    if best != 0 and acc[best] >= 0.3 and acc[best] >= 2 * acc.get(0, 0.0) + 0.1:
        return Finding(
            "FAIL",
            "label shift",
            f"slot k predicts the token at a+k{best:+d} far better than the one "
            f"at a+k (teacher-forced accuracy {words}): labels or features shifted by one "
            "(docs/troubleshooting.md#pitfall-label-shift)",
            "train slot k on the token at anchor + k (same position, no shift) and feed the features "
            "of positions < anchor; retrain",
        )
    if acc.get(0, 0.0) >= 0.3:
        return Finding("OK", "label shift", f"slot k predicts the token at a+k (teacher-forced accuracy {words})")
    return Finding(
        "WARN",
        "label shift",
        f"inconclusive: the drafter predicts little (teacher-forced accuracy {words})",
        "train the drafter (or check it is the trained one) and run doctor again",
    )


def mask_finding(
    cfg: DrafterConfig, drafter: DFlashDrafter | None, target: Any, transcripts: list[list[int]]
) -> Finding:
    if cfg.learned_mask_embedding:
        vec = getattr(drafter, "mask_embedding", None) if drafter is not None else None
        if vec is None:
            return Finding("WARN", "mask token", "learned mask embedding (not loaded, not checked)", "")
        norm = float(vec.detach().float().norm())
        ok = bool(torch.isfinite(vec).all()) and norm > 0
        return Finding(
            "OK" if ok else "FAIL",
            "mask token",
            f"learned mask embedding, norm {norm:.3g}",
            "the mask embedding is zero or non-finite: retrain or re-export it",
        )
    mid, fix = cfg.mask_token_id, "use a spare embedding row, or a learned mask embedding (mask_embedding)"
    if not 0 <= mid < target.vocab_size:
        return Finding("FAIL", "mask token", f"mask_token_id {mid} outside the target's {target.vocab_size} rows", fix)
    seen = any(mid in t for t in transcripts)
    tok = usable_tokenizer(target)
    if tok is not None:
        seen = seen or mid in tok(ORDINARY_TEXT, add_special_tokens=False)["input_ids"]
    if seen:
        return Finding(
            "FAIL",
            "mask token",
            f"mask_token_id {mid} occurs in ordinary text or the target's output: "
            "block slots would look like real tokens",
            fix,
        )
    if tok is None:
        return Finding(
            "WARN",
            "mask token",
            f"mask_token_id {mid}: no tokenizer to check ordinary text against "
            f"(not seen in {sum(map(len, transcripts))} generated tokens)",
            "run doctor with a tokenizer",
        )
    if mid >= len(tok):
        return Finding("OK", "mask token", f"row {mid} lies beyond the tokenizer's {len(tok)} tokens: never produced")
    name = tok.convert_ids_to_tokens(mid)
    from dflashkit.drafter.mask_choice import special_candidates

    if mid in special_candidates(tok):  # an added special token outside the chat template and control tokens
        return Finding(
            "OK",
            "mask token",
            f"special token {name!r} ({mid}): outside the chat template, not seen in "
            f"ordinary text or {sum(map(len, transcripts))} generated tokens",
        )
    if mid in set(getattr(tok, "all_special_ids", []) or []):
        if "mask" in str(name).lower():
            return Finding("OK", "mask token", f"dedicated special token {name!r} ({mid})")
        return Finding(
            "WARN",
            "mask token",
            f"mask_token_id {mid} is the special token {name!r}, which the target "
            "uses (a trained row, not a blank one)",
            fix,
        )
    return Finding(
        "WARN", "mask token", f"mask_token_id {mid} is the ordinary token {tok.convert_ids_to_tokens(mid)!r}", fix
    )


def context_findings(cfg: DrafterConfig, context: int) -> list[Finding]:
    """The drafter's sliding window and longest training context against the context it will draft after."""
    warnings = context_warnings(cfg, context)
    if warnings:
        fix = "compare τ per length with `dflashkit eval --dataset long-context`"
        return [Finding("WARN", "context", w, fix) for w in warnings]
    trained = trained_context(cfg)
    if trained is None:
        return [
            Finding(
                "WARN",
                "context",
                f"{context} tokens of context: this checkpoint has not recorded its longest training context",
                "measure τ per length with `dflashkit eval --dataset long-context`",
            )
        ]
    return [Finding("OK", "context", f"{context} tokens of context: within the longest training context ({trained})")]


def memory_finding(train_config: str | Path) -> Finding:
    """Will the training run of `train_config` (a YAML) fit its device: the estimate `train` checks before it loads
    anything (`train.memory_check`), against the device's total memory (doctor itself holds a target now), for
    this process's world size (1 outside torchrun)."""
    from dflashkit.target.devices import resolve_device
    from dflashkit.target.distributed import read_env
    from dflashkit.train.config import TrainConfig
    from dflashkit.train.memory_check import device_memory, fit_problem, run_memory

    cfg = TrainConfig.load(str(train_config), [])
    cfg.validate()
    if str(cfg.target).endswith(".gguf"):
        return Finding("WARN", "training memory", f"{train_config}: not estimated for a .gguf target (no config.json)")
    world, _, local = read_env()
    device = resolve_device(cfg.drafter_device, local)
    problem = fit_problem(cfg, available=device_memory(device, total=True), device=device)
    if problem:
        return Finding("FAIL", "training memory", problem, "see the changes named, or run `dflashkit plan`")
    est = run_memory(cfg, device=device)
    parts = ", ".join(f"{k} {v / 2**30:,.2f}" for k, v in {**est.parts, **est.phases}.items())
    return Finding(
        "OK", "training memory", f"{train_config}: about {est.peak / 2**30:,.2f} GiB per step on {device}, {world} "
        f"rank(s) ({parts} GiB)",
    )  # fmt: skip


def usable_tokenizer(target: Any) -> Any:
    """The target's tokenizer, or None when it has none or an empty one (transformers makes an empty Qwen2
    tokenizer for a model directory without tokenizer files)."""
    tok = target.tokenizer
    try:
        return tok if tok is not None and len(tok(ORDINARY_TEXT, add_special_tokens=False)["input_ids"]) > 1 else None
    except Exception:  # a tokenizer that cannot encode plain text is no use here
        return None


__all__ = [
    "capture_findings",
    "chat_template_findings",
    "config_fit",
    "geometry_finding",
    "greedy_reference",
    "label_offset_accuracy",
    "manifest_findings",
    "mask_finding",
    "memory_finding",
    "shift_finding",
    "usable_tokenizer",
]


# ---------------------------------------------------------------------------------------------- the run
DOCTOR_PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a short Python function that reverses a string.",
    "List three tips for staying focused while studying.",
)


@dataclass
class DoctorReport:
    findings: list[Finding] = field(default_factory=list)
    tau: float | None = None
    offsets: dict[int, float] | None = None

    def add(self, status: str, check: str, what: str, fix: str = "") -> None:
        self.findings.append(Finding(status, check, what, fix))

    @property
    def exit_code(self) -> int:
        return 1 if any(f.status == "FAIL" for f in self.findings) else 0

    def render(self) -> str:
        n = {s: sum(f.status == s for f in self.findings) for s in ("OK", "WARN", "FAIL")}
        return "\n".join([f.line() for f in self.findings] + [f"{n['FAIL']} FAIL, {n['WARN']} WARN, {n['OK']} OK"])


def _prompts(target: Any, cfg: DrafterConfig, n: int) -> list[list[int]]:
    tok = usable_tokenizer(target)
    if tok is not None:
        from dflashkit.data.conversations import encode_prompt

        out = []
        for text in (DOCTOR_PROMPTS * (n // len(DOCTOR_PROMPTS) + 1))[:n]:
            if getattr(tok, "chat_template", None):
                out.append(
                    encode_prompt(tok, [{"role": "user", "content": text}], cfg.extra.get("chat_template_kwargs"))
                )
            else:
                out.append(list(tok(text)["input_ids"]))
        return out
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, target.vocab_size, (12 + 3 * i,), generator=gen).tolist() for i in range(n)]


# ---------------------------------------------------------------------------------------------- entry point
def engine_findings(path: Path, verdicts: list[dict[str, str]], target: Any) -> list[Finding]:
    """One line per serving engine (loads / converts / degrades / refuses / unverified, export/engines.py), and the
    serving layout's LM-head rows checked against the target's: other rows draft another distribution in vLLM."""
    status = {"loads": "OK", "unverified": "OK", "converts": "WARN", "degrades": "WARN", "refuses": "WARN"}
    out = [
        Finding(status[v["verdict"]], f"engine {v['engine']}", v["verdict"] + (f": {v['why']}" if v["why"] else ""))
        for v in verdicts
    ]
    from dflashkit.drafter.checkpoint import from_serving_layout, read_tensors

    try:
        tensors = read_tensors(path) if verdicts else {}
    except CheckpointError:  # unreadable weights: the load check below reports them
        tensors = {}
    if "lm_head.weight" in tensors and "d2t" in tensors:
        ids = from_serving_layout(tensors, str(path))["draft_to_target"]  # absolute target ids of the draft rows
        rows = target.lm_head_weight.detach().cpu().float().index_select(0, ids)
        shipped = tensors["lm_head.weight"].float()
        if shipped.shape != rows.shape or not torch.allclose(shipped, rows, rtol=1e-2, atol=1e-3):
            out.append(
                Finding(
                    "FAIL",
                    "engine head rows",
                    "lm_head.weight is not this target's LM-head rows of the d2t ids: vLLM would draft from another "
                    "head than dflashkit",
                    f"re-export: {shell_line('dflashkit', 'convert', path, 'OUT', '--to', 'vllm')} --target TARGET",
                )
            )
        else:
            out.append(Finding("OK", "engine head rows", f"lm_head.weight = the target's rows of {len(ids)} draft ids"))
    return out


def run_doctor(
    target: Any,
    drafter: str | Path | DFlashDrafter,
    *,
    prompts: int = 3,
    prompt_ids: list[list[int]] | None = None,
    max_new_tokens: int = 32,
    features: str | Path | None = None,
    context: int | None = None,
    train_config: str | Path | None = None,
) -> DoctorReport:
    """Run every check; `drafter` is a checkpoint directory or a loaded `DFlashDrafter`; `context`: the context
    length it will draft after (its sliding window and longest training context are checked against it);
    `train_config`: a training YAML whose memory per step is checked against its device."""
    from dflashkit.decode.generate import DecodeSettings, generate

    report = DoctorReport()
    module: DFlashDrafter | None = None
    load_error: Finding | None = None
    if isinstance(drafter, DFlashDrafter):
        module, cfg = drafter, drafter.config
        fc_features = module.fc.in_features // cfg.hidden_size
    else:
        ins = inspect_checkpoint(drafter)
        report.findings += [f for f in ins.findings if f.status != "OK" and f.check != "fc width"]
        cfg, fc_features = ins.config, ins.facts.get("fc_features")
        if cfg is None:
            return report
        report.findings += engine_findings(Path(drafter), ins.facts.get("engines", []), target)
        try:
            from dflashkit.export.convert import load_any_drafter  # speculators: as converted

            module = load_any_drafter(drafter, target=target, device=target.device)
            cfg = module.config  # a speculators config takes the target's depth from the target
        except CheckpointError as e:
            load_error = Finding("FAIL", "load", str(e), "the drafter cannot run as it is: fix the checkpoint")
    fit = config_fit(cfg, target, fc_features if isinstance(fc_features, int) else None)
    report.findings += fit + ([load_error] if load_error else []) + chat_template_findings(cfg, target)
    if features is not None:
        report.findings += manifest_findings(cfg, target, features)
    if context is not None:
        report.findings += context_findings(cfg, context)
    if train_config is not None:
        report.findings.append(memory_finding(train_config))
    runnable = module is not None and not any(f.status == "FAIL" for f in fit if f.check != "geometry")
    plist = prompt_ids or _prompts(target, cfg, max(1, prompts))
    layer_ids = [i for i in cfg.target_layer_ids if 0 <= i < target.num_layers] or [target.num_layers // 2]
    report.findings += capture_findings(target, layer_ids, torch.tensor([plist[0][:32]]))
    transcripts: list[list[int]] = []
    for p in plist:
        transcripts.append(list(p) + greedy_reference(target, p, max_new_tokens))
    if not runnable:
        report.findings.append(mask_finding(cfg, module, target, transcripts))
        report.add(
            "WARN", "draft-and-verify", "not run: the drafter does not fit or does not load", "fix the FAIL lines above"
        )
        return report
    module.eval()
    report.findings.append(mask_finding(cfg, module, target, transcripts))
    taus, mismatch = [], []
    for p, full in zip(plist, transcripts, strict=True):
        res = generate(
            target, p, drafter=module, settings=DecodeSettings(method="chain", max_new_tokens=max_new_tokens)
        )
        taus.append(res.tau)
        want = full[len(p) :]
        if res.tokens != want:
            pairs = zip(res.tokens, want, strict=False)  # over the shorter one: a length difference counts below
            i = next((j for j, (x, y) in enumerate(pairs) if x != y), min(len(res.tokens), len(want)))
            mismatch.append(
                f"prompt {len(taus) - 1}: token {i} is {res.tokens[i] if i < len(res.tokens) else None}, "
                f"greedy gives {want[i] if i < len(want) else None}"
            )
    report.tau = sum(taus) / len(taus)
    if mismatch:
        numeric = (
            ""
            if target.dtype == torch.float32
            else " (in bf16/fp16 a late divergence can be rounding: rerun with --dtype fp32)"
        )
        report.add(
            "FAIL",
            "draft-and-verify",
            f"speculative output differs from the target's greedy output ({'; '.join(mismatch)})",
            f"verification is not lossless: check cache cropping and acceptance{numeric}",
        )
    elif report.tau < 1.1:
        report.add(
            "WARN",
            "draft-and-verify",
            f"output equals greedy on {len(plist)} prompts, but τ "
            f"{report.tau:.2f}: the drafter is almost never accepted",
            "untrained, or trained on other features/labels",
        )
    else:
        report.add(
            "OK",
            "draft-and-verify",
            f"output equals greedy on {len(plist)} prompts, τ {report.tau:.2f} "
            f"(per prompt {', '.join(f'{t:.2f}' for t in taus)})",
        )
    counts: dict[int, list[int]] = {-1: [0, 0], 0: [0, 0], 1: [0, 0]}
    for p, full in zip(plist, transcripts, strict=True):
        for d, (c, n) in label_offset_accuracy(module, target, full, len(p)).items():
            counts[d][0] += c
            counts[d][1] += n
    report.offsets = {d: c / n if n else 0.0 for d, (c, n) in counts.items()}
    report.findings.append(shift_finding(counts))
    return report


__all__ = ["DoctorReport", "run_doctor"]
