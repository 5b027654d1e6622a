"""`dflashkit serve-check`: run a drafter in a real serving engine on the same prompts as dflashkit's own chain
decoding, and compare token for token and position by position.

    report = serve_check(target, "runs/quickstart/drafter", engines=["vllm"], prompts=prompts, max_new_tokens=64)
    print(report.render())                     # per engine: tokens identical?, drafts, accepted per position, τ

The most common DFlash complaint is a drafter that looks good in training and accepts almost nothing when served
(export, mask, layer ids, vocabulary map, chat template, thinking mode). dflashkit measures acceptance exactly, so
it can check the engine: greedy, EOS ignored, the same prompt token ids on both sides.
- dflashkit: `decode.generate(method="chain")` per prompt; drafts = rounds, accepted per position j = rounds
  whose first j + 1 drafts were all accepted.
- llama.cpp: `export/llamacpp_check.py` — its own loop, compared round by round (see there).
- vLLM: `export/vllm_runner.py` in the vLLM environment (`scripts/setup_vllm.sh` → `.venv-vllm`, or
  DFLASHKIT_VLLM_PYTHON), offline `LLM` with `method: dflash`, `num_speculative_tokens` = block_size − 1, the
  counts read from vLLM's metrics (`vllm:spec_decode_num_drafts`, `…_num_accepted_tokens_per_pos`) per prompt.
Counting convention (measured against vLLM 0.32): a round drafts block_size − 1 tokens even where fewer can
still be kept, and its accepted drafts are counted before the output is cut at max_new_tokens — so dflashkit's
side decodes a block past max_new_tokens and counts the rounds that start before it, untruncated.
A mismatch names the first differing prompt, the round (from the tokens, or the first position whose count
differs) and the likely causes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflashkit.drafter.context_reach import smallest_window
from dflashkit.errors import DFlashError

ENGINES = ("vllm", "llamacpp")
VLLM_PYTHON_ENV = "DFLASHKIT_VLLM_PYTHON"
DRAFTER_CAUSES = (
    "the engine runs another drafter than dflashkit measured: the mask (mask_token_id, or a learned mask "
    "without mask_embedding.pt), the layer ids (target_layer_ids off by one), the vocabulary map (d2t offsets "
    "vs absolute ids, lm_head rows), the block size, or the causal flags — `dflashkit inspect DRAFTER` lists "
    "what each engine reads"
)
TOKEN_CAUSES = (
    "the engine's greedy output differs from the target's own: a different dtype or kernel numerics (serve-check "
    "runs fp32), different prompt token ids (chat template, thinking mode, BOS), or a target the engine loads "
    "differently — verification is lossless, so the drafter cannot change the output"
)


class EngineUnavailable(DFlashError):
    """The engine's environment is not set up (e.g. no `.venv-vllm`): one line, exit 2."""


@dataclass
class PromptCounts:
    tokens: list[int]
    drafts: int
    accepted: int
    accepted_per_pos: list[int]


@dataclass
class EngineComparison:
    engine: str
    version: str
    ours: list[PromptCounts]
    theirs: list[PromptCounts]
    mismatches: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        return not self.mismatches


def tau(counts: list[PromptCounts]) -> float:
    drafts = sum(c.drafts for c in counts)
    return (sum(c.accepted for c in counts) + drafts) / drafts if drafts else 0.0


def per_position(counts: list[PromptCounts]) -> list[int]:
    width = max((len(c.accepted_per_pos) for c in counts), default=0)
    return [sum(c.accepted_per_pos[j] for c in counts if j < len(c.accepted_per_pos)) for j in range(width)]


@dataclass
class ServeCheckReport:
    drafter: str
    target: str
    prompts: int
    max_new_tokens: int
    block_size: int
    engines: list[EngineComparison]

    @property
    def agrees(self) -> bool:
        return all(e.agrees for e in self.engines)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for e, raw in zip(self.engines, d["engines"], strict=True):
            raw["agrees"] = e.agrees
            raw["summary"] = {
                side: {
                    "drafts": sum(c.drafts for c in counts),
                    "accepted": sum(c.accepted for c in counts),
                    "accepted_per_pos": per_position(counts),
                    "tau": round(tau(counts), 4),
                }
                for side, counts in (("dflashkit", e.ours), (e.engine, e.theirs))
            }
            for side in ("ours", "theirs"):
                for c in raw[side]:
                    c.pop("tokens")
        d["agrees"] = self.agrees
        return d

    def render(self) -> str:
        lines = [
            f"serve-check {self.drafter} on {self.target}: {self.prompts} prompts × {self.max_new_tokens} tokens, "
            f"greedy, block {self.block_size}"
        ]
        for e in self.engines:
            lines.append(f"  {'':<11} {'tokens':<10} {'drafts':>7} {'accepted per position':<26} {'τ':>6}")
            same = all(a.tokens == b.tokens for a, b in zip(e.ours, e.theirs, strict=True))
            for name, counts in (("dflashkit", e.ours), (f"{e.engine} {e.version}", e.theirs)):
                lines.append(
                    f"  {name:<11} {('identical' if same else 'DIFFER'):<10} {sum(c.drafts for c in counts):>7} "
                    f"{per_position(counts)!s:<26} {tau(counts):>6.3f}"
                )
            lines.append(f"  {e.engine}: " + ("agrees with dflashkit exactly" if e.agrees else "MISMATCH"))
            lines += [f"    {m}" for m in e.mismatches] + [f"    note: {n}" for n in e.notes]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- dflashkit's side
def dflashkit_counts(target: Any, drafter: Any, prompt: list[int], max_new_tokens: int) -> PromptCounts:
    """Chain decoding with the engines' counting convention (module docstring)."""
    from dflashkit.decode.generate import DecodeSettings, generate

    bs = drafter.config.block_size
    res = generate(
        target, prompt, drafter=drafter, settings=DecodeSettings(method="chain", max_new_tokens=max_new_tokens + bs)
    )
    slots = bs - drafter.first_draft_slot()  # drafts a round proposes (DSpark: every slot)
    drafts, accepted, per_pos, done = 0, 0, [0] * slots, 1  # the first token comes from prefill
    for length in res.acceptance_lengths:
        if done >= max_new_tokens:
            break
        drafts += 1
        accepted += length - 1
        for j in range(length - 1):
            per_pos[j] += 1
        done += length
    return PromptCounts(res.tokens[:max_new_tokens], drafts, accepted, per_pos)


# ---------------------------------------------------------------------------------------------- vLLM's side
def vllm_python() -> Path | None:
    """The vLLM environment's Python: $DFLASHKIT_VLLM_PYTHON, else `.venv-vllm` in the working directory or the
    project checkout (scripts/setup_vllm.sh makes it); None when there is none."""
    env = os.environ.get(VLLM_PYTHON_ENV)
    if env:
        return Path(env) if Path(env).is_file() else None
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        candidate = root / ".venv-vllm" / "bin" / "python"
        if candidate.is_file():
            return candidate
    return None


def run_vllm(
    target_dir: str | Path,
    drafter_dir: str | Path,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    num_speculative_tokens: int,
    timeout: float = 1800,
) -> tuple[str, list[PromptCounts]]:
    """(vLLM version, counts per prompt) from a vLLM run in its own environment."""
    python = vllm_python()
    if python is None:
        raise EngineUnavailable(
            f"no vLLM environment: run `bash scripts/setup_vllm.sh` (makes .venv-vllm) or set {VLLM_PYTHON_ENV}"
        )
    runner = Path(__file__).with_name("vllm_runner.py")
    longest = max(len(p) for p in prompts)
    with tempfile.TemporaryDirectory(prefix="dflashkit-vllm-") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(
            json.dumps(
                {
                    "target": str(target_dir),
                    "drafter": str(Path(drafter_dir).resolve()),
                    "prompts": prompts,
                    "max_new_tokens": max_new_tokens,
                    "num_speculative_tokens": num_speculative_tokens,
                    "dtype": "float32",
                    "max_model_len": longest + max_new_tokens + 2 * num_speculative_tokens + 8,
                }
            )
        )
        try:
            proc = subprocess.run(
                [str(python), str(runner), str(request), str(result)],
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise EngineUnavailable(f"vLLM did not finish within {timeout:.0f} s") from None
        if proc.returncode != 0 or not result.is_file():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            raise EngineUnavailable(f"vLLM failed (exit {proc.returncode}):\n{tail}")
        data = json.loads(result.read_text())
    counts = [PromptCounts(p["tokens"], p["drafts"], p["accepted"], p["accepted_per_pos"]) for p in data["prompts"]]
    return str(data["vllm"]), counts


# ---------------------------------------------------------------------------------------------- comparison
def window_cause(window: int | None, prompt_tokens: int) -> str | None:
    """Why acceptance may differ at a long prompt: the drafter has sliding-window layers (`window` tokens, None: none)
    and the prompt is longer, so an engine that runs them as full attention drafts from more context than
    dflashkit's drafter reads (None when that cannot be the reason)."""
    if window is None or prompt_tokens <= window:
        return None
    return (
        f"the drafter's sliding-window layers (window {window}) at a prompt of {prompt_tokens} tokens: an engine that "
        "runs them as full attention (ignoring the window) drafts differently beyond it"
    )


def compare(
    ours: list[PromptCounts],
    theirs: list[PromptCounts],
    block_size: int,
    *,
    window: int | None = None,
    prompt_tokens: list[int] | None = None,
) -> list[str]:
    """Mismatch lines (empty when the engine agrees exactly): the first differing prompt and round, and why.
    `window`: the drafter's sliding window (None: every layer attends fully), `prompt_tokens`: each prompt's length."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a.tokens != b.tokens:
            k = next((j for j, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y), None)
            k = min(len(a.tokens), len(b.tokens)) if k is None else k
            return [
                f"prompt {i}: token {k} differs (dflashkit {a.tokens[k] if k < len(a.tokens) else None}, engine "
                f"{b.tokens[k] if k < len(b.tokens) else None})",
                f"likely: {TOKEN_CAUSES}",
            ]
        width = max(block_size - 1, len(a.accepted_per_pos), len(b.accepted_per_pos))
        per_a = a.accepted_per_pos + [0] * (width - len(a.accepted_per_pos))
        per_b = b.accepted_per_pos + [0] * (width - len(b.accepted_per_pos))
        if a.drafts != b.drafts or per_a != per_b:
            j = next((j for j, (x, y) in enumerate(zip(per_a, per_b, strict=True)) if x != y), None)
            where = f"first at draft position {j}" if j is not None else "in the number of rounds"
            windowed = window_cause(window, prompt_tokens[i]) if prompt_tokens else None
            return [
                f"prompt {i}: same tokens, different acceptance {where} (dflashkit {a.drafts} drafts, accepted per "
                f"position {per_a}; engine {b.drafts} drafts, {per_b})",
                *([f"likely: {windowed}"] if windowed else []),
                f"{'else' if windowed else 'likely'}: {DRAFTER_CAUSES}",
            ]
    return []


def serve_check(
    target: Any,
    drafter_dir: str | Path,
    *,
    prompts: list[list[int]],
    max_new_tokens: int = 64,
    engines: list[str] | tuple[str, ...] = ("vllm",),
    target_gguf: str | Path | None = None,
    progress: bool = True,
) -> ServeCheckReport:
    """Run `drafter_dir` in each engine and in dflashkit on `prompts` (token ids) and compare; llama.cpp runs
    `target_gguf` (default: the embedded SmolLM2 as F32)."""
    from tqdm import tqdm

    from dflashkit.export.convert import load_any_drafter

    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise DFlashError(f"unknown engine(s) {unknown}; expected one of {', '.join(ENGINES)}")
    drafter = load_any_drafter(drafter_dir, target=target, device=target.device).eval()
    bs = drafter.config.block_size
    if drafter.head.format.vllm_cpu_problem and "vllm" in engines:
        raise EngineUnavailable(drafter.head.format.vllm_cpu_problem)
    if "llamacpp" in engines:  # before dflashkit's own decoding: what llama.cpp's graph cannot run is known now
        from dflashkit.export.gguf_export import export_problems

        if export_problems(drafter.config):
            raise EngineUnavailable(f"llama.cpp cannot run this drafter: {'; '.join(export_problems(drafter.config))}")
    ours = [
        dflashkit_counts(target, drafter, p, max_new_tokens)
        for p in tqdm(prompts, desc="dflashkit chain", disable=not progress, file=sys.stderr)
    ]
    out = []
    for engine in engines:
        if engine == "llamacpp":
            out.append(_llamacpp(target, drafter, drafter_dir, prompts, ours, max_new_tokens, target_gguf, progress))
            continue
        version, theirs = run_vllm(
            target.source, drafter_dir, prompts, max_new_tokens=max_new_tokens, num_speculative_tokens=bs - 1
        )
        found = compare(
            ours,
            theirs,
            _width(drafter),
            window=smallest_window(drafter.config),
            prompt_tokens=[len(p) for p in prompts],
        )
        out.append(EngineComparison(engine, version, ours, theirs, found))
    return ServeCheckReport(str(drafter_dir), str(target.source), len(prompts), max_new_tokens, bs, out)


def _width(drafter: Any) -> int:
    """1 + the drafts a round proposes: the block size for DFlash, one more for DSpark (what `compare` takes)."""
    return drafter.head.verify_width(drafter.config.block_size)


def _llamacpp(
    target: Any,
    drafter: Any,
    drafter_dir: str | Path,
    prompts: list[list[int]],
    chain: list[PromptCounts],
    max_new_tokens: int,
    target_gguf: str | Path | None,
    progress: bool,
) -> EngineComparison:
    """llama.cpp round by round (export/llamacpp_check.py): its counts against dflashkit's drafter's on the same
    rounds, its output against dflashkit's greedy output."""
    from tqdm import tqdm

    from dflashkit.export import llamacpp
    from dflashkit.export.gguf_export import export_gguf
    from dflashkit.export.llamacpp_check import TIE, llamacpp_side

    if not llamacpp.built():
        raise EngineUnavailable("llama.cpp is not built: run `bash scripts/build_llamacpp.sh`")
    if target_gguf is None:
        from dflashkit.target.default import default_target_dir

        if Path(str(target.source)).resolve() != default_target_dir().resolve():
            raise EngineUnavailable("--target-gguf is needed for llama.cpp: an F32 GGUF of this target")
        target_gguf = llamacpp.f32_target_gguf()
    theirs, ours, ties = [], [], 0
    with tempfile.TemporaryDirectory(prefix="dflashkit-llamacpp-") as tmp:
        gguf = Path(tmp) / "drafter.gguf"
        export_gguf(drafter_dir, gguf, target=target_gguf, outtype="f32")
        for ids, mine in zip(
            tqdm(prompts, desc="llama.cpp", disable=not progress, file=sys.stderr), chain, strict=True
        ):
            t, o, n_ties = llamacpp_side(target, drafter, gguf, target_gguf, ids, max_new_tokens, mine.tokens)
            ties += n_ties
            theirs.append(PromptCounts(t["tokens"], t["drafts"], sum(t["accepted_per_pos"]), t["accepted_per_pos"]))
            ours.append(PromptCounts(mine.tokens, o["drafts"], sum(o["accepted_per_pos"]), o["accepted_per_pos"]))
    notes = [
        "llama.cpp's rounds differ from dflashkit's (its first block starts at the last prompt token; it drafts no "
        "more than the output keeps): the dflashkit row is its drafter's acceptance on llama.cpp's rounds"
    ]
    if ties:
        notes.append(f"{ties} draft slot(s) were numerical ties (dflashkit's top-2 logits within {TIE})")
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        tie = target_tie(target, prompts[i], a.tokens, b.tokens)
        if tie is not None:  # the target's own near-tie: from there both outputs are right, only rounded differently
            k, margin = tie
            notes.append(
                f"prompt {i}: the outputs part at token {k}, a near-tie of the target itself (top-2 logits "
                f"{margin:.4f} apart < {TIE}): float rounding, not the drafter; acceptance is compared on llama.cpp's "
                f"own rounds"
            )
            a.tokens = list(b.tokens)
    found = compare(
        ours, theirs, _width(drafter), window=smallest_window(drafter.config), prompt_tokens=[len(p) for p in prompts]
    )
    return EngineComparison("llama.cpp", llamacpp.VERSION, ours, theirs, found, notes)


def target_tie(target: Any, prompt: list[int], ours: list[int], theirs: list[int]) -> tuple[int, float] | None:
    """(k, margin) when the two outputs first differ at token k and the target's top-2 logits there are within TIE
    (PyTorch, fp32); None when they agree or differ clearly."""
    import torch

    from dflashkit.cpu_products import stock_products
    from dflashkit.export.llamacpp_check import TIE

    k = next((j for j, (x, y) in enumerate(zip(ours, theirs, strict=False)) if x != y), None)
    if k is None:
        return None
    with torch.no_grad(), stock_products():
        logits = target.forward(torch.tensor([list(prompt) + list(ours[:k])]), layer_ids=[], logits=True).logits
    top = logits[0, -1].float().topk(2)
    margin = float(top.values[0] - top.values[1])
    return (k, margin) if margin < TIE and theirs[k] in top.indices.tolist() else None


__all__ = [
    "ENGINES",
    "EngineComparison",
    "EngineUnavailable",
    "PromptCounts",
    "ServeCheckReport",
    "compare",
    "dflashkit_counts",
    "run_vllm",
    "serve_check",
    "vllm_python",
]
