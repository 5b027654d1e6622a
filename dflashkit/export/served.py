"""`dflashkit serve-check --server URL`: a running deployment that dflashkit did not start — the engine's own
speculative counters against what dflashkit's drafter accepts on the same prompts, and on the server's own output.

    settings = ServedSettings(max_new_tokens=64)
    report = check_server(target, drafter, "http://127.0.0.1:8000", prompts, settings=settings)
    print(report.render())            # engine τ vs dflashkit τ, per position and per prompt; then the diagnosis

What is sent: each prompt as token ids rendered the way the drafter was trained (chat template, thinking mode), greedy
(temperature 0), exactly `max_new_tokens` tokens (end of turn ignored; llama-server then bans end-of-generation tokens,
and the target's greedy output here bans them too) — so both sides decode the same thing. One
request at a time; around each one the engine's counters are read twice and the difference is that request's:
  vLLM        Prometheus `/metrics`: vllm:spec_decode_num_drafts, …_num_draft_tokens, …_num_accepted_tokens,
              …_num_accepted_tokens_per_pos{position}, vllm:generation_tokens (summed over every label but position)
  llama.cpp   the same counters under `llamacpp:` when the server runs with --metrics (tokens_predicted for the
              traffic check); without it, each answer's `timings.draft_n` / `draft_n_accepted` (no rounds, no
              positions: drafts and accepted tokens are compared)
  SGLang      each answer's `meta_info.spec_verify_ct` (rounds) and `completion_tokens`: τ only
A request whose generated-token difference is not its own output was shared with other traffic: its counters are
left out and the report says how many; counters that went down were reset (a restart) and are left out too.

dflashkit's side, on the target and drafter loaded here:
  on the server's output  teacher-forced: the server's tokens (continued past the end by the target's own greedy
                          tokens where the engine counts past it) replayed with the engine's round rule
                          (`evaluate.simulate.replay_rounds`): the acceptance the engine should report if it runs the
                          drafter and target as trained — equal, round for round, when it does (exact at greedy)
  own decoding            the same replay on the target's own greedy output: what dflashkit's decoding accepts
Round rules: vLLM and SGLang verify a full block every round and count the accepted drafts before cutting the
output; llama-server drafts no more than the output keeps after the round's own token.
`served_diagnosis.diagnose` turns the evidence into causes, one line each with its fix.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from dflashkit.data.server_client import ServerError, ServerPool, ServerTimeouts
from dflashkit.errors import DFlashError
from dflashkit.evaluate.stats import parse_method
from dflashkit.evaluate.transcripts import Transcript
from dflashkit.export.serve_check import PromptCounts, per_position, target_tie, tau
from dflashkit.export.served_diagnosis import Evidence, Finding, diagnose

ENGINE_PREFIXES = {"vllm": "vllm", "llamacpp": "llama.cpp", "sglang": "sglang"}
# the round rule each protocol's engine follows (evaluate.simulate.replay_rounds' `reserve`)
RESERVE = {"openai": None, "sglang": None, "llama.cpp": 1}
# engines whose `ignore_eos` bans end-of-generation tokens (llama.cpp sets their logits to −inf) instead of only not
# stopping at them (vLLM): the target's greedy output here must ban them too
BANS_EOG = {"llama.cpp"}
SETTLE_S = 5.0  # how long a request's counters may lag its answer (llama-server adds them as the slot is released)


class ServedError(DFlashError):
    """The server cannot be checked (no speculative decoding, counters unusable, …): one line, exit 2."""


@dataclass(frozen=True)
class ServedSettings:
    max_new_tokens: int = 64
    metrics_path: str = "/metrics"
    timeouts: ServerTimeouts = field(default_factory=lambda: ServerTimeouts(first_byte_s=600.0, total_s=1200.0))
    served_config: dict[str, Any] | None = None  # the drafter config as the engine reads it (its exported files)
    template_kwargs: dict[str, Any] | None = None  # the chat template kwargs the drafter was trained with
    probe_repeat: bool = True  # the first prompt sent twice: a greedy server answers the same


# ---------------------------------------------------------------------------------------------- engine counters
@dataclass
class Counters:
    """Cumulative speculative counters of one /metrics reading (None: not reported)."""

    engine: str  # "vllm" | "llamacpp" | "sglang"
    drafts: float | None = None  # rounds (verification steps)
    draft_tokens: float | None = None
    accepted: float | None = None
    per_pos: dict[int, float] = field(default_factory=dict)
    generated: float | None = None  # output tokens of all requests

    def minus(self, before: Counters) -> Counters:
        def d(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else a - b

        pos = {k: v - before.per_pos.get(k, 0.0) for k, v in self.per_pos.items()}
        return Counters(
            self.engine,
            d(self.drafts, before.drafts),
            d(self.draft_tokens, before.draft_tokens),
            d(self.accepted, before.accepted),
            pos,
            d(self.generated, before.generated),
        )

    def went_down(self) -> bool:
        values = [self.drafts, self.draft_tokens, self.accepted, self.generated, *self.per_pos.values()]
        return any(v is not None and v < 0 for v in values)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_POSITION = re.compile(r'position="(\d+)"')
_NAMES = {  # counter (prefix and `_total` removed) → Counters field
    "spec_decode_num_drafts": "drafts",
    "spec_decode_num_draft_tokens": "draft_tokens",
    "spec_decode_num_accepted_tokens": "accepted",
    "generation_tokens": "generated",
    "tokens_predicted": "generated",
}


def read_counters(text: str) -> Counters | None:
    """The speculative counters of a Prometheus text exposition (vLLM's or llama-server's), summed over every label
    but `position`; None when it holds no speculative-decoding counter of a known engine."""
    sums: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m or line.startswith("#"):
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        prefix, _, rest = name.partition(":")
        if prefix not in ENGINE_PREFIXES or not rest:
            continue
        try:
            v = float(value)
        except ValueError:
            continue
        if not math.isfinite(v):
            continue
        rest = rest.removesuffix("_total")
        engine = sums.setdefault(prefix, {})
        if rest == "spec_decode_num_accepted_tokens_per_pos":
            pos = _POSITION.search(labels)
            if pos:
                key = f"pos{int(pos.group(1))}"
                engine[key] = engine.get(key, 0.0) + v
        elif rest in _NAMES:
            engine[_NAMES[rest]] = engine.get(_NAMES[rest], 0.0) + v
    for prefix, found in sums.items():
        if "drafts" in found or "accepted" in found:
            per_pos = {int(k[3:]): v for k, v in found.items() if k.startswith("pos")}
            fields = {k: v for k, v in found.items() if not k.startswith("pos")}
            return Counters(prefix, per_pos=per_pos, **fields)
    return None


def counts_from_answer(protocol: str, info: dict[str, Any], n_tokens: int) -> PromptCounts | None:
    """A request's counts from its own answer where the engine puts them there: llama-server's `timings` (drafts =
    draft tokens, no rounds: `drafts` is -1 and `tokens` holds nothing yet), SGLang's `meta_info` (rounds;
    accepted = tokens − 1 − rounds, no positions). None when the answer has none."""
    if protocol == "llama.cpp":
        t = info.get("timings") if isinstance(info.get("timings"), dict) else {}
        if "draft_n" not in t:
            return None
        return PromptCounts([], -1, int(t.get("draft_n_accepted", 0)), [])
    if protocol == "sglang":
        meta = info.get("meta_info") if isinstance(info.get("meta_info"), dict) else {}
        rounds = meta.get("spec_verify_ct")
        if not isinstance(rounds, int) or rounds <= 0:
            return None
        return PromptCounts([], rounds, max(0, n_tokens - 1 - rounds), [])
    return None


# ---------------------------------------------------------------------------------------------- dflashkit's side
def greedy(target: Any, prompt: list[int], n: int, banned: Sequence[int] = ()) -> list[int]:
    """The target's greedy continuation of `prompt` (`n` tokens, never stopping) where the tokens in `banned` can never
    be chosen: at each place the plain greedy output picks one, the best other token is taken and decoding goes on."""
    from dflashkit.decode.generate import DecodeSettings, generate

    out: list[int] = []
    ban = {int(t) for t in banned}
    while len(out) < n:
        more = generate(target, list(prompt) + out, settings=DecodeSettings(method="ar", max_new_tokens=n - len(out)))
        j = next((k for k, t in enumerate(more.tokens) if t in ban), None)
        if j is None:
            return out + more.tokens[: n - len(out)]
        out += more.tokens[:j]
        with torch.no_grad():
            logits = target.forward(torch.tensor([list(prompt) + out]), layer_ids=[], logits=True).logits[0, -1]
        logits = logits.float().clone()  # (V,)
        logits[sorted(t for t in ban if t < logits.numel())] = float("-inf")
        out.append(int(logits.argmax()))
    return out


def transcript(
    target: Any,
    layers: Sequence[int],
    prompt: list[int],
    tokens: list[int],
    extend: int,
    banned: Sequence[int] = (),
) -> Transcript:
    """Prompt + `tokens` + the target's own greedy continuation of `extend` tokens (`greedy`, `banned` never chosen),
    with the features of `layers` (one forward): what a replay needs to count rounds that run past the output's end."""
    tail = greedy(target, list(prompt) + list(tokens), extend, banned) if extend > 0 else []
    full = torch.tensor([list(prompt) + list(tokens) + tail], dtype=torch.long)  # (1, T)
    with torch.no_grad():
        feats = target.forward(full, layer_ids=list(layers), logits=False).features[0]  # (T, K·H)
    h = target.hidden_size
    per_layer = {int(i): feats[:, j * h : (j + 1) * h].detach().cpu() for j, i in enumerate(layers)}
    return Transcript("served", full[0].tolist(), len(prompt), "length", per_layer)


def replay_counts(
    drafter: Any,
    target: Any,
    tr: Transcript,
    n_tokens: int,
    reserve: int | None,
    layer_map: dict[int, int] | None = None,
) -> PromptCounts:
    """The engine's counts of one request of `n_tokens` output tokens, replayed on `tr` with the engine's round rule;
    `layer_map` (trained layer → the layer an engine would tap instead) tests a mis-tapped deployment."""
    from dflashkit.evaluate.simulate import replay_rounds

    if layer_map:
        tr = replace(tr, layers={i: tr.layers[layer_map.get(i, i)] for i in drafter.config.target_layer_ids})
    lengths, _ = replay_rounds(
        drafter,
        tr,
        embed_weight=target.embed_weight,
        lm_head_weight=target.lm_head_weight,
        max_new_tokens=n_tokens,
        method=parse_method("chain"),
        reserve=reserve,
    )
    slots = drafter.config.block_size - drafter.first_draft_slot()
    per_pos = [0] * slots
    for L in lengths:
        for j in range(L - 1):
            per_pos[j] += 1
    out = tr.ids[tr.prompt_len : tr.prompt_len + n_tokens]
    return PromptCounts(out, len(lengths), sum(L - 1 for L in lengths), per_pos)


# ---------------------------------------------------------------------------------------------- the report
@dataclass
class ServedPrompt:
    id: str
    prompt_tokens: int
    engine: PromptCounts | None  # None: no usable counters for this request
    teacher_forced: PromptCounts  # dflashkit's drafter on the server's output, with the engine's round rule
    own: PromptCounts  # dflashkit's drafter on the target's own greedy output
    same_tokens: bool  # the server's output equals the target's greedy output here
    first_difference: int | None = None  # first differing output token
    near_tie: float | None = None  # the target's top-2 margin there, when within serve_check's TIE
    left_out: str = ""  # why the engine's counters of this request were not usable


@dataclass
class ServedReport:
    url: str
    protocol: str
    model: str
    engine: str  # where the counters came from: "vllm", "llamacpp", "sglang", "llama.cpp answers"
    drafter: str
    max_new_tokens: int
    block_size: int
    prompts: list[ServedPrompt]
    findings: list[Finding]
    notes: list[str] = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        return not self.findings

    def _side(self, pick: Callable[[ServedPrompt], PromptCounts | None]) -> list[PromptCounts]:
        return [c for p in self.prompts if p.engine is not None and (c := pick(p)) is not None]

    def summary(self) -> dict[str, dict[str, Any]]:
        """engine / dflashkit (server's output) / dflashkit (own decoding), over the requests with usable counters."""
        out = {}
        for name, pick in (
            ("engine", lambda p: p.engine),
            ("dflashkit_on_server_output", lambda p: p.teacher_forced),
            ("dflashkit_own", lambda p: p.own),
        ):
            counts = self._side(pick)
            rounds = [c for c in counts if c.drafts >= 0]
            out[name] = {
                "drafts": sum(c.drafts for c in rounds) if len(rounds) == len(counts) else None,
                "accepted": sum(c.accepted for c in counts),
                "accepted_per_pos": per_position(counts) if any(c.accepted_per_pos for c in counts) else None,
                "tau": round(tau(counts), 4) if counts and len(rounds) == len(counts) else None,
            }
        return out

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for p in d["prompts"]:
            for side in ("engine", "teacher_forced", "own"):
                if p[side] is not None:
                    p[side].pop("tokens")
        d["summary"] = self.summary()
        d["agrees"] = self.agrees
        return d

    def render(self) -> str:
        lines = [
            f"serve-check {self.drafter} against {self.url} ({self.protocol}, {self.model}): {len(self.prompts)} "
            f"prompts × {self.max_new_tokens} tokens, greedy, block {self.block_size}; counters: {self.engine}"
        ]
        s = self.summary()
        lines.append(f"  {'':<30} {'drafts':>7} {'accepted':>9} {'τ':>7}  accepted per position")
        for name, label in (
            ("engine", "engine"),
            ("dflashkit_on_server_output", "dflashkit on the server's output"),
            ("dflashkit_own", "dflashkit's own decoding"),
        ):
            row = s[name]
            tau_text = "—" if row["tau"] is None else f"{row['tau']:.3f}"
            drafts = "—" if row["drafts"] is None else str(row["drafts"])
            lines.append(
                f"  {label:<30} {drafts:>7} {row['accepted']:>9} {tau_text:>7}  {row['accepted_per_pos'] or '—'}"
            )
        usable = [p for p in self.prompts if p.engine is not None]
        lines.append("  per prompt (engine τ / dflashkit τ on the server's output, prompt tokens):")
        for p in self.prompts:
            if p.engine is None:
                lines.append(f"    {p.id}: counters left out ({p.left_out})")
                continue
            e = tau([p.engine]) if p.engine.drafts > 0 else float("nan")
            lines.append(
                f"    {p.id}: {e:.3f} / {tau([p.teacher_forced]):.3f}, {p.prompt_tokens} tokens"
                + ("" if p.same_tokens else f", output differs from token {p.first_difference}")
            )
        same = sum(p.same_tokens for p in self.prompts)
        lines.append(f"  greedy output equal to the target's here: {same} of {len(self.prompts)} prompts")
        if len(usable) < len(self.prompts):
            lines.append(f"  counters usable for {len(usable)} of {len(self.prompts)} requests")
        if self.findings:
            lines.append("  diagnosis:")
            for f in self.findings:
                lines.append(f"    {f.cause}: {f.line}")
                lines.append(f"      fix: {f.fix}")
        else:
            lines.append("  the engine accepts exactly what dflashkit measures on its output: no cause found")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the check
def server_counters(pool: ServerPool, path: str) -> Counters | None:
    """The speculative counters the pool's first server reports at `path` now (None: it reports none)."""
    try:
        return read_counters(pool.text(path))
    except ServerError:
        return None


def _request_counters(
    pool: ServerPool, path: str, before: Counters, n_tokens: int, sleep: Callable[[float], None]
) -> tuple[Counters, str]:
    """The counters' difference over one request (polled until its tokens are in, at most SETTLE_S), and why it is
    unusable ("" when usable)."""
    end = time.monotonic() + SETTLE_S
    while True:
        after = server_counters(pool, path)
        if after is None:
            return Counters(before.engine), "the metrics endpoint stopped answering"
        delta = after.minus(before)
        if delta.went_down():
            return delta, "the counters went down during the request (a restart or a reset)"
        if delta.generated is None or delta.generated >= n_tokens or time.monotonic() >= end:
            break
        sleep(0.05)
    if delta.generated is not None and delta.generated != n_tokens:
        return (
            delta,
            f"{delta.generated:g} tokens generated meanwhile, {n_tokens} of them this request's: other traffic",
        )
    return delta, ""


class _Local:
    """dflashkit's side of one request: the target's greedy output here and the drafter's counts on both outputs."""

    def __init__(self, target: Any, drafter: Any, layers: list[int], n: int, slots: int, reserve: int | None,
                 banned: list[int]) -> None:  # fmt: skip
        self.target, self.drafter, self.layers, self.n, self.slots = target, drafter, layers, n, slots
        self.reserve, self.banned = reserve, banned

    def compare(self, p: Any, tokens: list[int]) -> tuple[Transcript, ServedPrompt]:
        """(the server's output as replayed, the request's record without the engine's counts)."""
        t, ids, n = self.target, list(p.ids), self.n
        own_tr = transcript(t, self.layers, ids, [], n + self.slots, self.banned)
        own_tokens = own_tr.ids[own_tr.prompt_len : own_tr.prompt_len + n]
        same = own_tokens[: len(tokens)] == tokens
        past = self.slots if self.reserve is None else 0  # vLLM counts a block past the end
        tf_tr = own_tr if same else transcript(t, self.layers, ids, tokens, past, self.banned)
        tf = replay_counts(self.drafter, t, tf_tr, len(tokens), self.reserve)
        own = replay_counts(self.drafter, t, own_tr, n, self.reserve)
        diff, tie = None, None
        if not same:
            diff = next(k for k, (a, b) in enumerate(zip(own_tokens, tokens, strict=False)) if a != b)
            found = target_tie(t, ids, own_tokens, tokens)
            tie = None if found is None else found[1]
        return tf_tr, ServedPrompt(str(p.id), len(ids), None, tf, own, same, diff, tie)


def _shifted(local: _Local, forced: list[Transcript], results: list[ServedPrompt]) -> dict[int, list[PromptCounts]]:
    """The counts of the requests with usable counters if the engine fed the drafter each target layer one earlier
    (−1) or later (+1): an off-by-one tap explains the engine exactly when one of them equals it."""
    usable = [k for k, r in enumerate(results) if r.engine is not None]
    out = {}
    for shift in (-1, 1):
        mapping = {i: i + shift for i in local.drafter.config.target_layer_ids}
        if all(j in local.layers for j in mapping.values()):
            out[shift] = [
                replay_counts(local.drafter, local.target, forced[k], len(results[k].teacher_forced.tokens),
                              local.reserve, mapping)
                for k in usable
            ]  # fmt: skip
    return out


def _complete(pool: ServerPool, url: str, ids: list[int], ask: dict[str, Any]) -> Any:
    try:
        c = pool.complete(ids, **ask)
    except ServerError as e:
        raise ServedError(str(e)) from None
    if c.token_ids is None:
        raise ServedError(
            f"{url} answers with text only: serve-check needs the token ids it generated (vLLM: "
            "return_token_ids; llama-server: return_tokens) — update the server"
        )
    return c


def _counted(
    pool: ServerPool, path: str, before: Counters, tokens: list[int], sleep: Callable[[float], None]
) -> tuple[PromptCounts | None, str]:
    """A request's counts from the metrics' difference over it, or why they are left out."""
    delta, left_out = _request_counters(pool, path, before, len(tokens), sleep)
    if left_out:
        return None, left_out
    per = [round(delta.per_pos.get(j, 0.0)) for j in range(max(delta.per_pos, default=-1) + 1)]
    return PromptCounts(tokens, round(delta.drafts or 0), round(delta.accepted or 0), per), ""


_SPEC_HINT = (
    'start it with the drafter — vLLM --speculative-config \'{"method": "dflash", "model": DIR, '
    '"num_speculative_tokens": N}\', llama-server -md DRAFTER.gguf --spec-type draft-dflash (and --metrics for '
    "per-position counts)"
)


def _refuse_unusable(url: str, results: list[ServedPrompt], *, metrics: bool, no_spec: bool) -> None:
    """ServedError when nothing can be compared: no speculative decoding, or no request's counters usable."""
    if no_spec and any(r.engine is not None for r in results):
        raise ServedError(
            f"{url} reports no speculative decoding (its counters did not move over {len(results)} requests): "
            + _SPEC_HINT
        )
    if all(r.engine is None for r in results):
        reasons = "; ".join(sorted({r.left_out for r in results}))
        if not metrics:
            raise ServedError(
                f"{url} reports no speculative-decoding counters ({reasons}): is a drafter configured? {_SPEC_HINT}"
            )
        raise ServedError(f"{url}: no request's counters are usable — {reasons}; check it while no other client runs")


def check_server(
    target: Any,
    drafter: Any,
    url: str,
    prompts: Sequence[Any],
    *,
    settings: ServedSettings = ServedSettings(),
    drafter_name: str = "drafter",
    progress: Callable[[str], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> ServedReport:
    """Check the deployment at `url` with `prompts` (`evaluate.stats.Prompt`s: id, ids; `messages` attribute or
    None for the template check). Raises ServedError where nothing can be compared."""
    say = progress or (lambda _m: None)
    pool = ServerPool([url], retries=2, backoff_s=0.5, timeouts=settings.timeouts, sleep=sleep)
    try:
        pool.connect(target.tokenizer)
    except ServerError as e:
        raise ServedError(str(e)) from None
    server = pool.servers[0]
    protocol, reserve = server.protocol, RESERVE[server.protocol]
    banned = _end_ids(target) if protocol in BANS_EOG else []
    n = settings.max_new_tokens
    bs = drafter.config.block_size
    slots = bs - drafter.first_draft_slot()
    layers = sorted(set(drafter.config.target_layer_ids) | _neighbours(drafter, target))
    notes: list[str] = []
    first = server_counters(pool, settings.metrics_path)
    engine = first.engine if first is not None else ""

    # the server's own rendering of each chat, against the one the drafter was trained on
    rendered: list[tuple[list[int], list[int] | None]] = []
    for p in prompts:
        messages = getattr(p, "messages", None)
        theirs = pool.chat_ids(messages, settings.template_kwargs) if messages else None
        rendered.append((list(p.ids), theirs))

    # greedy repeatability: the first prompt twice
    # no stop tokens: every output is exactly n tokens long (vLLM stops at stop_token_ids even with ignore_eos)
    ask = {"max_tokens": n, "temperature": 0.0, "top_p": 1.0, "seed": 0, "stop_ids": [], "ignore_eos": True}
    repeat: tuple[list[int], list[int]] | None = None
    echoed: dict[str, Any] = {}
    results: list[ServedPrompt] = []
    forced: list[Transcript] = []  # per request: the server's output, as replayed
    no_spec = True
    local = _Local(target, drafter, layers, n, slots, reserve, banned)
    for i, p in enumerate(prompts):
        say(f"request {i + 1}/{len(prompts)}")
        before = server_counters(pool, settings.metrics_path) if first is not None else None
        c = _complete(pool, url, list(p.ids), ask)
        tokens = list(c.token_ids or [])[:n]
        seen = c.info.get("generation_settings")
        echoed = echoed or (seen if isinstance(seen, dict) else {})
        if before is not None:
            engine_counts, left_out = _counted(pool, settings.metrics_path, before, tokens, sleep)
            moved = engine_counts is not None and bool(engine_counts.drafts or engine_counts.accepted)
        else:
            engine_counts = counts_from_answer(protocol, c.info, len(tokens))
            left_out = (
                "the server reports no counters (no /metrics, none in its answers)" if engine_counts is None else ""
            )
            if engine_counts is not None:
                engine_counts.tokens = tokens
                engine = "llama.cpp answers" if protocol == "llama.cpp" else "sglang answers"
            moved = engine_counts is not None and bool(engine_counts.accepted or engine_counts.drafts)
        no_spec = no_spec and not moved
        if i == 0 and settings.probe_repeat:
            repeat = (tokens, list(_complete(pool, url, list(p.ids), ask).token_ids or [])[:n])
        tf_tr, result = local.compare(p, tokens)
        result.engine, result.left_out = engine_counts, left_out
        forced.append(tf_tr)
        results.append(result)
    _refuse_unusable(url, results, metrics=first is not None, no_spec=no_spec)
    shifted = _shifted(local, forced, results)
    evidence = Evidence(
        protocol=protocol,
        block_size=bs,
        slots=slots,
        trained_config=_config_facts(drafter.config),
        served_config=settings.served_config,
        prompts=results,
        rendered=rendered,
        repeat=repeat,
        echoed_settings=echoed,
        shifted_layers=shifted,
        tokenizer=target.tokenizer,
    )
    findings = diagnose(evidence)
    left = sum(r.engine is None for r in results)
    if left:
        notes.append(
            f"{left} request(s) left out of the engine's counts: "
            + "; ".join(sorted({r.left_out for r in results if r.left_out}))
        )
    if reserve is None:
        notes.append(
            f"{engine or protocol} counts a round's accepted drafts before cutting the output: the last round of "
            "each prompt is replayed on the target's own greedy tokens past the end"
        )
    return ServedReport(url, protocol, server.model, engine or protocol, drafter_name, n, bs, results, findings, notes)


def _end_ids(target: Any) -> list[int]:
    """The target's end-of-generation ids (its EOS and end-of-turn tokens)."""
    from dflashkit.data.conversations import end_of_turn_ids

    tok = target.tokenizer
    if tok is None:
        return []
    ids = set(end_of_turn_ids(tok))
    if getattr(tok, "eos_token_id", None) is not None:
        ids.add(int(tok.eos_token_id))
    return sorted(ids)


def _neighbours(drafter: Any, target: Any) -> set[int]:
    """The layers one off each trained one that exist (for the mis-tap test)."""
    n = int(target.num_layers)
    return {j for i in drafter.config.target_layer_ids for j in (i - 1, i + 1) if 0 <= j < n}


def served_config(path: str | Path) -> dict[str, Any]:
    """What an engine reads of the drafter it serves, from the files it loads: a checkpoint directory (z-lab,
    speculators, the vLLM serving layout) or a llama.cpp GGUF (target layers stored as i + 1, read back as i)."""
    from dflashkit.errors import CheckpointError

    path = Path(path)
    if path.suffix == ".gguf":
        import gguf

        from dflashkit.export.gguf_export import ARCH, MASK_KEY

        try:
            reader = gguf.GGUFReader(str(path))
        except Exception as e:  # gguf raises ValueError / struct errors for foreign or truncated files
            raise ServedError(f"--served-drafter {path}: not a readable GGUF file ({e})") from None

        def get(key: str) -> Any:
            f = reader.fields.get(key)
            return None if f is None else f.contents()

        if get("general.architecture") != ARCH:
            raise ServedError(f"--served-drafter {path}: not a {ARCH} drafter GGUF")
        layers = get(f"{ARCH}.target_layers")
        window = get(f"{ARCH}.sliding_window")
        facts: dict[str, Any] = {
            "target_layer_ids": None if layers is None else [int(i) - 1 for i in layers],
            "block_size": get(f"{ARCH}.block_size"),
            "mask_token_id": get(MASK_KEY),
        }
        if window is not None:
            facts["sliding_window"] = int(window)
        return {k: v for k, v in facts.items() if v is not None}
    from dflashkit.drafter.config import DrafterConfig
    from dflashkit.export.convert import detect_format, read_config
    from dflashkit.export.speculators_format import config_from_speculators

    try:
        raw = read_config(path)
        if detect_format(raw) == "speculators":
            cfg = config_from_speculators(raw, notes=[], source=str(path / "config.json"))
        else:
            cfg = DrafterConfig.from_zlab_dict(raw, source=str(path / "config.json"))
    except (CheckpointError, DFlashError) as e:
        raise ServedError(f"--served-drafter: {e}") from None
    return _config_facts(cfg)


def _config_facts(cfg: Any) -> dict[str, Any]:
    """What an engine reads of a drafter config and acceptance depends on."""
    return {
        "target_layer_ids": list(cfg.target_layer_ids),
        "block_size": int(cfg.block_size),
        "mask_token_id": getattr(cfg, "mask_token_id", None),
        "sliding_window": getattr(cfg, "sliding_window", None),
        "layer_types": list(getattr(cfg, "layer_types", None) or []),
        "draft_vocab_size": getattr(cfg, "draft_vocab_size", None),
    }


__all__ = [
    "Counters",
    "ServedError",
    "ServedPrompt",
    "ServedReport",
    "ServedSettings",
    "check_server",
    "counts_from_answer",
    "read_counters",
    "replay_counts",
    "served_config",
    "server_counters",
    "transcript",
]
