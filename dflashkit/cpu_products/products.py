"""Matrix products of a decoding step on CPU, each shape computed the way this machine does fastest — chosen by
measurement, never by a rule from another CPU.

    logits = linear_product(hidden, weight)       # hidden (..., H), weight (V, H) → (..., V)
    route_linears(target.layers)                  # every nn.Linear inside goes through linear_product
    with stock_products(): ...                    # F.linear everywhere (stock baselines, e.g. HF generate)
    DFLASHKIT_CHOICES=products=auto|stock|few_rows|onednn|onednn_fused|mkl_packed|native_rows|native_layers
                                                  # or forced (choice.py: the override, the store, its age limit)

A decoding step multiplies a few rows (1 for an AR step, 2–17 for a verify pass, the batch for regeneration) by
every weight matrix. Ways to compute the same float32 products, whose speed depends on the CPU and its BLAS:
  stock       F.linear(x, W): x·Wᵀ as the BLAS's GEMM/GEMV with M = rows
  few_rows    (W·xᵀ)ᵀ, weight-stationary: streams W once; one row is multiplied as two (the matrix-vector path of
              some BLAS builds is slower than a matrix product of two); the result is copied row-major, as
              F.linear returns it — left transposed, every later op of a batched decoding step reads it strided,
              which costs more than the product saves
  onednn      oneDNN's inner product (torch's mkldnn linear) on the same weights, no packed copy: on some CPUs it
              streams a large matrix (an LM head) faster than the BLAS does, while on a layer's smaller matrices
              it may gain nothing; only where torch has oneDNN
  onednn_fused the same over the stacked weights of a layer's products of one input (q/k/v, gate/up): a target's
              layers only (siblings.py); one product of 2–7 MB instead of two or three of 0.4–3.5 MB
  mkl_packed  MKL's packed GEMM: each weight packed once per row count instead of on every sgemm call; a copy of
              the weights per width it runs, within a memory budget (packed_weights.py); where torch has MKL
  native_rows a few-row kernel compiled for this CPU at first use (native_rows.py): each block of weight rows
              streamed once, every row multiplied by it from L1; where a C++ compiler is
  native_layers a whole decoder layer a call, compiled for this CPU (kernels/decoder_layer.cpp, driven by
              target/native_layers.py): the products of native_rows and the work between them (norms, rotary, the
              cache write, attention) in one parallel region; a Llama-family target's layers only, a pass its caller
              opens (`open_pass`: the caller runs the whole pass one way or the other)
The same candidate can make a few-token verify pass cost about one AR step on one CPU and be slower than stock at
every width on another, with the same BLAS (docs/studies.md, "Verification cost and product selection"). So the
choice is timed on the machine at hand, interleaved (ABBA), and the fastest other candidate is kept only when it
beats stock round by round (`decide`: median ratio below 1 − 3 %, and faster in three rounds of four; ahead in the
median only: more rounds first, twice at most); otherwise stock:
  a model's layers   (the linears one `route_linears` call routed: a pass group) get one choice per row count,
                     timed in the real decoding steps (step_trial.py: why not the products alone), each candidate
                     running whole steps in turn.
  a lone product     (an LM head called directly) gets one per shape (rows × in × out), each call with the
                     weights evicted from the CPU caches first, as they are in a pass.
A row count is measured the second time it is met (the first runs stock): a one-off is never worth seconds of
timing. A prompt's width is a one-off even when the same prompt comes back (a benchmark's repeat), so `generate`
runs the prefill and the first draft round inside `stock_products()`: timed at the prompt's width, the trial would
land in the middle of a timed decode and slow it. Likewise `Target.forward` without a cache (capture, online
features, checks: whole sequences, once) takes stock products — samples of equal length meet a width twice by
chance, and a trial there buys nothing.
A choice holds for the process and is kept in `~/.cache/dflashkit/products/` keyed by CPU, BLAS, torch, threads and
kernel source, so later runs skip the timing for a week; then it is timed again (choice.py: the machine drifts;
an entry stored before a candidate joined is timed again, with it; what was chosen, and whether a timing is under
way: report.py).
All compute each output as the same dot product; only the summation order inside it may differ (last-bit
differences, as between two batch shapes of F.linear). Only CPU tensors of 1…MAX_ROWS rows without autograd take
part: training, long prefills and GPUs always run F.linear.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import dflashkit.cpu_products.native_rows as native_rows
import dflashkit.cpu_products.packed_weights as packed_weights
from dflashkit.cpu_products.choice import ENV, Choice, Store
from dflashkit.cpu_products.machine import last_level_cache_bytes
from dflashkit.cpu_products.siblings import Siblings, sibling_product
from dflashkit.cpu_products.step_trial import MAX_EXTENSIONS, MIN_GAIN, StepTrial, decide, unclear
from dflashkit.errors import ConfigError

MAX_ROWS = 64  # decoding steps, verify passes and regeneration batches; longer inputs are prefills: stock
FUSED = "onednn_fused"  # oneDNN over the stacked weights of products of one input (sibling_products.py)
PACKED = "mkl_packed"  # MKL's packed GEMM, a copy of the weights per row count (packed_weights.py)
NATIVE = "native_rows"  # a few-row kernel compiled for this CPU at first use (native_rows.py)
LAYERS = "native_layers"  # whole decoder layers compiled for this CPU (target/native_layers.py)
MODES = ("auto", "stock", "few_rows", "onednn", FUSED, PACKED, NATIVE, LAYERS)
PRODUCTS = Choice("products", MODES)  # DFLASHKIT_CHOICES=products=…; the store <cache>/products/
MAX_PAUSES = 3  # a step trial that stalls this often is given up (its width runs stock)


def _stock(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return F.linear(x, w, b)  # (M, out)


def _few_rows(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    rows = x.shape[0]
    cols = x.repeat(2, 1).t() if rows == 1 else x.t()  # (in, max(M, 2))
    out = torch.mm(w, cols)[:, :rows].t().contiguous()  # (M, out), row-major as F.linear returns it
    return out + b if b is not None else out


def _onednn(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")  # (M, out), row-major


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's CPU linear (x86 and most ARM builds do)."""
    return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _onednn_fused(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return sibling_product(_onednn, x, w, b)  # (..., out); alone for a weight of no fused set


def _no_siblings(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    raise RuntimeError("this pass group has no products of one input to fuse")


CANDIDATES: dict[str, Callable[[Tensor, Tensor, Tensor | None], Tensor]] = {"stock": _stock, "few_rows": _few_rows}
if onednn_available():
    CANDIDATES["onednn"] = _onednn
if packed_weights.available():
    CANDIDATES[PACKED] = packed_weights.packed_product
if native_rows.enabled():
    CANDIDATES[NATIVE] = native_rows.native_product


def _no_kernel(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    raise RuntimeError("no compiled kernel on this machine")


def _not_opened_outside(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    raise RuntimeError("a pass the layers open themselves cannot run as compiled layers")


def group_candidates(group: PassGroup) -> dict[str, Callable[[Tensor, Tensor, Tensor | None], Tensor]]:
    """A pass group's candidates: the products', plus the fused one for a group that may fuse (where it found no
    siblings, that one cannot run: recorded unusable, as a candidate this build lacks), plus whole compiled layers
    for a group whose caller can run them (`whole_layers`; a product of such a pass outside them, e.g. a batch the
    layers do not take, is native_rows'). They run only in passes their caller opens (`open_pass`): a width first
    timed in passes the layers open themselves (a regeneration batch through HF `generate`) records them unusable."""
    out = dict(CANDIDATES)
    if group.siblings is not None:
        out[FUSED] = _onednn_fused if group.siblings.sets else _no_siblings
    if group.whole_layers:
        out[LAYERS] = CANDIDATES.get(NATIVE, _no_kernel) if group.opened_outside else _not_opened_outside
    return out


@contextlib.contextmanager
def stock_products() -> Iterator[None]:
    """Within this block every product goes to F.linear (nestable): how HF and plain PyTorch run."""
    SPEED.stock_depth += 1
    SPEED.epoch += 1
    try:
        yield
    finally:
        SPEED.stock_depth -= 1


def stock_active() -> bool:
    """Whether the current code runs inside `stock_products()` (stock baselines compute everything as HF does)."""
    return SPEED.stock_depth > 0


def mode() -> str:
    """ "auto" (measured), or the candidate DFLASHKIT_CHOICES=products=… forces (one this machine can run)."""
    value = PRODUCTS.override() or "auto"
    native = native_rows.status() if value in (NATIVE, LAYERS) else None
    if native is not None and not native["available"]:
        raise ConfigError(f"{ENV}: products={value}: the kernel cannot be had here ({native['reason']})")
    if value == LAYERS:
        return value
    if value != "auto" and value not in CANDIDATES and not (value == FUSED and "onednn" in CANDIDATES):
        lacks = "MKL's packed GEMM (torch.ops.mkl)" if value == PACKED else "oneDNN (torch.backends.mkldnn)"
        raise ConfigError(f"{ENV}: products={value}: this torch build has no {lacks}; use auto or stock")
    return value


class Chooser:
    """The measured choice per shape. `timer(name, fn) -> seconds`, `store` (a JSON file, or None: memory only) and
    `now` (the wall clock a choice is stamped with: choice.py) are injectable, so the selection logic is
    tested without timing anything."""

    def __init__(
        self,
        *,
        timer: Callable[[str, Callable[[], object]], float] | None = None,
        store: Path | None = None,
        repeats: int = 7,
        clock: Callable[[], float] = time.perf_counter,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.timer = timer or _cold_timer
        self.store = store
        self.repeats = repeats
        self.clock = clock  # step trials: when a pass opens
        self.now = now  # when a choice was measured (kept with it; an old one is timed again)
        self._trials: dict[str, StepTrial] = {}  # pass groups' row counts being timed in real steps
        self._failed: dict[str, list[str]] = {}  # … and the candidates that could not run there
        self._last_opening: dict[str, tuple[str, int] | None] = {}  # per group: (key, epoch) of its latest opening
        self._openings = 0  # openings of passes while a trial runs (settled widths too), to notice one that stalls
        self._advanced: dict[str, int] = {}  # per trial: the opening count when it last recorded a step
        self._paused: dict[str, StepTrial] = {}  # trials that stalled, resumed when their width opens with none running
        self._pauses: dict[str, int] = {}  # … how often each stalled
        self._rare: set[str] = set()  # widths whose trial stalled MAX_PAUSES times: stock for the process
        self._trial_of: dict[str, tuple[PassGroup, int]] = {}  # trials' groups and widths (to release packed copies)
        self.choices: dict[str, dict[str, float | str | None]] = {}
        self._seen: set[str] = set()  # keys met once: measured when met again
        self.settled: dict[tuple[object, ...], str] = {}  # linear_product's per-call lookup of settled choices
        self._loaded = False

    def choose(self, x: Tensor, w: Tensor, b: Tensor | None) -> str:
        key = shape_key(x.shape[0], w, b)
        if not self._loaded:
            self._load()
        entry = self.choices.get(key)
        if entry is None:
            if self._first_sight(key):
                return "stock"
            entry = self.measure(x, w, b)
            if entry["choice"] != PACKED:
                packed_weights.release([w], x.shape[0])  # the trial's copy
            self.choices[key] = {**entry, "measured_at": int(self.now())}
            self._save()
        return str(entry["choice"])

    def choose_pass(self, group: PassGroup, rows: int, dtype: torch.dtype, *, opens_pass: bool = True) -> str:
        """The choice for every product of `group` at `rows` rows, timed in the real decoding steps (`StepTrial`):
        from the second time the row count opens a pass, each candidate runs whole steps in turn until every one has
        `repeats` step times; then `decide`. Passes are counted by the group's first linear (`opens_pass`): the
        others follow the step's candidate."""
        key = group.key(rows, dtype)
        if not self._loaded:
            self._load()
        entry = self.choices.get(key)
        if entry is not None:
            return str(entry["choice"])
        trial = self._trials.get(key)
        if not opens_pass:
            return trial.current if trial is not None else "stock"
        unbroken = self._last_opening.get(group.signature) == (key, SPEED.epoch)
        self._last_opening[group.signature] = (key, SPEED.epoch)
        self._openings += 1
        if trial is not None:
            self._busy()  # gives up stalled trials, this width's included
            trial = self._trials.get(key)
            if trial is None:
                return "stock"  # its trial stalled: given up just now
        if key in self._rare:
            return "stock"  # its trial stalled before
        if trial is None:
            if self._first_sight(key) or self._busy():
                return "stock"  # a one-off so far; or another trial runs (one at a time: never in lockstep)
            if key in self._paused:
                trial = self._trials[key] = self._paused.pop(key)  # resumed at the start of its round
            else:
                usable, self._failed[key] = _runnable(_first_product(group, rows, dtype), group_candidates(group))
                trial = self._trials[key] = StepTrial(usable, self.repeats)
                self._trial_of[key] = (group, rows)
            self._advanced[key] = self._openings
        pos = trial.pos
        trial.opened(self.clock(), unbroken=unbroken)
        if trial.pos != pos:
            self._advanced[key] = self._openings
        if not trial.done:
            return trial.current
        if trial.extensions < MAX_EXTENSIONS and unclear(trial.times):
            trial.extend(self.repeats)  # ahead of stock in the median but not round by round: more rounds first
            return trial.current
        entry = {**decide(trial.times), "timed": "steps", **{f"{n}_ms": None for n in self._failed.pop(key)}}
        entry["measured_at"] = int(self.now())
        if entry["choice"] != PACKED:
            packed_weights.release([m.weight for m in group.linears], rows)  # copies the trial made
        del self._trials[key]
        self.choices[key] = entry
        self._save()
        return str(entry["choice"])

    def trial_running(self) -> bool:
        """Whether a pass group's width is being timed now; a trial that stalled is paused first (`_busy`)."""
        return self._busy()

    def _busy(self) -> bool:
        """Whether a trial runs. One without a recorded step in the last 2 × its schedule's openings is paused (stock
        meanwhile; resumed at its round's start when its width opens with no trial running: a benchmark meets a
        tree's width only in that method's turns); paused MAX_PAUSES times — a width met once per generation, or
        whose steps always have something else inside — it is given up (stock), never holding the others back
        nor running a candidate for good."""
        for key, trial in list(self._trials.items()):
            if self._openings - self._advanced[key] > 2 * len(trial.schedule):
                del self._trials[key]
                self._pauses[key] = self._pauses.get(key, 0) + 1
                if self._pauses[key] >= MAX_PAUSES:
                    self._failed.pop(key, None)
                    self._rare.add(key)
                    group, rows = self._trial_of[key]
                    packed_weights.release([m.weight for m in group.linears], rows)
                else:
                    trial.restart_round()
                    self._paused[key] = trial
        return bool(self._trials)

    def _first_sight(self, key: str) -> bool:
        """A row count met for the first time runs stock, unmeasured: a one-off (the prefill of a short prompt) is
        not worth a measurement of seconds; decoding widths recur at once and are measured the second time."""
        if key in self._seen:
            return False
        self._seen.add(key)
        return True

    def measure(self, x: Tensor, w: Tensor, b: Tensor | None) -> dict[str, float | str | None]:
        """Time every candidate on these very tensors, cache-cold and interleaved (ABBA …), and pick by `decide`;
        a verdict that is stock only for want of rounds (`unclear`) is timed for more rounds first, as a pass's."""
        names, failed = _runnable(run := lambda fn: fn(x, w, b))  # also the warm-up: first calls pay allocations
        times: dict[str, list[float]] = {name: [] for name in names}
        with torch.no_grad():
            for r in range(self.repeats * (1 + MAX_EXTENSIONS)):
                if r and r % self.repeats == 0 and not unclear(times):
                    break  # clear after these rounds (unclear: `repeats` more, MAX_EXTENSIONS times at most)
                for name in names if r % 2 == 0 else names[::-1]:
                    times[name].append(self.timer(name, lambda name=name: run(CANDIDATES[name])))
        entry = decide(times)
        entry.update({f"{name}_ms": None for name in failed})  # tried and unusable: not re-tried from the store
        return entry

    # --------------------------------------------------------------------------------------- the store
    def _load(self) -> None:
        """The stored choices still usable (`usable`: every current candidate timed, not too old); the others are
        measured again when met."""
        self._loaded = True
        if self.store is not None:
            self.choices.update(Store(self.store).read(usable, now=self.now()))

    def _save(self) -> None:
        if self.store is not None:
            Store(self.store).write(self.choices)


def store_path() -> Path | None:
    """This machine's file of product choices, <cache>/products/<machine>.json, the machine including the kernels'
    source (a changed kernel is timed anew); None under DFLASHKIT_CHOICES=store=off or without a usable cache."""
    store = PRODUCTS.store(native_rows.source_digest())
    return None if store is None else store.path


def usable(key: str, entry: dict[str, object]) -> bool:
    """A stored entry that may be used as it is: a key of the shape-key form, every candidate `_names(key)` gives
    timed (one stored before a candidate joined is timed again, with it), one of them chosen. A damaged entry (a
    timing that is not a number) is measured again, never trusted."""
    names = _names(key)
    return (
        bool(_KEY.match(key))
        and all(f"{n}_ms" in entry and _timing(entry[f"{n}_ms"]) for n in names)
        and entry.get("choice") in names
    )


_KEY = re.compile(r"^\d+x[^:]+:\w+(:b)?$")  # ROWSx…:dtype[:b], as shape_key and pass groups write them


def _timing(ms: object) -> bool:
    """A stored timing: milliseconds, or null for a candidate that failed on this shape."""
    return ms is None or (isinstance(ms, int | float) and not isinstance(ms, bool) and math.isfinite(ms) and ms >= 0)


def _names(key: str) -> list[str]:
    """The candidates a stored choice must have timed: a fusing pass group's include the fused product, a group of
    whole layers the compiled layers."""
    group = key.split(":")[0]
    fused = [FUSED] if "-fuse" in group and "onednn" in CANDIDATES else []
    return [*CANDIDATES, *fused, *([LAYERS] if group.endswith("-layers") else [])]


def _runnable(
    run: Callable[[Callable[[Tensor, Tensor, Tensor | None], Tensor]], object],
    candidates: dict[str, Callable[[Tensor, Tensor, Tensor | None], Tensor]] = CANDIDATES,
) -> tuple[list[str], list[str]]:
    """(candidates `run` succeeds with, those that raise — this build cannot run them); stock failing is a real
    error. A measurement never times, and a trial never runs inside a real step, a candidate that cannot run."""
    usable, failed = [], []
    with torch.no_grad():
        for name, fn in candidates.items():
            try:
                run(fn)
                usable.append(name)
            except RuntimeError:
                if name == "stock":
                    raise
                failed.append(name)
    return usable, failed


def _first_product(group: PassGroup, rows: int, dtype: torch.dtype) -> Callable[[Callable[..., Tensor]], object]:
    """A call of the group's first product on `rows` random rows, for `_runnable`."""
    m = group.linears[0]
    x = torch.randn(rows, m.in_features, generator=torch.Generator().manual_seed(0)).to(m.weight.device, dtype)
    return lambda fn: fn(x, m.weight, m.bias)


class PassGroup:
    """The linears of one model part (e.g. a target's decoder layers), in the order a pass runs them: they share
    one measured choice per row count. Its key names the row count and the group's shapes (a digest)."""

    def __init__(self, linears: list[nn.Linear], *, fuse: bool = False, whole_layers: bool = False) -> None:
        self.linears = linears
        shapes = [(m.in_features, m.out_features, m.bias is not None) for m in linears]
        digest = hashlib.sha256(repr(shapes).encode()).hexdigest()[:10]
        self.signature = f"pass{len(linears)}-{digest}{'-fuse' if fuse else ''}{'-layers' if whole_layers else ''}"
        self.whole_layers = whole_layers  # its caller can run a whole pass as compiled layers (LAYERS)
        self.opened_outside = False  # a pass opened by its caller (`open_pass`): the first linear does not open it
        self.siblings = Siblings(linears) if fuse and "onednn" in CANDIDATES else None  # fused once a pass was seen
        # (leading shape, dtype, CPU or not, choice) of the pass under way when its opening found the width settled:
        # the group's other products in that pass take it without a lookup (microseconds a call, ~200 calls a step)
        self.this_pass: tuple[tuple[int, ...], torch.dtype, bool, str] | None = None

    def key(self, rows: int, dtype: torch.dtype) -> str:
        return f"{rows}x{self.signature}:{str(dtype).removeprefix('torch.')}"


def shape_key(rows: int, w: Tensor, b: Tensor | None) -> str:
    return f"{rows}x{w.shape[1]}x{w.shape[0]}:{str(w.dtype).removeprefix('torch.')}{':b' if b is not None else ''}"


def _cold_timer(_name: str, fn: Callable[[], object]) -> float:
    """Seconds of one call with the weights out of the CPU caches, as in a real pass: a model streams each layer's
    weights from memory, so a product timed on cache-hot weights (a loop over one call) can rank the candidates
    the other way round. A read-modify-write of twice the last-level cache evicts them first."""
    if SPEED.scratch is None:  # a normal tensor even when first met under inference_mode (regeneration): usable in both
        with torch.inference_mode(False):
            SPEED.scratch = torch.zeros(max(64 << 20, 2 * last_level_cache_bytes()) // 4)
    SPEED.scratch.add_(1.0)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def chooser() -> Chooser:
    """The process's chooser at the current thread count (`CpuSpeed.chooser`)."""
    return SPEED.chooser()


def linear_product(x: Tensor, weight: Tensor, bias: Tensor | None = None, group: PassGroup | None = None) -> Tensor:
    """x (..., H) @ weight (V, H)ᵀ (+ bias) → (..., V), the way this machine computes it fastest: per pass group
    and row count when the product belongs to one (`route_linears`), else per shape.

    A decoding step runs ~200 of these, so a settled choice (measured, or forced by DFLASHKIT_CHOICES) is looked
    up by (group or weight shape, input shape, dtype, CPU or not, the variable's value) in the thread count's
    chooser before any other work: tens of microseconds of Python per call add up to milliseconds a step, so the
    settled path is kept to one lookup (bench/product_overhead.py times both). DFLASHKIT_CHOICES is
    read when a pass opens (its group's first linear) and by every lone product: a change takes effect at the next
    pass."""
    if SPEED.stock_depth or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return F.linear(x, weight, bias)
    siblings = group.siblings if group is not None else None
    if siblings is not None and not siblings.done and x.is_cpu and x.numel() <= MAX_ROWS * x.shape[-1]:
        siblings.observe(weight, x)  # a decoding pass (a prefill's inputs are not held to watch it)
    opening = group is None or (group.linears[0].weight is weight and not group.opened_outside)
    fast = None if opening else group.this_pass
    if fast is not None and fast[0] == x.shape[:-1] and fast[1] == x.dtype and fast[2] == x.is_cpu:
        how = fast[3]  # the rest of a pass whose opening found its width settled: no lookup
    else:
        how = _settled_or_chosen(x, weight, bias, group, opening)
    if how == "stock":
        return F.linear(x, weight, bias)
    if how == FUSED:
        return _onednn_fused(x, weight, bias)  # (..., V): by the module's own input, which its siblings share
    rows = x.numel() // x.shape[-1]
    product = CANDIDATES[NATIVE if how == LAYERS else how]  # a pass of whole layers run another way: native_rows
    out = product(x.reshape(rows, x.shape[-1]), weight, bias)  # (M, V)
    return out.reshape(*x.shape[:-1], weight.shape[0])  # (..., V)


def _settled_or_chosen(x: Tensor, weight: Tensor, bias: Tensor | None, group: PassGroup | None, opening: bool) -> str:
    """The candidate for this call: a settled choice looked up by (group or weight shape, input shape, dtype, CPU or
    not, the variable's value), else `_choose`. A pass's opening also records, for the rest of the pass, the
    choice when it is settled (`PassGroup.this_pass`)."""
    c = chooser()
    memo = (group.signature if group is not None else (weight.shape, bias is not None), x.shape, x.dtype)
    if opening:  # the variable read once a pass, not once a call (each read costs microseconds)
        SPEED.env_now = os.environ.get(ENV)
    memo += (x.is_cpu, SPEED.env_now)  # is_cpu: a GPU call of a shape settled on CPU still runs F.linear
    how = c.settled.get(memo)
    if c._trials and group is not None and opening and how is not None:
        c._last_opening[group.signature] = None  # a settled width of the group between two timed steps: not one step
        c._openings += 1  # … and an opening the running trial made no progress in (else a width that stops coming
        # would hold its trial, and `trials_pending`, for good once every other width is settled)
    if how is None:
        how, settled = _choose(c, x, weight, bias, group, opening)
        if settled:
            c.settled[memo] = how
    if group is not None and opening:
        settled_now = c.settled.get(memo) == how
        group.this_pass = (x.shape[:-1], x.dtype, x.is_cpu, how) if settled_now else None
    return how


def _choose(
    c: Chooser, x: Tensor, weight: Tensor, bias: Tensor | None, group: PassGroup | None, opening: bool
) -> tuple[str, bool]:
    """(candidate, settled): the candidate for this call, and whether it holds for every later call of the same
    shape (False: F.linear by fallback, or stock until the row count is measured). `opening`: this call opens a
    pass of its group."""
    rows = x.numel() // max(1, x.shape[-1])
    if x.device.type != "cpu" or not 1 <= rows <= MAX_ROWS or x.dtype != weight.dtype:
        SPEED.epoch += 1  # (a prefill between two decoding steps is not part of a step)
        return "stock", False  # GPUs, prefills, mixed dtypes: F.linear, decided per call
    how = mode()
    if how != "auto":
        return how, True
    if group is not None:
        how = c.choose_pass(group, rows, x.dtype, opens_pass=opening)
        return how, group.key(rows, x.dtype) in c.choices
    how = c.choose(x.reshape(rows, x.shape[-1]), weight, bias)
    return how, shape_key(rows, weight, bias) in c.choices


def open_pass(group: PassGroup, lead: tuple[int, ...], dtype: torch.dtype) -> str:
    """Open a decoding pass of `group` over CPU inputs of leading shape `lead` (e.g. (1, n)) from outside its
    linears, for a caller that may run the whole pass another way (target/native_layers.py): the pass's candidate,
    timed and chosen as when its first linear opens it. Until `close_pass` the group's linears follow that
    candidate without opening the pass again."""
    m = group.linears[0]
    x = torch.empty(*lead, m.in_features, dtype=dtype)  # its shape, dtype and device are all that is read
    group.opened_outside = True  # before the choice: a trial started now may time the compiled layers
    return _settled_or_chosen(x, m.weight, m.bias, group, True)


def close_pass(group: PassGroup) -> None:
    """The end of a pass `open_pass` opened: the next pass opens at its first linear again."""
    group.opened_outside = False


def _forward(self: nn.Linear, x: Tensor) -> Tensor:
    return linear_product(x, self.weight, self.bias, self._pass_group)


class CpuSpeed:
    """What the measured products keep in a process, in one place: the choosers (one per thread count: a choice
    measured at 2 threads says nothing about 1), the depth of `stock_products()` blocks, the count of what broke a
    run of decoding steps (a stock block, a prefill: a step timing spans no such thing), DFLASHKIT_CHOICES as read
    when the current pass opened, and the buffer cold timings evict the CPU caches with. One instance, `SPEED`:
    models are plain modules until `apply` (`route_linears`) routes their linears, the one call that speeds a model
    up; the compiled kernel and the packed weight copies are caches of their own modules (native_rows.py,
    packed_weights.py)."""

    def __init__(self) -> None:
        self.choosers: dict[int, Chooser] = {}
        self.stock_depth = 0  # > 0 inside stock_products()
        self.epoch = 0  # bumped by whatever comes between two decoding steps: breaks a step timing
        self.env_now = os.environ.get(ENV)  # DFLASHKIT_CHOICES as read when the current pass opened (linear_product)
        self.scratch: Tensor | None = None  # twice the last-level cache, rewritten before each cold timing

    def chooser(self) -> Chooser:
        threads = torch.get_num_threads()
        if threads not in self.choosers:
            self.choosers[threads] = Chooser(store=store_path())
        return self.choosers[threads]

    def apply(self, module: nn.Module, *, lone: bool = False, fuse: bool = False, whole_layers: bool = False) -> int:
        """Send every plain nn.Linear under `module` through `linear_product`, as one pass group timed in real
        steps, or with `lone` each as a lone product timed per shape (an LM head: a pass group of its own would be
        timed in the same steps as the layers', its candidates in lockstep with theirs). Idempotent: linears routed
        before keep their way; returns how many were routed now. With `fuse` (frozen weights that are never saved
        from this model: a target's layers) the products of one input may be computed as one (`siblings.py`, a
        timed candidate); with `whole_layers` (a caller that opens its passes and can run them as compiled layers)
        LAYERS is one more."""
        fresh = [m for m in module.modules() if type(m) is nn.Linear and not getattr(m, "_routed", False)]
        if not fresh:
            return 0
        group = None if lone else PassGroup(fresh, fuse=fuse, whole_layers=whole_layers)
        for m in fresh:
            m.forward = types.MethodType(_forward, m)
            m._routed = True
            m._pass_group = group
        return len(fresh)


SPEED = CpuSpeed()
route_linears = SPEED.apply  # the one call that routes a model's linears (CpuSpeed.apply)


__all__ = [
    "CANDIDATES",
    "FUSED",
    "LAYERS",
    "MAX_ROWS",
    "MIN_GAIN",
    "NATIVE",
    "PACKED",
    "PRODUCTS",
    "SPEED",
    "Chooser",
    "CpuSpeed",
    "PassGroup",
    "close_pass",
    "decide",
    "group_candidates",
    "linear_product",
    "mode",
    "open_pass",
    "route_linears",
    "shape_key",
    "stock_products",
    "store_path",
    "usable",
]
