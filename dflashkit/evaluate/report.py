"""Reports: results.json (from `evaluate` or `simulate`) → Markdown + PNG plots; several results side by side.

    render("runs/eval/results.json")          # writes report.md and the PNGs next to results.json
    compare(["a/results.json", "b/results.json"], out_dir="runs/compare")   # compare.md + compare.png

Plots (matplotlib, Agg canvas; pyplot's global state is never touched):
    acceptance_histogram.png    fraction of rounds with acceptance length L (bonus included), per drafter·method
    survival.png                S(k) = P(L ≥ k + 1)
    per_position_acceptance.png a_k = S(k) / S(k − 1): the chance that draft slot k is accepted given slot k − 1 was
    comparison.png              τ (micro) and measured / predicted speedup per drafter·method
    per_category.png            τ (micro) per prompt category, per drafter·method
    tau_by_length.png           τ (micro) against the prompt-length bucket (when results carry `by_length`)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflashkit.errors import DataError
from dflashkit.evaluate.file_schemas import check_results
from dflashkit.io_utils import atomic_path, atomic_write_text

PLOTS = ("acceptance_histogram.png", "survival.png", "per_position_acceptance.png", "comparison.png")
GROUP_PLOTS = {"by_category": "per_category.png", "by_length": "tau_by_length.png"}


def load_results(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(
            f"{path}: no such file (expected a results.json written by `dflashkit eval` or `dflashkit simulate`)"
        ) from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except (UnicodeDecodeError, IsADirectoryError) as e:
        raise DataError(
            f"{path}: not a results.json written by `dflashkit eval` or `dflashkit simulate` ({type(e).__name__})"
        ) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), dict):
        raise DataError(f"{path}: expected an object with a 'results' field ({{drafter: {{method: stats}}}})")
    check_results(doc, str(path))  # every field the tables and plots read, with its type
    doc["_path"] = str(path)
    return doc


def _f(x: Any, digits: int = 2, suffix: str = "") -> str:
    return "—" if x is None else f"{x:.{digits}f}{suffix}"


def _series(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{name} · {method}", st) for name, methods in doc["results"].items() for method, st in methods.items()]


# ---------------------------------------------------------------------------------------------- tables
def summary_table(doc: dict[str, Any]) -> str:
    ar = doc.get("ar") or None
    rows = [
        "| drafter | method | τ micro | τ macro | tok/s | speedup | predicted | efficiency | full block | "
        "zero accept | greedy = AR | prompts |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    if ar:
        rows.append(
            f"| (baseline) | ar | 1.00 | 1.00 | {_f(ar.get('tok_s'), 1)} | 1.00× | — | — | — | — | — | "
            f"{ar.get('n_prompts', '—')} |"
        )
    for name, methods in doc["results"].items():
        for method, st in methods.items():
            label = f"{method} (B={st['budget']})" if "budget" in st else method  # ddtree:auto: the chosen budget
            rows.append(
                f"| {name} | {label} | {_f(st.get('tau_micro'))} | {_f(st.get('tau_macro'))} | "
                f"{_f(st.get('tok_s'), 1)} | {_f(st.get('speedup_vs_ar'), 2, '×')} | "
                f"{_f(st.get('predicted_speedup'), 2, '×')} | {_f(st.get('efficiency'))} | "
                f"{_f(st.get('full_block_fraction'), 3)} | {_f(st.get('zero_accept_fraction'), 3)} | "
                f"{_f(st.get('greedy_equal_fraction'), 3)} | {st.get('n_prompts', '—')} |"
            )
    return "\n".join(rows)


def _budget_choice_lines(doc: dict[str, Any]) -> list[str]:
    """'## DDTree budget chosen' (ddtree:auto): per drafter, the candidates' τ, round time and tokens/s."""
    lines = []
    for name, methods in doc["results"].items():
        choice = (methods.get("ddtree:auto") or {}).get("budget_choice")
        if not choice:
            continue
        lines += [
            f"- `{name}`: budget **{choice['budget']}**, calibrated on prompts {', '.join(choice['prompts'])}",
            "",
            "| budget | τ (replayed) | round ms | tokens/s |",
            "|---|---|---|---|",
            *[
                f"| {r['budget']}{' ←' if r['budget'] == choice['budget'] else ''} | {r['tau']:.3f} | "
                f"{r['round_ms']:.1f} | {r['tokens_per_s']:.1f} |"
                for r in choice["rows"]
            ],
            "",
        ]
    if not lines:
        return []
    return [
        "## DDTree budget chosen (ddtree:auto)",
        "",
        "τ per budget replayed on the calibration prompts' greedy transcripts, round time measured on this machine "
        "(real DDTree rounds, interleaved), tokens/s = τ ÷ round time; the smallest budget within 2 % of the "
        "fastest is chosen.",
        "",
        *lines,
    ]


def _stage_table(doc: dict[str, Any]) -> str:
    stages = ("draft", "tree_build", "verify", "commit")
    rows = [
        "| drafter | method | " + " | ".join(f"{s} ms/round" for s in stages) + " | round ms | prefill s (total) |",
        "|---|---|" + "---|" * (len(stages) + 2),
    ]
    ar = doc.get("ar")
    if ar and ar.get("timings_per_round_s"):
        per = ar["timings_per_round_s"]
        rows.append(
            "| (baseline) | ar | "
            + " | ".join(_f(per[s] * 1e3 if per.get(s) is not None else None, 3) for s in stages)
            + f" | {_f(ar['t_step_s'] * 1e3 if ar.get('t_step_s') else None, 3)} | "
            f"{_f((ar.get('timings_s') or {}).get('prefill'), 3)} |"
        )
    for name, methods in doc["results"].items():
        for method, st in methods.items():
            per = st.get("timings_per_round_s") or {}
            rows.append(
                f"| {name} | {method} | "
                + " | ".join(_f(per[s] * 1e3 if per.get(s) is not None else None, 3) for s in stages)
                + f" | {_f(st['round_s'] * 1e3 if st.get('round_s') else None, 3)} | "
                f"{_f((st.get('timings_s') or {}).get('prefill'), 3)} |"
            )
    return "\n".join(rows)


def _position_table(doc: dict[str, Any]) -> str:
    series = _series(doc)
    width = max((len(st.get("per_position_acceptance") or []) for _, st in series), default=0)
    if not width:
        return "_no draft positions_"
    rows = [
        "| drafter · method | accepted / drafted | " + " | ".join(f"a{k}" for k in range(1, width + 1)) + " |",
        "|---|---|" + "---|" * width,
    ]
    for label, st in series:
        a = list(st.get("per_position_acceptance") or [])
        rows.append(
            f"| {label} | {_counts(st)} | " + " | ".join(_f(x, 3) for x in a + [None] * (width - len(a))) + " |"
        )
    return "\n".join(rows)


def _counts(st: dict[str, Any]) -> str:
    """'8 / 20 (0.400)': accepted drafts / draft tokens verified (their ratio), or — when not recorded."""
    if st.get("drafted") is None or st.get("accepted_drafts") is None:
        return "—"
    return f"{st['accepted_drafts']} / {st['drafted']} ({_f(st.get('acceptance_rate'), 3)})"


def _group_names(series: list[tuple[str, dict[str, Any]]], key: str) -> list[str]:
    """The groups of `key` ("by_category" / "by_length") over every series, in first appearance."""
    names: list[str] = []
    for _, st in series:
        names += [g for g in st.get(key) or {} if g not in names]
    return names


def group_overview(series: list[tuple[str, dict[str, Any]]], key: str, title: str) -> str:
    """One row per group, τ micro of every drafter·method side by side (the prompts counted once)."""
    names = _group_names(series, key)
    if not names:
        return ""
    rows = [
        f"| {title} | prompts | " + " | ".join(label for label, _ in series) + " |",
        "|---|---|" + "---|" * len(series),
    ]
    for g in names:
        per = [(st.get(key) or {}).get(g) or {} for _, st in series]
        prompts = next((x.get("n_prompts") for x in per if x.get("n_prompts") is not None), None)
        rows.append(
            f"| {g} | {prompts if prompts is not None else '—'} | "
            + " | ".join(_f(x.get("tau_micro")) for x in per)
            + " |"
        )
    return "\n".join(rows)


def group_details(series: list[tuple[str, dict[str, Any]]], key: str, title: str) -> str:
    """Per drafter·method and group: rounds, τ micro / macro, accepted / drafted, the per-position acceptance."""
    width = max(
        (len(g.get("per_position_acceptance") or []) for _, st in series for g in (st.get(key) or {}).values()),
        default=0,
    )
    rows = [
        f"| drafter · method | {title} | prompts | rounds | τ micro | τ macro | accepted / drafted | "
        + " | ".join(f"a{k}" for k in range(1, width + 1))
        + " |",
        "|---|---|---|---|---|---|---|" + "---|" * width,
    ]
    for label, st in series:
        for g, x in (st.get(key) or {}).items():
            a = list(x.get("per_position_acceptance") or [])
            rows.append(
                f"| {label} | {g} | {x.get('n_prompts', '—')} | {x.get('rounds', '—')} | {_f(x.get('tau_micro'))} | "
                f"{_f(x.get('tau_macro'))} | {_counts(x)} | "
                + " | ".join(_f(v, 3) for v in a + [None] * (width - len(a)))
                + " |"
            )
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------- plots
def _figure(width: float = 7.0, height: float = 4.0) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")


def _plot_histogram(series: list[tuple[str, dict[str, Any]]], path: Path) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    n = max(len(series), 1)
    width = 0.8 / n
    for j, (label, st) in enumerate(series):
        hist, rounds = st["histogram"], max(1, st.get("rounds") or sum(st["histogram"]))
        xs = list(range(1, len(hist)))
        ax.bar([x - 0.4 + width * (j + 0.5) for x in xs], [hist[x] / rounds for x in xs], width=width, label=label)
    ax.set_xlabel("acceptance length L (bonus included)")
    ax.set_ylabel("fraction of rounds")
    ax.set_title("Acceptance length histogram")
    ax.legend(fontsize=7)
    _save(fig, path)


def _plot_lines(
    series: list[tuple[str, dict[str, Any]]], key: str, start: int, path: Path, ylabel: str, title: str
) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    for label, st in series:
        ys = st.get(key) or []
        pts = [(start + k, y) for k, y in enumerate(ys) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=label)
    ax.set_xlabel("k")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)


def _plot_comparison(series: list[tuple[str, dict[str, Any]]], path: Path) -> None:
    has_speed = any(st.get("speedup_vs_ar") is not None for _, st in series)
    fig = _figure(8.0, 4.0)
    labels = [label for label, _ in series]
    xs = list(range(len(series)))
    ax = fig.add_subplot(1, 2 if has_speed else 1, 1)
    ax.bar(xs, [st.get("tau_micro") or 0 for _, st in series], color="tab:blue")
    ax.set_xticks(xs, labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("τ (tokens per round)")
    ax.set_title("Acceptance length τ (micro)")
    if has_speed:
        ax2 = fig.add_subplot(1, 2, 2)
        ax2.bar(
            [x - 0.2 for x in xs],
            [st.get("speedup_vs_ar") or 0 for _, st in series],
            width=0.4,
            label="measured",
            color="tab:green",
        )
        ax2.bar(
            [x + 0.2 for x in xs],
            [st.get("predicted_speedup") or 0 for _, st in series],
            width=0.4,
            label="predicted",
            color="tab:gray",
        )
        ax2.axhline(1.0, color="black", linewidth=0.8)
        ax2.set_xticks(xs, labels, rotation=30, ha="right", fontsize=7)
        ax2.set_ylabel("× AR tok/s")
        ax2.set_title("Speedup vs AR")
        ax2.legend(fontsize=7)
    _save(fig, path)


def _plot_groups(series: list[tuple[str, dict[str, Any]]], key: str, path: Path) -> None:
    """τ micro per group: bars per category, or a line against the length buckets."""
    names = _group_names(series, key)
    fig = _figure(max(7.0, 0.9 * len(names) + 3), 4.0)
    ax = fig.add_subplot()
    xs = list(range(len(names)))
    width = 0.8 / max(len(series), 1)
    for j, (label, st) in enumerate(series):
        groups = st.get(key) or {}
        ys = [(groups.get(g) or {}).get("tau_micro") for g in names]
        if key == "by_length":
            pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=4, label=label)
        else:
            ax.bar([x - 0.4 + width * (j + 0.5) for x in xs], [y or 0 for y in ys], width=width, label=label)
    ax.set_xticks(
        xs,
        names,
        rotation=30 if key == "by_category" else 0,
        ha="right" if key == "by_category" else "center",
        fontsize=8,
    )
    ax.set_xlabel("prompt category" if key == "by_category" else "prompt length (tokens, bucket)")
    ax.set_ylabel("τ micro (tokens per round)")
    ax.set_title(
        "Acceptance length by category" if key == "by_category" else "Acceptance length against context length"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)


def _group_sections(series: list[tuple[str, dict[str, Any]]], out: Path) -> list[str]:
    """'## Per category' and, when measured, '## Per context length': overview, plot, details."""
    lines: list[str] = []
    for key, title, heading in (
        ("by_category", "category", "Per category"),
        ("by_length", "prompt tokens", "Per context length"),
    ):
        overview = group_overview(series, key, title)
        if not overview:
            continue
        _plot_groups(series, key, out / GROUP_PLOTS[key])
        lines += [
            f"## {heading}",
            "",
            overview,
            "",
            f"![{heading.lower()}]({GROUP_PLOTS[key]})",
            "",
            group_details(series, key, title),
            "",
        ]
    return lines


def header_settings(doc: dict[str, Any]) -> str:
    """The sampling and prompt settings every report states: temperature, thinking mode, lengths."""
    s = doc.get("settings") or {}
    sampling = s.get("sampling") or {}
    thinking = "not recorded" if "thinking" not in s else s["thinking"] or "the template default"
    return (
        f"temperature {sampling.get('temperature', 0)}"
        + (f", top-p {sampling['top_p']}" if sampling.get("top_p") not in (None, 1.0) else "")
        + (f", top-k {sampling['top_k']}" if sampling.get("top_k") else "")
        + f", thinking mode {thinking}, max_new_tokens {s.get('max_new_tokens', '?')}"
    )


# ---------------------------------------------------------------------------------------------- documents
def _decode_compile_line(doc: dict[str, Any]) -> list[str]:
    """The header line saying whether decoding ran the target's layers through torch.compile, and why (none for
    results written without the choice)."""
    dc = doc.get("decode_compile")
    if not isinstance(dc, dict) or dc.get("choice") not in ("eager", "compiled"):
        return []
    return [f"- torch.compile of the target's layers while decoding: {dc.get('why') or dc['choice']}"]


def render(results: str | Path | dict[str, Any], out_dir: str | Path | None = None) -> str:
    """Markdown report of one results.json; writes report.md + PNGs into `out_dir` (default: next to it)."""
    doc = results if isinstance(results, dict) else load_results(results)
    if out_dir is None:
        if "_path" not in doc:
            raise DataError("render(dict) needs out_dir (no results.json path to write next to)")
        out_dir = Path(doc["_path"]).parent
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    series = _series(doc)
    if series:
        _plot_histogram(series, out / PLOTS[0])
        _plot_lines(series, "survival", 0, out / PLOTS[1], "S(k) = P(L ≥ k+1)", "Survival")
        _plot_lines(
            series, "per_position_acceptance", 1, out / PLOTS[2], "a_k = S(k)/S(k−1)", "Per-position acceptance"
        )
        _plot_comparison(series, out / PLOTS[3])
    t, ds, s = doc.get("target") or {}, doc.get("dataset") or {}, doc.get("settings") or {}
    kind = doc.get("kind", "evaluate")
    lines = [
        f"# dflashkit {'simulation' if kind == 'simulate' else 'evaluation'}: {ds.get('name') or 'prompts'}",
        "",
        f"- target: `{t.get('source', '?')}` ({t.get('architecture', '?')}, {t.get('num_layers', '?')} layers, "
        f"hidden {t.get('hidden_size', '?')}, {t.get('dtype', '?')}{', hybrid' if t.get('hybrid') else ''})",
        f"- prompts: {ds.get('n_prompts', '?')}" + (f" ({len(ds['skipped'])} skipped)" if ds.get("skipped") else ""),
        f"- {header_settings(doc)}, tree top-k {s.get('tree_top_k', '—') or '= budget'}",
        *_decode_compile_line(doc),
        "",
        "## Summary",
        "",
        summary_table(doc),
        "",
    ]
    if kind != "simulate":
        lines += [
            "τ counts the bonus token. Speedup = tok/s ÷ AR tok/s in the same run (prefill included); "
            "predicted = τ × AR step time ÷ round time from stage costs; efficiency = speedup ÷ predicted.",
            "",
            "## Stage costs",
            "",
            _stage_table(doc),
            "",
            *_budget_choice_lines(doc),
        ]
    if series:
        lines += [
            "## Acceptance",
            "",
            "![acceptance histogram](acceptance_histogram.png)",
            "",
            "![survival](survival.png)",
            "",
            "![per-position acceptance](per_position_acceptance.png)",
            "",
            _position_table(doc),
            "",
            "![comparison](comparison.png)",
            "",
            *_group_sections(series, out),
        ]
    divs = [(label, d) for label, st in series for d in st.get("divergences") or []]
    if kind != "simulate":
        lines += ["## Greedy equality", ""]
        if not divs:
            lines.append(
                "Every speculative output equals the AR output."
                if (s.get("sampling") or {}).get("temperature", 0) == 0
                else "Sampling run: no greedy equality check."
            )
        for label, d in divs:
            lines.append(
                f"- {label}, prompt `{d.get('prompt_id')}`: first difference at token {d['index']} "
                f"(AR {d['ar_token']}, speculative {d['spec_token']}), top-2 margin {d['margin']:.3g} → "
                f"**{d['verdict']}**"
            )
        lines.append("")
    drafters = doc.get("drafters") or {}
    if drafters:
        lines += [
            "## Drafters",
            "",
            "| name | source | block size | target layers | parameters |",
            "|---|---|---|---|---|",
        ]
        for name, info in drafters.items():
            lines.append(
                f"| {name} | {info.get('source') or '—'} | {info.get('block_size')} | "
                f"{info.get('target_layer_ids')} | {info.get('parameters', 0):,} |"
            )
        lines.append("")
    if doc.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in doc["notes"]] + [""]
    text = "\n".join(lines)
    atomic_write_text(out / "report.md", text)
    return text


def _compare_groups(labels: Sequence[str], docs: list[dict[str, Any]], out: Path | None) -> list[str]:
    """Per category (and per length bucket): τ micro of every drafter·method with the runs side by side, a plot of
    the same (compare_per_category.png, compare_tau_by_length.png, when `out` is given), and every run's details —
    τ micro / macro, accepted / drafted, the per-position acceptance."""
    lines: list[str] = []
    runs = [(f"{label} · {series}", st) for label, doc in zip(labels, docs, strict=True) for series, st in _series(doc)]
    for key, title in (("by_category", "category"), ("by_length", "prompt tokens")):
        cells: dict[tuple[str, str], dict[str, Any]] = {}
        for label, doc in zip(labels, docs, strict=True):
            for series, st in _series(doc):
                for g, x in (st.get(key) or {}).items():
                    cells.setdefault((series, g), {})[label] = x.get("tau_micro")
        if not cells:
            continue
        lines += [
            f"## τ micro per {title}",
            "",
            f"| drafter · method | {title} | " + " | ".join(labels) + " |",
            "|---|---|" + "---|" * len(labels),
            *[
                f"| {series} | {g} | " + " | ".join(_f(per.get(label)) for label in labels) + " |"
                for (series, g), per in cells.items()
            ],
            "",
        ]
        if out is not None:
            plot = f"compare_{GROUP_PLOTS[key]}"
            _plot_groups(runs, key, out / plot)
            lines += [f"![τ per {title}]({plot})", ""]
        lines += [f"### Details per {title}", "", group_details(runs, key, title), ""]
    return lines


def compare(paths: Sequence[str | Path], out_dir: str | Path | None = None, labels: Sequence[str] | None = None) -> str:
    """Side-by-side Markdown table of several results files (+ compare.png when `out_dir` is given)."""
    docs = [load_results(p) for p in paths]
    if not docs:
        raise DataError("compare needs at least one results.json")
    if labels is None:
        labels = [Path(d["_path"]).parent.name or Path(d["_path"]).stem for d in docs]
        if len(set(labels)) < len(labels):
            labels = [f"{k + 1}:{lab}" for k, lab in enumerate(labels)]
    rows = [
        "| run | dataset | drafter | method | τ micro | τ macro | full block | speedup | tok/s | greedy = AR |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    table: dict[str, dict[str, float]] = {}
    for label, doc in zip(labels, docs, strict=True):
        ds = (doc.get("dataset") or {}).get("name") or "—"
        for series, st in _series(doc):
            rows.append(
                f"| {label} | {ds} | {series.replace(' · ', ' | ')} | {_f(st.get('tau_micro'))} | "
                f"{_f(st.get('tau_macro'))} | {_f(st.get('full_block_fraction'), 3)} | "
                f"{_f(st.get('speedup_vs_ar'), 2, '×')} | {_f(st.get('tok_s'), 1)} | "
                f"{_f(st.get('greedy_equal_fraction'), 3)} |"
            )
            table.setdefault(series, {})[label] = st.get("tau_micro") or 0.0
    headers = [f"- {label}: {header_settings(doc)}" for label, doc in zip(labels, docs, strict=True)]
    out = None if out_dir is None else Path(out_dir)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    text = "\n".join(["# dflashkit comparison", "", *headers, "", *rows, "", *_compare_groups(labels, docs, out)])
    if out is not None:
        fig = _figure(max(6.0, 1.2 * len(table) + 2), 4.0)
        ax = fig.add_subplot()
        width = 0.8 / len(labels)
        names = list(table)
        for j, label in enumerate(labels):
            ax.bar(
                [i - 0.4 + width * (j + 0.5) for i in range(len(names))],
                [table[n].get(label, 0.0) for n in names],
                width=width,
                label=label,
            )
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("τ micro")
        ax.set_title("τ by drafter · method")
        ax.legend(fontsize=7)
        _save(fig, out / "compare.png")
        text += "\n![comparison](compare.png)\n"
        atomic_write_text(out / "compare.md", text)
    return text
