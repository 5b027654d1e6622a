"""`dflashkit logs RUN [RUN …]`: training health from `RUN/metrics.jsonl`, several runs compared, PNG plots.

    dflashkit logs runs/a                       # one run: grad norms, loss distribution, accuracy, τ, schedules
    dflashkit logs runs/a runs/b --acc 0.5      # compared, incl. steps to reach mean accuracy 0.5
    dflashkit logs runs/a --out plots/          # loss.png, grad_norm.png, lr.png, tau.png, accuracy.png

Reads train records (`"split": "train"`, the default when absent) and validation records (`"split": "val"`);
every key is optional and runs with different metric sets are compared on what they share. A line whose `step` is
not an integer is skipped, an `accuracy` that is not a list of numbers ignored (null is NaN), each with a note.
Definitions (docs/troubleshooting.md#pitfall-training-health):
- warmup ends at the step of the peak learning rate (the first 4% of records when no lr is logged).
- grad-norm collapse: after warmup, the grad norm stays below 1e-3 × its early median (the median of the first
  quarter of post-warmup records), or at 0, for at least max(5, 5% of the records) consecutive records.
- bimodal loss: log step losses (noise scales with the loss level) are detrended by a centred rolling median
  over 51 records (wide enough that a minority mode of up to ~35% rarely becomes the median), then flagged when
  the bimodality coefficient BC = (g² + 1) / (κ + 3(n−1)²/((n−2)(n−3))) exceeds 5/9 (g skewness, κ excess
  kurtosis)
  AND the best two-cluster split has Ashman's D > 3 with ≥ 10% of the records on each side. Both are needed:
  BC alone fires on skewed unimodal noise, and a threshold split of plain Gaussian noise already has D ≈ 2.7.
- steps to accuracy X: the first step whose mean accuracy over block slots 1…bs−1 (slot 0 is the unsupervised
  clean token), smoothed by a rolling mean of 5 records, reaches X; `--acc-slot 1` uses slot 1 alone. Validation
  records are used when a run has them, else train records.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from dflashkit.diagnose.inspect_checkpoint import Finding
from dflashkit.errors import DataError

METRICS_NAME = "metrics.jsonl"
_ACC_KEY = re.compile(r"^acc(?:uracy)?_slot_?(\d+)$")


@dataclass
class RunLog:
    name: str
    path: str
    train: list[dict[str, Any]] = field(default_factory=list)
    val: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def series(self, key: str, split: str = "train") -> tuple[list[int], list[float]]:
        steps, values = [], []
        for i, r in enumerate(self.train if split == "train" else self.val):
            v = r.get(key)
            if isinstance(v, bool):
                v = float(v)
            if isinstance(v, (int, float)) and math.isfinite(v):
                steps.append(int(r.get("step", i + 1)))
                values.append(float(v))
        return steps, values

    def keys(self) -> set[str]:
        return {k for r in self.train + self.val for k in r if k not in ("step", "split", "epoch")}


def read_run(path: str | Path, name: str | None = None) -> RunLog:
    """Parse RUN/metrics.jsonl (or the file itself); a torn last line is skipped with a note."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such run directory or metrics file")
    file = path / METRICS_NAME if path.is_dir() else path
    if not file.is_file():
        raise DataError(f"{file}: no such file (expected a training run directory holding {METRICS_NAME})")
    log = RunLog(name=name or (path.name if path.is_dir() else path.parent.name) or str(path), path=str(file))
    lines = file.read_text(errors="replace").splitlines()  # a non-UTF-8 byte spoils one value, not the file
    bad: list[int] = []
    bad_step: list[int] = []
    bad_accuracy: list[int] = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError
        except ValueError:
            bad.append(n)
            continue
        if not _clean_step(rec):
            bad_step.append(n)
            continue
        if not _clean_accuracy(rec):
            bad_accuracy.append(n)
        rec = _normalise(rec)
        (log.val if rec.get("split") == "val" else log.train).append(rec)
    if not log.train and not log.val:
        if bad_step and not bad:
            raise DataError(
                f"{file}: no metric records (line(s) {bad_step[:5]} have a step that is not an integer); expected "
                f'"step": an integer (the optimizer step), as train writes'
            )
        unread = f" (line(s) {bad[:5]} of {len(lines)} are not JSON objects)" if bad else " (the file is empty)"
        raise DataError(f"{file}: no metric records{unread}; expected one JSON object per line, as train writes")
    if bad and bad[-1] == len(lines):
        log.notes.append(f"skipped 1 incomplete line at the end of {file} (a run still writing, or killed)")
        bad = bad[:-1]
    if bad:
        log.notes.append(f"skipped {len(bad)} malformed line(s) in {file}: {bad[:5]}")
    if bad_step:
        log.notes.append(f"skipped {len(bad_step)} line(s) of {file} whose step is not an integer: {bad_step[:5]}")
    if bad_accuracy:
        log.notes.append(
            f"ignored the accuracy of {len(bad_accuracy)} line(s) of {file} (expected a list of numbers, one per "
            f"block slot): {bad_accuracy[:5]}"
        )
    return log


def _number(v: Any) -> float | None:
    """A JSON metric value as a float (null → NaN), or None when it is not a number."""
    if v is None:
        return math.nan
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _clean_step(rec: dict[str, Any]) -> bool:
    """Make `step` an int in place (1.0 → 1); False when it is there but not an integer (a string, 1.5, null)."""
    if "step" not in rec:
        return True
    v = _number(rec["step"])
    if v is None or not math.isfinite(v) or not v.is_integer():
        return False
    rec["step"] = int(v)
    return True


def _clean_accuracy(rec: dict[str, Any]) -> bool:
    """Per-slot accuracies as floats in place (null → NaN, `acc_slotNN` likewise); False (and `accuracy` dropped)
    when `accuracy` is there but is not a list of numbers."""
    for k in [k for k in rec if _ACC_KEY.match(k)]:
        rec[k] = math.nan if _number(rec[k]) is None else _number(rec[k])
    if "accuracy" not in rec:
        return True
    acc = rec["accuracy"]
    values = [_number(a) for a in acc] if isinstance(acc, list) else [None]
    if any(v is None for v in values):
        del rec["accuracy"]
        return False
    rec["accuracy"] = values
    return True


def _normalise(rec: dict[str, Any]) -> dict[str, Any]:
    """Accept per-slot accuracies as a list under `accuracy`, or as `acc_slotNN` keys (TensorBoard naming)."""
    if not isinstance(rec.get("accuracy"), list):
        slots = {int(m.group(1)): v for k, v in rec.items() if (m := _ACC_KEY.match(k))}
        if slots:
            rec["accuracy"] = [0.0] + [slots.get(k, float("nan")) for k in range(1, max(slots) + 1)]
    return rec


# ---------------------------------------------------------------------------------------------- statistics
def percentile(xs: list[float], p: float) -> float:
    s = sorted(xs)
    pos = p * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def bimodality_coefficient(xs: list[float]) -> float:
    n = len(xs)
    if n < 4:
        return 0.0
    mu = sum(xs) / n
    m2 = sum((x - mu) ** 2 for x in xs) / n
    if m2 == 0:
        return 0.0
    g = (sum((x - mu) ** 3 for x in xs) / n) / m2**1.5
    kappa = (sum((x - mu) ** 4 for x in xs) / n) / m2**2 - 3.0
    return (g * g + 1) / (kappa + 3 * (n - 1) ** 2 / ((n - 2) * (n - 3)))


def ashman_d(xs: list[float]) -> tuple[float, float]:
    """Best threshold split of sorted values (minimum within-cluster variance) → (Ashman's D, smaller share)."""
    s = sorted(xs)
    n = len(s)
    best = (math.inf, 0)
    prefix = [0.0]
    prefix2 = [0.0]
    for x in s:
        prefix.append(prefix[-1] + x)
        prefix2.append(prefix2[-1] + x * x)
    for i in range(max(1, n // 10), n - max(1, n // 10) + 1):
        ss = (prefix2[i] - prefix[i] ** 2 / i) + (prefix2[n] - prefix2[i] - (prefix[n] - prefix[i]) ** 2 / (n - i))
        if ss < best[0]:
            best = (ss, i)
    i = best[1]
    if i <= 0 or i >= n:
        return 0.0, 0.0
    a, b = s[:i], s[i:]
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    va = sum((x - ma) ** 2 for x in a) / len(a)
    vb = sum((x - mb) ** 2 for x in b) / len(b)
    d = math.sqrt(2) * abs(mb - ma) / math.sqrt(va + vb) if va + vb > 0 else (math.inf if mb != ma else 0.0)
    return d, min(len(a), len(b)) / n


def rolling(xs: list[float], window: int, fn: Any) -> list[float]:
    half = window // 2
    return [fn(xs[max(0, i - half) : i + half + 1]) for i in range(len(xs))]


def warmup_end(log: RunLog) -> int:
    """Index (into train records with a grad norm) where warmup ends: the peak lr, else 4% of the records."""
    _, lr = log.series("lr")
    if lr:
        return max(range(len(lr)), key=lambda i: lr[i])
    return int(0.04 * len(log.train))


def slot_count(log: RunLog) -> int:
    """How many per-slot accuracies the run's records hold (0: none logged)."""
    return max((len(r["accuracy"]) for r in log.train + log.val if isinstance(r.get("accuracy"), list)), default=0)


def steps_to_accuracy(log: RunLog, threshold: float, *, slot: int | None = None) -> int | None:
    """First step whose accuracy (slot `slot`, else the mean of slots 1…bs−1) reaches `threshold`; DataError when
    the run has no slot `slot` (never another slot's figure in its place)."""
    n = slot_count(log)
    if slot is not None and n and not 0 <= slot < n:
        raise DataError(f"--acc-slot {slot}: run {log.name} logs the accuracy of {n} slots (0…{n - 1})")
    recs = log.val if any(isinstance(r.get("accuracy"), list) for r in log.val) else log.train
    steps, vals = [], []
    for i, r in enumerate(recs):
        acc = r.get("accuracy")
        if not isinstance(acc, list) or len(acc) < 2:
            continue
        use = acc[1:] if slot is None else acc[slot : slot + 1]  # a record without that slot adds nothing
        use = [a for a in use if isinstance(a, (int, float)) and math.isfinite(a)]
        if use:
            steps.append(int(r.get("step", i + 1)))
            vals.append(sum(use) / len(use))
    smooth = rolling(vals, 5, lambda w: sum(w) / len(w)) if recs is log.train else vals
    return next((s for s, v in zip(steps, smooth, strict=True) if v >= threshold), None)


# ---------------------------------------------------------------------------------------------- analysis
def analyze(log: RunLog) -> dict[str, Any]:
    """Summary statistics and findings for one run (see the module docstring for the definitions)."""
    out: dict[str, Any] = {
        "name": log.name,
        "records": {"train": len(log.train), "val": len(log.val)},
        "notes": list(log.notes),
        "findings": [],
    }
    find: list[Finding] = out["findings"]
    w = warmup_end(log)
    _, gn = log.series("grad_norm")
    if gn:
        after = gn[w:] or gn
        early = median(after[: max(1, len(after) // 4)])
        low = [g <= 1e-3 * early or g == 0 for g in after]
        need = max(5, int(0.05 * len(after)))
        run = best = start = best_start = 0
        for i, flag in enumerate(low):
            run = run + 1 if flag else 0
            start = i - run + 1 if flag else start
            if run > best:
                best, best_start = run, start
        steps = log.series("grad_norm")[0][w:] or log.series("grad_norm")[0]
        out["grad_norm"] = {
            "mean_after_warmup": sum(after) / len(after),
            "median": median(after),
            "min": min(after),
            "max": max(after),
            "early_median": early,
            "warmup_records": w,
        }
        if best >= need:
            find.append(
                Finding(
                    "WARN",
                    "grad norm",
                    f"collapsed: below 1e-3 × its early median {early:.3g} (or 0) "
                    f"for {best} records from step {steps[best_start]} (min {min(after):.2g})",
                    "the drafter stopped learning: check the loss mask and labels, lower weight decay "
                    "or raise lr; a healthy run keeps grad norms within a decade or two",
                )
            )
        else:
            find.append(
                Finding(
                    "OK",
                    "grad norm",
                    f"mean {out['grad_norm']['mean_after_warmup']:.3g} after warmup, min {min(after):.3g}: no collapse",
                )
            )
    _, clipped = log.series("clipped")
    if clipped:
        out["clipped_fraction"] = share = sum(clipped) / len(clipped)
        find.append(_clipping_finding(share, len(clipped), out.get("grad_norm", {}).get("median")))
    _, loss = log.series("loss")
    if loss:
        out["loss"] = {
            "p10": percentile(loss, 0.1),
            "median": median(loss),
            "mean": sum(loss) / len(loss),
            "p90": percentile(loss, 0.9),
            "first": loss[0],
            "last": loss[-1],
        }
        body = loss[w:] if len(loss) - w >= 30 else loss
        logs = [math.log(max(x, 1e-12)) for x in body]
        resid = [x - m for x, m in zip(logs, rolling(logs, 51, median), strict=True)]
        bc = bimodality_coefficient(resid)
        d, share = ashman_d(resid) if len(resid) >= 30 else (0.0, 0.0)
        out["loss"].update({"bimodality_coefficient": bc, "ashman_d": d, "minor_share": share})
        if len(resid) >= 30 and bc > 5 / 9 and d > 3 and share >= 0.1:
            find.append(
                Finding(
                    "WARN",
                    "loss",
                    f"bimodal step losses (BC {bc:.2f} > 0.555, Ashman's D {d:.1f}, "
                    f"{share:.0%} of steps in the minor mode)",
                    "two populations of batches: look for "
                    "empty or degenerate batches (no supervised tokens, wrong masks) or a data mix "
                    "with two regimes",
                )
            )
        elif len(resid) < 30:
            find.append(Finding("OK", "loss", f"only {len(resid)} records: too few to test for bimodality (≥ 30)"))
        else:
            find.append(Finding("OK", "loss", f"unimodal (BC {bc:.2f}, Ashman's D {d:.1f})"))
    for split, recs in (("train", log.train), ("val", log.val)):
        accs = [r["accuracy"] for r in recs if isinstance(r.get("accuracy"), list)]
        if accs:
            out[f"{split}_accuracy_last"] = accs[-1]
        _, tau = log.series("tau", split)
        if tau:
            out[f"{split}_tau"] = {"first": tau[0], "max": max(tau), "last": tau[-1]}
    _, lr = log.series("lr")
    if lr:
        out["lr"] = {"first": lr[0], "peak": max(lr), "last": lr[-1], "peak_step": log.series("lr")[0][w]}
    _, noise = log.series("noise_std")
    if noise:
        out["noise_std"] = {"first": noise[0], "last": noise[-1], "max": max(noise)}
    return out


CLIP_RULE = 0.5  # clipping on more than this share of steps is the rule, not a guard against spikes
CLIP_MIN_RECORDS = 20


def _clipping_finding(share: float, records: int, median_norm: float | None) -> Finding:
    """Gradient clipping meant to catch spikes: a warning when it acts on most steps — every clipped step moves the
    weights by lr·clip/‖g‖ instead of lr, so the configured learning rate (and its schedule) is not the one applied."""
    if records < CLIP_MIN_RECORDS:
        few = f"acted on {share:.0%} of {records} records: too few to judge (≥ {CLIP_MIN_RECORDS})"
        return Finding("OK", "clipping", few)
    if share <= CLIP_RULE:
        return Finding("OK", "clipping", f"acted on {share:.1%} of steps: it catches spikes")
    norm = f" (grad norm median {median_norm:.3g})" if median_norm is not None else ""
    return Finding(
        "WARN",
        "clipping",
        f"acted on {share:.1%} of steps{norm}: the rule, not the exception",
        "each clipped step applies lr·grad_clip/‖g‖, not the configured lr: raise grad_clip above the typical norm "
        "(about twice the median) so it only catches spikes, or lower lr",
    )


def compare(logs: list[RunLog], *, acc: float = 0.5, slot: int | None = None) -> dict[str, Any]:
    """Metrics every run has, the ones some lack (named), and steps to reach `acc`."""
    keys = [lg.keys() for lg in logs]
    shared = set.intersection(*keys) if keys else set()
    missing = {lg.name: sorted(set.union(*keys) - k) for lg, k in zip(logs, keys, strict=True) if set.union(*keys) - k}
    return {
        "shared": sorted(shared),
        "missing": missing,
        "acc_threshold": acc,
        "acc_on": f"slot {slot}" if slot is not None else "mean of slots 1…bs−1",
        "steps_to_accuracy": {lg.name: steps_to_accuracy(lg, acc, slot=slot) for lg in logs},
    }


def render(analyses: list[dict[str, Any]], comparison: dict[str, Any] | None) -> str:
    lines = []
    for a in analyses:
        lines.append(f"Run {a['name']}: {a['records']['train']} train / {a['records']['val']} val records")
        lines += [f"  note: {n}" for n in a["notes"]]
        if "loss" in a:
            lo = a["loss"]
            lines.append(
                f"  loss        P10 {lo['p10']:.4f}  median {lo['median']:.4f}  mean {lo['mean']:.4f}  "
                f"P90 {lo['p90']:.4f}  (first {lo['first']:.4f}, last {lo['last']:.4f})"
            )
        if "grad_norm" in a:
            g = a["grad_norm"]
            lines.append(
                f"  grad norm   mean after warmup {g['mean_after_warmup']:.4g}, median {g['median']:.4g}, "
                f"range {g['min']:.3g}…{g['max']:.3g}"
                + (f"; clipped {a['clipped_fraction']:.1%} of steps" if "clipped_fraction" in a else "")
            )
        for split in ("train", "val"):
            if f"{split}_tau" in a:
                t = a[f"{split}_tau"]
                acc = a.get(f"{split}_accuracy_last") or []
                lines.append(
                    f"  {split:<5} τ     {t['first']:.2f} → {t['last']:.2f} (max {t['max']:.2f}); last "
                    f"per-slot accuracy {' '.join(f'{x:.2f}' for x in acc[1:9])}" + (" …" if len(acc) > 9 else "")
                )
        if "lr" in a:
            lines.append(
                f"  lr          {a['lr']['first']:.2e} → peak {a['lr']['peak']:.2e} at step "
                f"{a['lr']['peak_step']} → {a['lr']['last']:.2e}"
            )
        if "noise_std" in a:
            n = a["noise_std"]
            lines.append(f"  noise std   {n['first']:.3g} → {n['last']:.3g}")
        lines += ["  " + f.line() for f in a["findings"]]
    if comparison:
        if len(analyses) > 1:
            lines.append(f"Compared on {len(comparison['shared'])} shared metrics: {', '.join(comparison['shared'])}")
        else:
            lines.append(f"Metrics logged: {', '.join(comparison['shared'])}")
        for name, miss in comparison["missing"].items():
            lines.append(f"  {name} lacks {', '.join(miss)}")
        lines.append(f"Steps to reach accuracy {comparison['acc_threshold']} ({comparison['acc_on']}):")
        for name, s in comparison["steps_to_accuracy"].items():
            lines.append(f"  {name:<24} {s if s is not None else 'not reached'}")
    return "\n".join(lines)


def plot(logs: list[RunLog], out_dir: str | Path) -> list[Path]:
    """Loss, grad norm, lr, τ and per-slot accuracy plots (PNG) for all runs; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for key, title, log_y in (
        ("loss", "loss", False),
        ("grad_norm", "grad norm (before clipping)", True),
        ("lr", "learning rate", False),
        ("tau", "estimated τ", False),
        ("noise_std", "fc noise std", False),
    ):
        series = [(lg, *lg.series(key)) for lg in logs]
        series = [s for s in series if s[2]]
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for lg, steps, vals in series:
            ax.plot(steps, vals, label=lg.name, lw=1)
            vs, vv = lg.series(key, "val")
            if vv and key in ("loss", "tau"):
                ax.plot(vs, vv, "o--", ms=3, label=f"{lg.name} (val)")
        if log_y and all(min(v) > 0 for _, _, v in series):
            ax.set_yscale("log")
        ax.set(title=title, xlabel="step")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(out / f"{key}.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    runs = [
        (
            lg,
            [
                (int(r.get("step", i + 1)), r["accuracy"])
                for i, r in enumerate(lg.train)
                if isinstance(r.get("accuracy"), list)
            ],
        )
        for lg in logs
    ]
    runs = [(lg, rows) for lg, rows in runs if rows]
    if runs:
        fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
        for ax, (lg, rows) in zip(axes[0], runs, strict=True):
            width = max(len(a) for _, a in rows)
            grid = [[(a[k] if k < len(a) else float("nan")) for _, a in rows] for k in range(1, width)]
            im = ax.imshow(
                grid,
                aspect="auto",
                origin="lower",
                vmin=0,
                vmax=1,
                cmap="viridis",
                extent=(rows[0][0], rows[-1][0], 0.5, width - 0.5),
            )
            ax.set(title=f"{lg.name}: per-slot accuracy", xlabel="step", ylabel="block slot")
            fig.colorbar(im, ax=ax)
        fig.tight_layout()
        written.append(out / "accuracy.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return written


__all__ = [
    "RunLog",
    "analyze",
    "ashman_d",
    "bimodality_coefficient",
    "compare",
    "plot",
    "read_run",
    "render",
    "steps_to_accuracy",
]
