"""Drive a local llama.cpp build (scripts/build_llamacpp.sh): find its tools, make an F32 target GGUF, run plain
and speculative decoding, and read back what llama.cpp did — for the opt-in engine tests and bench/llamacpp.py.

    from dflashkit.export.llamacpp import built, run_speculative
    if built():
        run = run_speculative(target_gguf, prompt, drafter="d.gguf", n_max=3, n_predict=64)
        run.rounds          # [Round(draft=[…], accepted=a, last=id)], one per verification
        run.generated_ids   # every committed token id, in order

The drafts are read from `llama-speculative-simple -v` (its debug lines "draft candidate 0, pos i: ID" and
"accepted a/n draft tokens, the last target token is: (ID)", common/speculative.cpp and
examples/speculative-simple/speculative-simple.cpp); timings from its "decoded N tokens in S seconds" and the
draft statistics line ("dur(b,g,a) = …": g = total draft-generation milliseconds). `run_batched_bench` reads
`llama-batched-bench`'s table: llama.cpp's own batched decoding, the ceiling a llama-server on the machine approaches.
Build home: `$LLAMACPP_HOME`, else `<dflashkit cache>/llama.cpp-11434` (DFLASHKIT_CACHE moves the cache).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from dflashkit.errors import DFlashError

VERSION = "11434"
_DRAFT = re.compile(r"draft candidate\s+0, pos\s+(\d+):\s+(-?\d+)")
_ACCEPT = re.compile(r"accepted (\d+)/(\d+) draft tokens, the last target token is: \((-?\d+)\)")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DUR = re.compile(r"statistics\s+(\S+):.*?#gen drafts =\s*(\d+).*?dur\(b,g,a\) =\s*([\d.]+),\s*([\d.]+),\s*([\d.]+) ms")
_COUNT = re.compile(r"\b(n_predict|n_drafted|n_accept)\s*=\s*(\d+)")
_EVAL = re.compile(r"\seval time =\s+([\d.]+) ms /\s+(\d+) runs")
_VARIANT = re.compile(r"loaded CPU backend from \S*?ggml-cpu-([A-Za-z0-9_.]+?)\.(?:so|dll|dylib)")


class LlamaCppError(DFlashError):
    """The llama.cpp build is missing, or one of its tools failed."""


def home() -> Path:
    if os.environ.get("LLAMACPP_HOME"):
        return Path(os.environ["LLAMACPP_HOME"]).expanduser()
    from dflashkit.io_utils import cache_root

    return cache_root() / f"llama.cpp-{VERSION}"


def built() -> bool:
    """Whether scripts/build_llamacpp.sh has finished (its stamp file exists)."""
    return (home() / ".built").is_file()


def tool(name: str) -> Path:
    path = home() / "bin" / name
    if not path.is_file():
        raise LlamaCppError(f"{path} not found: run scripts/build_llamacpp.sh first")
    return path


TARGET_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M")  # what llama-quantize makes for the target


def target_gguf(kind: str = "F32") -> Path:
    """The embedded SmolLM2 target as a GGUF of another storage type (llama-quantize; made once): F32 holds exactly the
    fp32 target's weights (the shipped Q4_1 values, dequantized); F16 / BF16 / Q8_0 round them; Q4_0 / Q4_K_M
    re-quantize the F32 file to the 4-bit types users serve."""
    from dflashkit.target.default import DEFAULT_TARGET_NAME, gguf_path

    kind = kind.upper()
    if kind not in TARGET_GGUF_TYPES:
        raise LlamaCppError(f"GGUF type {kind!r}: expected one of {', '.join(TARGET_GGUF_TYPES)}")
    out = home() / "models" / f"{DEFAULT_TARGET_NAME}.{kind}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp.gguf")
        source = gguf_path() if kind == "F32" else target_gguf("F32")
        _run([str(tool("llama-quantize")), "--allow-requantize", str(source), str(tmp), kind])
        os.replace(tmp, out)
    return out


def f32_target_gguf() -> Path:
    """The embedded SmolLM2 target as an F32 GGUF: exactly the fp32 target's weights."""
    return target_gguf("F32")


def _run(cmd: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or "").splitlines()[-15:])
        raise LlamaCppError(f"{Path(cmd[0]).name} failed (exit {proc.returncode}):\n{tail}")
    return proc


def parse_batched_bench(text: str) -> dict[int, float]:
    """`llama-batched-bench`'s table → {parallel sequences B: generated tokens per second over the whole run}
    (B × TG tokens over T seconds: the prefill of the B prompts included, as a regeneration run counts it)."""
    rates: dict[int, float] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]  # PP TG B N_KV T_PP S_PP T_TG S_TG T S
        if len(cells) != 10:
            continue
        try:
            new_tokens, parallel, seconds = int(cells[1]), int(cells[2]), float(cells[8])
        except ValueError:
            continue  # the header and its rule
        if seconds > 0:
            rates[parallel] = parallel * new_tokens / seconds
    return rates


def run_batched_bench(
    gguf: str | Path, parallel: list[int], prompt_tokens: int, new_tokens: int, threads: int, timeout: float = 1800
) -> dict[int, float]:
    """Generated tokens/s of llama.cpp decoding `p` sequences together for each `p` in `parallel` (each its own
    `prompt_tokens`-token prompt, then `new_tokens` tokens; no server, no HTTP, no early stop)."""
    ctx = max(parallel) * (prompt_tokens + new_tokens) + 256
    cmd = [str(tool("llama-batched-bench")), "-m", str(gguf), "-c", str(ctx), "-npp", str(prompt_tokens)]
    cmd += ["-ntg", str(new_tokens), "-npl", ",".join(map(str, parallel)), "-t", str(threads), "-tb", str(threads)]
    done = _run(cmd, timeout)
    rates = parse_batched_bench(done.stdout + "\n" + done.stderr)
    if missing := [p for p in parallel if p not in rates]:
        raise LlamaCppError(f"llama-batched-bench: no result for {missing} parallel sequences in its output")
    return rates


@dataclass
class Round:
    """One llama.cpp verification: the drafts it proposed, how many were accepted, the target's next token."""

    draft: list[int]  # as logged; DFlash2's selector walk logs none (`SpecRun.fill_unlogged`)
    accepted: int
    last: int
    drafted: int | None = None  # drafts proposed (the n of "accepted a/n"); None: as many as logged

    def __post_init__(self) -> None:
        if self.drafted is None:
            self.drafted = len(self.draft)


@dataclass
class SpecRun:
    """What one llama-speculative-simple / llama-completion run did."""

    text: str
    rounds: list[Round] = field(default_factory=list)
    decoded_tokens: int = 0
    decode_s: float = 0.0
    draft_ms: float = 0.0  # total draft-generation time (spec statistics 'g')
    counts: dict[str, int] = field(default_factory=dict)  # n_predict (committed), n_drafted, n_accept
    log: str = ""

    @property
    def cpu_variant(self) -> str | None:
        """The CPU backend the run loaded (e.g. 'haswell'), from its log; None for a build without variants."""
        return cpu_variant(self.log)

    @property
    def n_rounds(self) -> int:
        """Verifications: parsed rounds, else committed − accepted (each round commits accepted + 1)."""
        if self.rounds:
            return len(self.rounds)
        return self.counts.get("n_predict", 0) - self.counts.get("n_accept", 0)

    def fill_unlogged(self, tokens: list[int]) -> None:
        """Rounds whose drafts llama.cpp does not log (DFlash2's selector walk prints none): their accepted drafts
        taken from `tokens`, an output they must equal — each round's own token (`last`, logged) is checked against
        it, and filling stops at the first round where it differs (the generated ids then show the difference)."""
        pos = 0
        for r in self.rounds:
            if len(r.draft) < r.accepted:
                r.draft = list(tokens[pos : pos + r.accepted])
                if len(r.draft) < r.accepted or pos + r.accepted >= len(tokens) or tokens[pos + r.accepted] != r.last:
                    return
            pos += r.accepted + 1

    @property
    def generated_ids(self) -> list[int]:
        out: list[int] = []
        for r in self.rounds:
            out += [*r.draft[: r.accepted], r.last]
        return out

    @property
    def tokens_per_s(self) -> float:
        return self.decoded_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def tau(self) -> float:
        """Committed tokens per verification (accepted drafts + the target's own token)."""
        if self.rounds:
            return sum(r.accepted + 1 for r in self.rounds) / len(self.rounds)
        return self.counts.get("n_predict", 0) / self.n_rounds if self.n_rounds else 0.0


_SYSTEM_INFO = re.compile(r"system_info:.*?\bCPU : ([^\n]*)")
# ggml's x86 variants (ggml/src/CMakeLists.txt), most specific first: the features that set each apart
_X86_VARIANTS = (
    ("sapphirerapids", {"AMX_INT8"}),
    ("zen4", {"AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"}),
    ("cooperlake", {"AVX512", "AVX512_VNNI", "AVX512_BF16"}),
    ("icelake", {"AVX512", "AVX512_VBMI", "AVX512_VNNI"}),
    ("cascadelake", {"AVX512", "AVX512_VNNI"}),
    ("cannonlake", {"AVX512", "AVX512_VBMI"}),
    ("skylakex", {"AVX512"}),
    ("alderlake", {"AVX2", "AVX_VNNI"}),
    ("haswell", {"AVX2", "BMI2"}),
    ("piledriver", {"AVX", "F16C", "FMA"}),
    ("ivybridge", {"AVX", "F16C"}),
    ("sandybridge", {"AVX"}),
)


def cpu_variant(log: str) -> str | None:
    """Which of the build's CPU backends (libggml-cpu-<variant>.so, one per x86 level) a run loaded: from the
    loader's line when the log has it, else from the instruction-set features the run's `system_info` line lists
    (those of the backend that was loaded). None when neither is in the log."""
    found = _VARIANT.findall(log)
    if found:
        return found[-1]
    info = _SYSTEM_INFO.findall(log)
    if not info:
        return None
    features = {k.strip() for k, _, v in (f.partition("=") for f in info[-1].split("|")) if v.strip() == "1"}
    for name, needs in _X86_VARIANTS:
        if needs <= features:
            return name
    return "sse42" if "SSE42" in features else "x64"


def parse_speculative_log(log: str) -> list[Round]:
    """Rounds from a `llama-speculative-simple -v` log (draft lines precede each 'accepted' line)."""
    rounds: list[Round] = []
    draft: list[int] = []
    for line in log.splitlines():
        m = _DRAFT.search(line)
        if m:
            pos, tok = int(m.group(1)), int(m.group(2))
            if pos == 0:
                draft = []
            draft.append(tok)
            continue
        m = _ACCEPT.search(line)
        if m:
            n = int(m.group(2))
            rounds.append(Round(draft=draft[:n], accepted=int(m.group(1)), last=int(m.group(3)), drafted=n))
            draft = []
    return rounds


def run_speculative(
    target: str | Path,
    prompt: str,
    *,
    drafter: str | Path | None = None,
    spec_type: str = "draft-dflash",
    n_max: int = 3,
    n_predict: int = 64,
    threads: int = 2,
    extra: list[str] | None = None,
    verbose: bool = True,
    timeout: float = 900,
) -> SpecRun:
    """Greedy speculative decoding in llama.cpp (`--temp 0 --ignore-eos`: n_predict tokens, +0…n_max).

    verbose: log every draft (`-v`, needed for `rounds`; slows llama.cpp several-fold, so never time it);
    otherwise `-lv 4`, which still prints the counts and the draft-time statistics.
    """
    cmd = [
        str(tool("llama-speculative-simple")),
        "-m",
        str(target),
        "--spec-type",
        spec_type,
        "--spec-draft-n-max",
        str(n_max),
        "--temp",
        "0",
        "-n",
        str(n_predict),
        "-t",
        str(threads),
        "-p",
        prompt,
        "--ignore-eos",
        *(["-v"] if verbose else ["-lv", "4"]),
    ]
    if drafter is not None:
        cmd += ["-md", str(drafter), "-td", str(threads)]
    proc = _run(cmd + list(extra or []), timeout)
    log = proc.stderr
    run = SpecRun(text=proc.stdout, rounds=parse_speculative_log(log), log=log)
    m = _DECODED.search(log)
    if m:
        run.decoded_tokens, run.decode_s = int(m.group(1)), float(m.group(2))
    m = _DUR.search(log)
    if m:
        run.draft_ms = float(m.group(4))
    run.counts = {k: int(v) for k, v in _COUNT.findall(log)}
    return run


def run_plain(
    target: str | Path, prompt: str, *, n_predict: int = 64, threads: int = 2, timeout: float = 900
) -> SpecRun:
    """Plain greedy decoding (llama-completion); text is what it printed after the prompt."""
    cmd = [
        str(tool("llama-completion")),
        "-m",
        str(target),
        "-p",
        prompt,
        "-n",
        str(n_predict),
        "--temp",
        "0",
        "-t",
        str(threads),
        "-no-cnv",
        "--ignore-eos",
        "--no-warmup",
        "--no-display-prompt",
    ]
    proc = _run(cmd, timeout)
    run = SpecRun(text=proc.stdout, log=proc.stderr)
    m = _EVAL.search(proc.stderr)
    if m:
        # eval runs exclude the first token (sampled from the prompt pass): n runs = n decode steps
        run.decoded_tokens, run.decode_s = int(m.group(2)), float(m.group(1)) / 1e3
    return run


__all__ = [
    "LlamaCppError",
    "Round",
    "SpecRun",
    "built",
    "cpu_variant",
    "f32_target_gguf",
    "home",
    "parse_batched_bench",
    "parse_speculative_log",
    "run_batched_bench",
    "run_plain",
    "run_speculative",
    "target_gguf",
    "tool",
]
