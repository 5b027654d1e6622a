"""End to end: `dflashkit quickstart` on the embedded SmolLM2 with a tiny budget (checks the pipeline, not the
numbers), then a re-run that reuses every finished stage."""

from __future__ import annotations

import json

import pytest
import yaml

from helpers.bench_scripts import load_bench

pytestmark = pytest.mark.integration

TINY = [
    "--regen-minutes",
    "0.05",
    "--regen-batch",
    "4",
    "--max-new-tokens-regen",
    "24",
    "--original-text",
    "3",
    "--train-minutes",
    "0.4",
    "--eval-prompts",
    "1",
    "--eval-max-new-tokens",
    "12",
    "--methods",
    "ar,chain,ddtree:4",
    "--regen-server",  # the same route on every machine (the server route: tests/data/test_llama_server_regenerate.py)
    "off",
]


def test_quickstart_end_to_end_and_rerun(tmp_path, capsys):
    from dflashkit.cli import main
    from dflashkit.drafter.checkpoint import load_drafter

    out = tmp_path / "qs"
    argv = ["quickstart", "--out", str(out), *TINY, "--methods", "ar,chain,ddtree:auto"]  # the default's auto
    assert main(argv) == 0
    screen = capsys.readouterr().out
    state = json.loads((out / "quickstart.json").read_text())
    budget = state["done"]["budget"]["budget"]  # chosen once, on held-out ShareGPT prompts, for both datasets
    assert [r["budget"] for r in state["done"]["budget"]["rows"]] == [1, 2, 3, 4, 6, 8]  # block 4
    for needle in (
        "τ macro",
        "speedup",
        "mtbench",
        "humaneval",
        "chain",
        f"ddtree:auto({budget})",
        "best DDTree",
        str(out / "drafter"),
    ):
        assert needle in screen, needle
    assert set(state["done"]) == {"prepare", "capture", "train", "export", "budget", "eval"}
    prep = state["done"]["prepare"]
    assert prep["conversations"] >= 4 and prep["original_conversations"] == 3
    assert f"+ 3 original ShareGPT replies ({prep['original_supervised_tokens']:,}, target labels)" in screen
    train = state["done"]["train"]  # keep_best: the export is the best validation pass if any
    assert state["done"]["export"]["from"] == train.get("best", train["final"])
    drafter = load_drafter(out / "drafter")  # exported z-lab checkpoint loads strictly
    assert not drafter.config.learned_mask_embedding and drafter.config.mask_token_id == 16  # <empty_output>
    for dataset in ("mtbench", "humaneval"):
        doc = json.loads((out / "eval" / dataset / "results.json").read_text())
        chain = doc["results"]["quickstart"]["chain"]
        assert chain["greedy_equal_fraction"] == 1.0 and chain["n_prompts"] == 1
        auto = doc["results"]["quickstart"]["ddtree:auto"]
        assert auto["budget"] == budget and auto["greedy_equal_fraction"] == 1.0
        assert (out / "eval" / dataset / "report.md").is_file()
        assert list((out / "eval" / dataset).glob("*.png"))
    # training never saw the evaluation prompts: held-out sets are MT-Bench / HumanEval, training is ShareGPT
    ids = [json.loads(line)["id"] for line in (out / "data" / "tokens.jsonl").read_text().splitlines()]
    assert ids and all(not i.startswith(("mtbench", "humaneval")) for i in ids)
    calibration = state["done"]["budget"]["prompts"]  # held-out ShareGPT: neither trained on nor evaluated
    assert len(calibration) == 2 and not {i.removeprefix("orig-") for i in ids} & set(calibration)
    # original-text samples: conversations not regenerated, trained on the target's own labels
    regenerated = {json.loads(line)["id"] for line in (out / "data" / "regenerated.jsonl").read_text().splitlines()}
    orig = [i for i in ids if i.startswith("orig-")]
    assert len(orig) == 3 and not {i[len("orig-") :] for i in orig} & regenerated
    latest = out / "train" / (out / "train" / "latest").read_text().strip()
    assert yaml.safe_load((latest / "train_config.yaml").read_text())["labels"] == "target"
    # a re-run reuses every stage and prints the same screen
    assert main(argv) == 0
    assert "speedup" in capsys.readouterr().out
    check_sweep_on(out, tmp_path, capsys)
    check_levers_on(out, tmp_path, capsys)
    check_curve_on(out, tmp_path, capsys)


def test_quickstart_with_a_dspark_drafter(tmp_path, capsys):
    """`quickstart --drafter kind=dspark`: the final layer is captured for its loss, it trains, exports in the
    serving layout, and decodes losslessly with chain and DDTree on the held-out prompts."""
    from dflashkit.cli import main
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.features.manifest import Manifest

    out = tmp_path / "qs"
    args = ["quickstart", "--out", str(out), *TINY, "--drafter", "kind=dspark", "--drafter", "markov_rank=32"]
    assert main(args) == 0
    assert "τ macro" in capsys.readouterr().out
    drafter = load_drafter(out / "drafter")
    assert drafter.config.kind == "dspark" and drafter.config.head_settings.markov_rank == 32
    assert Manifest.load(out / "features").layer_ids[-1] == drafter.config.num_target_layers - 1
    for dataset in ("mtbench", "humaneval"):
        doc = json.loads((out / "eval" / dataset / "results.json").read_text())
        assert doc["drafters"]["quickstart"]["kind"] == "dspark"
        for method in ("chain", "ddtree:4"):
            res = doc["results"]["quickstart"][method]
            assert res["greedy_equal_fraction"] == 1.0, (dataset, method)
        assert doc["results"]["quickstart"]["chain"]["max_length"] == drafter.config.block_size + 1


def test_quickstart_with_a_domino_drafter(tmp_path, capsys):
    """`quickstart --drafter kind=domino`: no final layer captured, it trains, is exported in dflashkit's layout (vLLM
    has no Domino model: the note says so), and decodes losslessly with chain and DDTree on the held-out prompts."""
    from dflashkit.cli import main
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.features.manifest import Manifest

    out = tmp_path / "qs"
    assert main(["quickstart", "--out", str(out), *TINY, "--drafter", "kind=domino"]) == 0
    assert "τ macro" in capsys.readouterr().out
    drafter = load_drafter(out / "drafter")
    assert drafter.config.kind == "domino" and drafter.config.head_settings.emb_dim == 128  # the quickstart's preset
    assert drafter.config.num_target_layers - 1 not in Manifest.load(out / "features").layer_ids
    state = json.loads((out / "quickstart.json").read_text())
    assert any("vLLM has no Domino" in n for n in state["done"]["export"]["notes"])
    for dataset in ("mtbench", "humaneval"):
        doc = json.loads((out / "eval" / dataset / "results.json").read_text())
        for method in ("chain", "ddtree:4"):
            assert doc["results"]["quickstart"][method]["greedy_equal_fraction"] == 1.0, (dataset, method)
        assert doc["results"]["quickstart"]["chain"]["max_length"] == drafter.config.block_size + 1


def test_quickstart_with_an_xpress_drafter(tmp_path, capsys):
    """`quickstart --drafter kind=xpress`: it trains at the quickstart's preset (rank 64, CE: the quickstart has a
    draft vocabulary), is exported in dflashkit's layout (no released vLLM has an XPress model: the note says so),
    and decodes losslessly with chain and DDTree on the held-out prompts."""
    from dflashkit.cli import main
    from dflashkit.drafter.checkpoint import load_drafter

    out = tmp_path / "qs"
    assert main(["quickstart", "--out", str(out), *TINY, "--drafter", "kind=xpress"]) == 0
    assert "τ macro" in capsys.readouterr().out
    drafter = load_drafter(out / "drafter")
    assert drafter.config.kind == "xpress" and drafter.config.head_settings.xpress_rank == 64  # the quickstart's preset
    state = json.loads((out / "quickstart.json").read_text())
    assert any("no vLLM release has an XPress" in n for n in state["done"]["export"]["notes"])
    for dataset in ("mtbench", "humaneval"):
        doc = json.loads((out / "eval" / dataset / "results.json").read_text())
        for method in ("chain", "ddtree:4"):
            assert doc["results"]["quickstart"][method]["greedy_equal_fraction"] == 1.0, (dataset, method)
        assert doc["results"]["quickstart"]["chain"]["max_length"] == drafter.config.block_size


def test_the_quickstart_dspark_preset_and_what_overrides_it():
    """A DSpark drafter in the quickstart gets the small-budget preset (Markov rank 64, CE weight 1.0; measured in
    docs/studies.md), given values win, and DFlash runs are untouched."""
    from dflashkit.quickstart.run import QuickstartSettings
    from dflashkit.train.config import TrainConfig

    plain = QuickstartSettings()
    assert "markov_rank" not in plain.drafter_overrides() and plain.train_settings() == {}
    dspark = QuickstartSettings(drafter_extra={"kind": "dspark"})
    assert dspark.drafter_overrides()["markov_rank"] == 64 and dspark.train_settings() == {"dspark_ce_weight": 1.0}
    given = QuickstartSettings(
        drafter_extra={"kind": "dspark", "markov_rank": 256}, train_overrides={"dspark_ce_weight": 0.1, "lr": 1e-3}
    )
    assert given.drafter_overrides()["markov_rank"] == 256
    assert given.train_settings() == {"dspark_ce_weight": 0.1, "lr": 1e-3}
    assert TrainConfig().head_options["dspark"].dspark_ce_weight == 0.1  # `dflashkit train` keeps DeepSpec's default


def check_sweep_on(base, tmp_path, capsys):
    """bench/sweep_defaults.py on the finished run: a settings variant (3 of the 5 captured target layers, read
    from the same capture) and a data variant (half the responses, captured again), scored by one simulation."""
    from dflashkit.drafter.checkpoint import load_drafter

    sweep = load_bench("sweep_defaults")
    out = tmp_path / "sweep"
    args = [
        "--base",
        str(base),
        "--out",
        str(out),
        "--variants",
        "base,features3,regen3_train12",
        "--train-minutes",
        "0.1",
        "--sim-prompts",
        "1",
        "--sim-max-new-tokens",
        "12",
        "--sim-cache",
        str(tmp_path / "sim_cache"),
        "--budgets",
        "4",
        "--sim-datasets",
        "mtbench,humaneval",
    ]
    assert sweep.main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary) == {"base", "features3", "regen3_train12"}
    columns = {"mtbench chain", "mtbench ddtree:4", "humaneval chain", "humaneval ddtree:4"}
    assert all(set(t) == columns and all(v >= 1.0 for v in t.values()) for t in summary.values())
    assert (out / "sim-humaneval" / "results.json").is_file()
    assert load_drafter(out / "features3" / "train" / "final").config.target_layer_ids == [1, 14, 27]
    assert (out / "features3" / "features").is_symlink()  # read 3 of the 5 captured layers
    half = (out / "regen3_train12" / "data" / "regenerated.jsonl").read_text().splitlines()
    assert 0 < len(half) < len((base / "data" / "regenerated.jsonl").read_text().splitlines())
    assert "| features3 |" in (out / "sweep.md").read_text()
    assert sweep.main(args) == 0  # resumable: nothing is trained again


def check_levers_on(base, tmp_path, capsys):
    """The lever variants with two seeds: a top-k capture (shared by both seeds), warm start, original ShareGPT
    text with target labels, more regeneration (continues the base run's responses, shared by both seeds); the
    table reports mean ± half-range over the seeds."""
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.features.captured import CapturedFeatures

    sweep = load_bench("sweep_defaults")
    sweep.VARIANTS["orig_mix"] = {**sweep.VARIANTS["orig_mix"], "original_text": 4}  # 4 conversations, not 300
    # one more batch of 1 prompt (the base run's 24 new tokens; only the first batch starts once the 0.06 s have
    # passed), not 4 minutes of 32 × 192
    sweep.VARIANTS["regen10"] = {
        **sweep.VARIANTS["regen10"],
        "more_regen_minutes": 0.001,
        "settings": {"regen_batch": 1, "max_new_tokens_regen": 24},
    }
    assert sweep.interleaved(["a", "b"], [0, 1, 2]) == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    out = tmp_path / "levers"
    args = [
        "--base",
        str(base),
        "--out",
        str(out),
        "--variants",
        "base,topk32,warm_start,orig_mix,regen10,dpace",
        "--seeds",
        "0,1",
        "--train-minutes",
        "0.05",
        "--sim-prompts",
        "1",
        "--sim-max-new-tokens",
        "12",
        "--sim-cache",
        str(tmp_path / "sim_cache"),
        "--budgets",
        "4",
        "--sim-datasets",
        "mtbench",
    ]
    assert sweep.main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary) == {"base", "topk32", "warm_start", "orig_mix", "regen10", "dpace"}
    doc = json.loads((out / "sweep.json").read_text())
    assert sorted((r["variant"], r["seed"]) for r in doc["rows"]) == sorted((v, s) for v in summary for s in (0, 1))
    for v in summary:  # the summary is the mean over the seeds
        taus = [r["tau"]["mtbench chain"] for r in doc["rows"] if r["variant"] == v]
        assert summary[v]["mtbench chain"] == pytest.approx(sum(taus) / 2, abs=1e-4)
    topk = out / "topk32" / "features"
    assert topk.resolve() == (out / "topk32-s1" / "features").resolve()  # one capture for both seeds
    sample = CapturedFeatures(topk)[0]
    assert sample.topk_ids.shape[1] == 32 and sample.topk_logprobs.shape == sample.topk_ids.shape
    latest = out / "topk32" / "train" / (out / "topk32" / "train" / "latest").read_text().strip()
    assert yaml.safe_load((latest / "train_config.yaml").read_text())["loss"] == "topk"  # trained with it
    assert load_drafter(out / "warm_start" / "train" / "final").config.extra["warm_start"]
    latest = out / "dpace" / "train" / (out / "dpace" / "train" / "latest").read_text().strip()
    assert yaml.safe_load((latest / "train_config.yaml").read_text())["position_weights"] == "dpace"
    orig = [json.loads(line)["id"] for line in (out / "orig_mix" / "data" / "tokens.jsonl").read_text().splitlines()]
    assert any(i.startswith("orig-") for i in orig) and any(not i.startswith("orig-") for i in orig)
    base_lines = (base / "data" / "regenerated.jsonl").read_text().splitlines()
    more = (out / "regen10" / "data" / "regenerated.jsonl").read_text().splitlines()
    assert more[: len(base_lines)] == base_lines and len(more) == len(base_lines) + 1  # the base run continued
    assert (out / "regen10" / "features").resolve() == (out / "regen10-s1" / "features").resolve()  # built once
    assert len((out / "regen10" / "data" / "tokens.jsonl").read_text().splitlines()) > len(
        (base / "data" / "tokens.jsonl").read_text().splitlines()
    )
    md = (out / "sweep.md").read_text()
    assert "| warm_start |" in md and " ± " in md


def check_curve_on(base, tmp_path, capsys):
    """bench/curve.py: one JSON line per budget, resumable, PNG written."""
    curve = load_bench("curve")
    out = tmp_path / "curve"
    args = [
        "--base",
        str(base),
        "--out",
        str(out),
        "--multipliers",
        "0.5,1",
        "--train-minutes",
        "0.1",
        "--sim-prompts",
        "1",
        "--sim-max-new-tokens",
        "12",
        "--sim-cache",
        str(tmp_path / "sim_cache"),
        "--budgets",
        "4",
    ]
    assert curve.main(args) == 0
    capsys.readouterr()
    points = curve.read_points(out / "curve.jsonl")
    assert [p["train_minutes"] for p in points] == [0.05, 0.1]
    assert all(set(p["tau"]) == {"chain", "ddtree:4"} and p["steps"] >= 1 for p in points)
    assert (out / "curve.png").stat().st_size > 1000 and "| 0.5 |" in (out / "curve.md").read_text()
    assert curve.main(args) == 0  # resumable: both points are on record, nothing is retrained
    assert len(curve.read_points(out / "curve.jsonl")) == 2


@pytest.mark.parametrize(
    "text, why",
    [
        ("{garbage", "not valid JSON: Expecting property name"),
        ("[1]", "the document = [1]: expected an object"),
        ('{"done": 3}', "done = 3: expected a mapping"),
        ('{"done": {"train": 5}}', "done.train = 5: expected a mapping"),
    ],
)
def test_a_damaged_state_file_is_named_before_anything_runs(tmp_path, capsys, text, why):
    """quickstart.json is what a re-run reads to skip finished stages: damaged, it is one line (and the way out), not a
    traceback — and the target is never loaded for it."""
    from dflashkit.cli import main

    (tmp_path / "quickstart.json").write_text(text)
    assert main(["quickstart", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'quickstart.json'}: damaged quickstart state ({why}" in err
    assert "delete it and re-run: the rates are measured again and each stage continues from its own files" in err
