"""`dflashkit doctor --target T --drafter D`: checks to run before anyone spends GPU hours on a drafter.

    dflashkit doctor --target default --drafter runs/smollm2/train/final --prompts 3
    dflashkit doctor --target Qwen/Qwen3-8B --drafter zlab/ --features runs/q3/features

Each finding is one line `OK|WARN|FAIL <check>: <what> — fix: <how>`; the exit status is 1 when any check FAILs.
Checks: the checkpoint itself (inspect), hidden size and vocabulary fit, target_layer_ids in range and distinct,
fc width = named layers, mask token usable, geometry not copied from the target, chat template recorded at
training = the target's now, hook-captured features = `output_hidden_states[i + 1]`, verifier logits = the
target's own logits, a short greedy draft-and-verify run (τ; output = the target's greedy output), and labels or
features shifted by one, found from the checkpoint alone: the drafter runs teacher-forced on the target's greedy
transcript and its slot-k predictions are scored against the token at a+k−1, a+k and a+k+1.
The checks themselves are in `doctor_checks.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflashkit.diagnose.doctor_checks import (
    capture_findings,
    chat_template_findings,
    config_fit,
    greedy_reference,
    label_offset_accuracy,
    manifest_findings,
    mask_finding,
    shift_finding,
    usable_tokenizer,
)
from dflashkit.diagnose.inspect_checkpoint import Finding, inspect_checkpoint
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import CheckpointError

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
                    f"re-export: dflashkit convert {path} OUT --to vllm --target TARGET",
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
) -> DoctorReport:
    """Run every check; `drafter` is a checkpoint directory or a loaded `DFlashDrafter`."""
    from dflashkit.decode.generate import generate

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
        res = generate(target, p, drafter=module, method="chain", max_new_tokens=max_new_tokens)
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
