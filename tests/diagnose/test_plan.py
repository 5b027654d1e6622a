"""`dflashkit plan`: the drafter it plans for published target configs equals the reference drafters' geometry,
every figure states its basis, its YAML is a config `train` accepts, its layouts follow from the memory model, and
a user goes from the plan's commands to a running `train` on the embedded target."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from typing import Any

import pytest

from dflashkit.diagnose.plan import Hardware, PlanRequest, blocks_per_row, make_plan
from dflashkit.diagnose.plan_files import write_plan
from dflashkit.errors import ConfigError
from dflashkit.train.config import TrainConfig
from tests.helpers.process_cost import run_measured
from tests.helpers.published_configs import QWEN3_6_27B, QWEN3_8B, QWEN3_30B_A3B, write_config

# z-lab's published drafters (config.json on Hugging Face): the geometry a plan for the same target must give.
ZLAB_QWEN3_8B = {
    "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 12288, "target_layer_ids": [1, 9, 17, 25, 33], "block_size": 16,
}  # fmt: skip
ZLAB_QWEN3_6_27B = {
    "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 17408, "target_layer_ids": [1, 16, 31, 46, 61], "block_size": 16,
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"], "sliding_window": 2048,
}  # fmt: skip


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("configs")
    out = {}
    for name, raw, gpus in (
        ("qwen3-8b", QWEN3_8B, "8xH100"),
        ("qwen3.6-27b", QWEN3_6_27B, "8xH200"),
        ("qwen3-30b-a3b", QWEN3_30B_A3B, "4xH100"),
    ):
        target = write_config(root / name, raw)
        out[name] = make_plan(
            PlanRequest(target=str(target), hardware=Hardware.parse(gpus), out=str(root / f"p-{name}"))
        )
    return out


@pytest.mark.parametrize(("name", "reference"), [("qwen3-8b", ZLAB_QWEN3_8B), ("qwen3.6-27b", ZLAB_QWEN3_6_27B)])
def test_the_planned_drafter_is_the_reference_geometry(plans, name, reference) -> None:
    cfg = plans[name].drafter
    assert {k: getattr(cfg, k) for k in reference} == reference
    section = plans[name].sections["drafter"]
    assert section["draft vocabulary"]["value"] == plans[name].target.vocab_size
    assert "--draft-vocab-from" in section["draft vocabulary"]["why"]


def test_the_yaml_builds_the_planned_drafter_and_train_accepts_it(plans, tmp_path) -> None:
    from dflashkit.train.memory_check import run_drafter_config

    plan = plans["qwen3.6-27b"]
    paths = write_plan(plan, tmp_path)
    cfg = TrainConfig.load(str(paths["yaml"]), [])
    built = run_drafter_config(cfg, plan.target)
    for field in (*ZLAB_QWEN3_6_27B, "kind"):
        assert getattr(built, field) == getattr(plan.drafter, field), field
    assert cfg.online and cfg.fsdp and cfg.max_tokens == 3072 and cfg.max_anchors == 512


def test_every_figure_states_its_basis(plans, tmp_path) -> None:
    paths = write_plan(plans["qwen3-8b"], tmp_path)
    doc = json.loads(paths["json"].read_text())
    figures = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if "basis" in node and "value" in node:
                figures.append(node)
                return
            for v in node.values():
                walk(v)

    walk(doc["sections"])
    assert len(figures) > 15
    assert {f["basis"] for f in figures} <= {"computed", "assumed", "measured", "given", "rule"}
    assert all(f["why"] for f in figures if f["basis"] == "assumed"), "an assumption must say what it assumes"
    md = paths["md"].read_text()
    assert "*(assumed" in md and "*(computed" in md and "## Commands" in md


def test_layouts_follow_the_memory_model(plans) -> None:
    """A MoE target's weights (61 GB in bf16) leave no room for online training on 80 GB: offline is chosen, and
    its commands capture; the dense 8B fits online once the drafter is sharded."""
    moe, dense = plans["qwen3-30b-a3b"].sections["memory"], plans["qwen3-8b"].sections["memory"]
    assert not moe["layouts"]["online, DDP"]["fits"] and moe["chosen"].startswith("offline")
    assert any("dflashkit capture" in cmd for _, cmd in plans["qwen3-30b-a3b"].commands)
    assert dense["chosen"] == "online, FSDP" and not dense["layouts"]["online, DDP"]["fits"]
    online, sharded = dense["layouts"]["online, DDP"]["parts GiB"], dense["layouts"]["online, FSDP"]["parts GiB"]
    assert online["target weights"] == sharded["target weights"] == pytest.approx(8_190_735_360 * 2 / 2**30, abs=1e-3)
    assert sharded["optimizer state"] == pytest.approx(online["optimizer state"] / 8, rel=1e-3)  # sharded over 8
    assert "DDP gradient buckets" in online and "DDP gradient buckets" not in sharded
    offline = dense["layouts"]["offline, DDP"]["parts GiB"]
    assert offline["target weights"] == pytest.approx(2 * 151936 * 4096 * 2 / 2**30, abs=1e-3)  # the two tables
    assert "capture (its own run)" in offline and "setup" in offline


def test_gpu_commands_run_on_the_gpus(plans) -> None:
    """Every step of an 8-GPU plan runs on its GPUs: vLLM data-parallel over them, capture and train under torchrun,
    eval on CUDA; prepare caps replies and names data large enough for the plan."""
    everything = [c for _, c in plans["qwen3-30b-a3b"].commands]
    assert "--data-parallel-size 4" in next(c for c in everything if c.startswith("vllm serve"))
    prepare = next(c for c in everything if " prepare " in c)
    assert "--max-new-tokens 2048" in prepare and "--data conversations.jsonl" in prepare and "--server" in prepare
    capture = next(c for c in everything if " capture " in c)
    assert (
        capture.startswith("torchrun --standalone --nproc_per_node 4 -m dflashkit capture")
        and "--device cuda" in capture
    )
    assert "--layer-ids 1,12,23,34,45" in capture
    train = next(c for c in everything if " train " in c)
    assert train.startswith("torchrun --standalone --nproc_per_node 4 -m dflashkit train")
    assert "--device cuda" in next(c for c in everything if c.startswith("dflashkit eval"))
    data = plans["qwen3-30b-a3b"].sections["data"]["conversations"]
    assert data["basis"] == "rule" and "17,000" in data["why"]


def test_blocks_per_row_counts_documents_and_their_replies() -> None:
    req = PlanRequest(target="x", seq_len=3072, avg_tokens=1000, max_anchors=512)
    assert blocks_per_row(req, 512) == 3 * 512  # three documents, each with ≥ 512 reply tokens
    assert blocks_per_row(req, 64) == 3 * 64
    short = PlanRequest(target="x", seq_len=1024, avg_tokens=400, max_anchors=512)
    assert blocks_per_row(short, 512) == 2 * (int(400 * 0.6) - 1)  # anchors limited by a reply's tokens


def test_a_warm_start_keeps_the_base_drafter_and_evaluates_it_first(tmp_path) -> None:
    from dflashkit.drafter.checkpoint import save_drafter
    from dflashkit.drafter.config import DrafterConfig
    from dflashkit.drafter.model import DFlashDrafter

    small = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 4}
    small.update(num_key_value_heads=2, head_dim=64, vocab_size=1000)
    target = write_config(tmp_path / "tiny", {**QWEN3_8B, **small})
    base = DrafterConfig.for_target(
        hidden_size=256, vocab_size=1000, num_target_layers=8, mask_token_id=3, num_hidden_layers=2, block_size=8
    )
    save_drafter(DFlashDrafter(base), tmp_path / "base")
    plan = make_plan(PlanRequest(target=str(target), from_drafter=str(tmp_path / "base"), out=str(tmp_path / "p")))
    assert plan.drafter.num_hidden_layers == 2 and plan.drafter.block_size == 8
    assert plan.yaml["init_from"] == str(tmp_path / "base") and plan.yaml["epochs"] == 2
    assert "base=" in plan.commands[0][1] and plan.commands[0][1].startswith("dflashkit eval")
    other = write_config(tmp_path / "other", {**QWEN3_8B, "hidden_size": 512})
    with pytest.raises(ConfigError, match="hidden_size is 256 but the target's is 512"):
        make_plan(PlanRequest(target=str(other), from_drafter=str(tmp_path / "base")))


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--gpus", "8xV900"], '--gpus "8xV900": expected N×NAME'),
        (["--gpus", "0xH100"], '--gpus "0xH100": expected N×NAME'),
        (["--target", "nowhere"], "nowhere"),
    ],
)
def test_bad_input_is_one_line(argv, expected, tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dflashkit", "plan", *argv, "--out", str(tmp_path / "p")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_plan_of_any_size_costs_seconds(tmp_path) -> None:
    """Rows of 10^9 tokens (past int64 for a dense mask of the step): refused in one line or planned, never a
    traceback; the largest rows the CLI takes (2^24 tokens) planned — each at the cost of a plan of 1,024-token
    rows (the estimate does not grow with the size it estimates; a machine's load slows all three alike, so they are
    compared with each other) and a few hundred MB, imports included."""
    target = write_config(tmp_path / "qwen3-8b", QWEN3_8B)

    def plan(seq_len: int) -> Any:
        proc = run_measured(
            [sys.executable, "-m", "dflashkit", "plan", "--target", str(target), "--seq-len", str(seq_len),
             "--out", str(tmp_path / f"p{seq_len}")],
            timeout=600,
        )  # fmt: skip
        assert proc.returncode in (0, 2) and "Traceback" not in proc.stderr, proc.stderr
        assert proc.returncode == 0 or len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert proc.peak_rss_mib < 800, (seq_len, proc.peak_rss_mib)
        return proc

    small = plan(1024)
    for seq_len in (10**9, 2**24):
        proc = plan(seq_len)
        assert proc.seconds < 3 * small.seconds + 10, (seq_len, proc.seconds, small.seconds)
    assert proc.returncode == 0 and "memory" in proc.stdout, proc.stderr


def test_from_plan_to_a_running_train_on_the_embedded_target(tmp_path) -> None:
    """The commands a plan prints, run as printed (in the plan's directory layout): prepare regenerates with the
    embedded SmolLM2, train runs from the plan's YAML and finishes with a drafter."""
    env_cwd = tmp_path
    proc = subprocess.run(
        [sys.executable, "-m", "dflashkit", "plan", "--target", "default", "--samples", "3", "--max-new-tokens", "16",
         "--epochs", "1", "--out", "plan", "--json"],
        capture_output=True, text=True, timeout=600, cwd=env_cwd,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    commands = [c["command"] for c in doc["commands"]]
    assert [c.split()[1] for c in commands] == ["prepare", "train", "eval"]
    for cmd in commands[:2]:  # prepare and train; eval is the same command users run after any training
        argv = shlex.split(cmd)
        run = subprocess.run(
            [sys.executable, "-m", "dflashkit", *argv[1:]], capture_output=True, text=True, timeout=800, cwd=env_cwd
        )
        assert run.returncode == 0, (cmd, run.stderr[-2000:])
    assert (env_cwd / "runs" / "smollm2" / "final" / "config.json").is_file()
