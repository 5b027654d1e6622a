"""`logs`: collapsed grad norms and bimodal losses flagged, healthy runs not; torn files, missing files and runs
with different metric sets handled; plots written."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from dflashkit.cli import main
from dflashkit.diagnose.logs import analyze, ashman_d, bimodality_coefficient, compare, read_run, steps_to_accuracy
from dflashkit.errors import DataError


def synthetic_run(
    path: Path,
    *,
    steps: int = 240,
    collapse_at: int | None = None,
    bimodal: bool = False,
    keys: tuple[str, ...] | None = None,
    seed: int = 0,
    speed: float = 60.0,
    clip: float = 1.5,
) -> Path:
    """metrics.jsonl as dflashkit training writes it (train records every step, val every 40)."""
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    rows = []
    for step in range(1, steps + 1):
        warm = 10
        cosine = 0.5 * (1 + math.cos(math.pi * (step - warm) / (steps - warm)))
        lr = 6e-4 * step / warm if step <= warm else 6e-4 * cosine
        loss = 3.0 * math.exp(-step / speed) + 0.8 + rng.gauss(0, 0.05)
        if bimodal and rng.random() < 0.3:
            loss = 0.02 + abs(rng.gauss(0, 0.01))  # degenerate batches: almost no supervised tokens
        grad = 1.5 * math.exp(-step / 200) + 0.3 + abs(rng.gauss(0, 0.05))
        if collapse_at is not None and step >= collapse_at:
            grad = 1e-7 * rng.random()
        acc1 = 0.9 * (1 - math.exp(-step / speed))
        acc = [0.0] + [acc1 * 0.85**k for k in range(7)]
        rec = {
            "step": step,
            "epoch": 0,
            "split": "train",
            "loss": loss,
            "accuracy": acc,
            "tau": 1 + sum(math.prod(acc[1 : k + 1]) for k in range(1, 8)),
            "lr": lr,
            "grad_norm": grad,
            "clipped": grad > clip,
            "noise_std": 0.05 * (1 - step / steps),
            "loss_p10": loss,
            "loss_median": loss,
        }
        if keys is not None:
            rec = {k: v for k, v in rec.items() if k in keys or k in ("step", "epoch", "split")}
        rows.append(rec)
        if step % 40 == 0:
            rows.append(
                {
                    "step": step,
                    "epoch": 0,
                    "split": "val",
                    "loss": loss + 0.1,
                    "accuracy": acc,
                    "tau": rec.get("tau", 1.0),
                }
            )
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def statuses(analysis: dict) -> dict[str, str]:
    return {f.check: f.status for f in analysis["findings"]}


def test_collapsed_grad_norm_and_bimodal_loss_are_flagged(tmp_path, capsys):
    run = synthetic_run(tmp_path / "bad", collapse_at=150, bimodal=True)
    a = analyze(read_run(run))
    assert statuses(a) == {"grad norm": "WARN", "clipping": "OK", "loss": "WARN"}
    text = "\n".join(f.line() for f in a["findings"])
    assert "WARN grad norm: collapsed: below 1e-3 × its early median" in text and "from step 150" in text
    assert "WARN loss: bimodal step losses (BC" in text
    assert a["loss"]["bimodality_coefficient"] > 5 / 9
    assert main(["logs", str(run)]) == 0
    out = capsys.readouterr().out
    assert "collapsed" in out and "bimodal" in out and "loss        P10" in out


def test_healthy_run_flags_nothing(tmp_path):
    a = analyze(read_run(synthetic_run(tmp_path / "good")))
    assert statuses(a) == {"grad norm": "OK", "clipping": "OK", "loss": "OK"}
    g, lo = a["grad_norm"], a["loss"]
    assert g["warmup_records"] == 9 and 0.3 < g["mean_after_warmup"] < 1.8
    assert lo["p10"] < lo["median"] < lo["p90"] and a["lr"]["peak_step"] == 10
    assert a["clipped_fraction"] == pytest.approx(
        sum(1 for r in read_run(tmp_path / "good").train if r["grad_norm"] > 1.5) / 240
    )
    assert a["train_tau"]["last"] > a["train_tau"]["first"] and a["noise_std"]["first"] > a["noise_std"]["last"]


def test_clipping_on_most_steps_is_flagged(tmp_path, capsys):
    """A clip below the typical gradient norm acts on nearly every step: the configured lr is not the one applied."""
    a = analyze(read_run(synthetic_run(tmp_path / "clipped", clip=0.5)))
    assert statuses(a)["clipping"] == "WARN" and a["clipped_fraction"] > 0.95
    line = next(f.line() for f in a["findings"] if f.check == "clipping")
    assert "of steps (grad norm median" in line and "the rule, not the exception" in line
    assert main(["logs", str(tmp_path / "clipped")]) == 0
    assert "raise grad_clip above the typical norm" in capsys.readouterr().out
    few = analyze(read_run(synthetic_run(tmp_path / "short", steps=15, clip=0.5)))
    assert statuses(few)["clipping"] == "OK"
    assert "too few to judge" in next(f.line() for f in few["findings"] if f.check == "clipping")


def test_bimodality_statistics():
    rng = random.Random(0)
    normal = [rng.gauss(0, 1) for _ in range(400)]
    two = [rng.gauss(0, 0.1) + (3 if i % 3 == 0 else 0) for i in range(400)]
    assert bimodality_coefficient(normal) < 0.45 < 5 / 9 < bimodality_coefficient(two)
    assert ashman_d(two)[0] > 10 and 0.3 < ashman_d(two)[1] < 0.36
    assert ashman_d(normal)[0] < 3


def test_truncated_last_line_is_skipped_with_a_note(tmp_path, capsys):
    run = synthetic_run(tmp_path / "torn", steps=50)
    f = run / "metrics.jsonl"
    f.write_text(f.read_text() + '{"step": 51, "split": "train", "loss": 0.9')
    log = read_run(run)
    assert len(log.train) == 50 and len(log.val) == 1
    assert log.notes == [f"skipped 1 incomplete line at the end of {f} (a run still writing, or killed)"]
    assert main(["logs", str(run)]) == 0
    assert "skipped 1 incomplete line at the end of" in capsys.readouterr().out


def test_missing_file_is_named(tmp_path, capsys):
    with pytest.raises(DataError, match=r"nope: no such run directory or metrics file"):
        read_run(tmp_path / "nope")
    (tmp_path / "nope").mkdir()
    with pytest.raises(DataError, match=r"nope/metrics.jsonl: no such file"):
        read_run(tmp_path / "nope")
    assert main(["logs", str(tmp_path / "nope")]) == 2
    assert f"{tmp_path / 'nope' / 'metrics.jsonl'}: no such file" in capsys.readouterr().err


def test_a_file_without_records_says_why(tmp_path, capsys):
    """An empty file, or one whose lines are not JSON objects (a CSV, a YAML): named, with the lines."""
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"empty.jsonl: no metric records \(the file is empty\); expected one JSON"):
        read_run(tmp_path / "empty.jsonl")
    (tmp_path / "m.csv").write_text("step,loss\n1,2.0\n")
    assert main(["logs", str(tmp_path / "m.csv")]) == 2
    assert "m.csv: no metric records (line(s) [1, 2] of 2 are not JSON objects)" in capsys.readouterr().err


def test_runs_with_different_metric_sets_are_compared(tmp_path, capsys):
    fast = synthetic_run(tmp_path / "fast", speed=30.0)
    slow = synthetic_run(tmp_path / "slow", speed=90.0, keys=("loss", "accuracy", "tau", "lr"))
    logs = [read_run(fast), read_run(slow)]
    c = compare(logs, acc=0.5)
    assert c["missing"] == {"slow": ["clipped", "grad_norm", "loss_median", "loss_p10", "noise_std"]}
    assert {"loss", "accuracy", "tau", "lr"} <= set(c["shared"])
    s = c["steps_to_accuracy"]
    assert s["fast"] < s["slow"]  # validation records every 40 steps decide
    assert steps_to_accuracy(logs[0], 0.5, slot=1) <= s["fast"]
    assert steps_to_accuracy(logs[0], 0.99) is None
    assert "grad norm" not in statuses(analyze(logs[1]))
    out_dir = tmp_path / "plots"
    assert main(["logs", str(fast), str(slow), "--acc", "0.5", "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "slow lacks clipped, grad_norm, loss_median, loss_p10, noise_std" in out
    assert "Steps to reach accuracy 0.5 (mean of slots 1…bs−1):" in out
    for name in ("loss", "grad_norm", "lr", "tau", "accuracy"):
        png = out_dir / f"{name}.png"
        assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"
    assert main(["logs", str(fast), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["runs"][0]["findings"][0]["status"] == "OK"


def test_values_of_the_wrong_type_are_named_not_a_crash(tmp_path, capsys):
    """A metrics file written by another tool (or by hand): a step that is not an integer skips its line, an accuracy
    that is not a list of numbers is ignored, each with a note; text, JSON and plots still come out."""
    f = tmp_path / "metrics.jsonl"
    rows = [
        {"step": 1, "loss": 1.0, "accuracy": [0, 0.2, None], "lr": "x"},
        {"step": "x", "loss": 0.9},
        {"step": 3.0, "loss": 0.8, "accuracy": [0, "a", 0.3]},
        {"step": 4, "loss": 0.7, "accuracy": {"slot1": 0.4}, "acc_slot01": "z"},
        {"step": 5, "loss": 0.6, "accuracy": [0, 0.5, 0.4], "grad_norm": [1]},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = read_run(f)
    assert [r["step"] for r in log.train] == [1, 3, 4, 5]
    assert math.isnan(log.train[0]["accuracy"][2]) and "accuracy" not in log.train[1]
    assert log.notes == [
        f"skipped 1 line(s) of {f} whose step is not an integer: [2]",
        f"ignored the accuracy of 2 line(s) of {f} (expected a list of numbers, one per block slot): [3, 4]",
    ]
    assert log.series("lr") == ([], []) and log.series("loss")[0] == [1, 3, 4, 5]
    # slot 1 reads 0.2 (step 1) and 0.5 (step 5), NaN and dropped values skipped: a centred mean of 0.35 at both
    assert steps_to_accuracy(log, 0.3, slot=1) == 1 and steps_to_accuracy(log, 0.4, slot=1) is None
    out_dir = tmp_path / "plots"
    assert main(["logs", str(f), "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "whose step is not an integer: [2]" in out and "Metrics logged: " in out
    assert (out_dir / "accuracy.png").is_file() and (out_dir / "loss.png").is_file()
    assert main(["logs", str(f), "--json"]) == 0
    json.loads(capsys.readouterr().out)
    (tmp_path / "steps.jsonl").write_text('{"step": "x", "loss": 1.0}\n{"step": 1.5, "loss": 0.5}\n')
    assert main(["logs", str(tmp_path / "steps.jsonl")]) == 2
    assert '(line(s) [1, 2] have a step that is not an integer); expected "step": an integer' in capsys.readouterr().err
