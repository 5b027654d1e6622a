"""Values that entered without a door, each now refused where it enters in one line naming it (or, where it is
valid, read as the backbone reads it): numbers past what the arithmetic holds, temperatures that overflow the logits,
contexts past the target's positions, ports outside 1–65535, empty values, options given without the option they
apply with, MoE configs with more experts per token than experts, speculators configs without heads, and the
printed commands (quoted for the shell)."""

from __future__ import annotations

import json
import shlex
import subprocess
from types import SimpleNamespace

import pytest

from dflashkit.cli import main
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads import KINDS, kind_fields
from dflashkit.errors import ConfigError, DataError, TargetError
from helpers.bad_input import _one_line_error
from helpers.checkpoints import small_config, speculators_checkpoint


# ---------------------------------------------------------------------------------------------- numbers
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["plan", "--samples", "1e400"], '--samples "1e400": expected an integer from 1 to 10^9'),
        (["plan", "--seq-len", "1000000000"], "--seq-len 1000000000: expected an integer from 1 to 2^24"),
        (["plan", "--avg-tokens", "1e300"], '--avg-tokens "1e300": expected an integer from 1 to 2^24'),
        (["plan", "--gen-tokens-per-s", "1e-300"], "--gen-tokens-per-s 1e-300: expected a number of tokens/s from"),
        (["plan", "--gpu-mem", "1e400"], "--gpu-mem inf: expected a number of GiB from 1 to 100000"),
        (["plan", "--epochs", "100000000000000000"], "--epochs 100000000000000000: expected an integer from 1 to"),
        (["plan", "--gpus", "99999999xH100"], '--gpus "99999999xH100": expected N×NAME with N from 1 to 65536'),
        (["eval", "--temperatures", "0,1e-300"], "--temperatures"),
        (["eval", "--temperature", "1e-300"], "--temperature 1e-300: expected 0 (greedy) or a number from 0.0001"),
        (["generate", "--temperature", "5e-05"], "use 0 for greedy"),
        (["eval", "--methods", "ar,ddtree:99999999999"], "the budget expected an integer from 1 to 4096"),
        (["doctor", "--context", "1000000000000"], "--context 1000000000000: expected an integer from 1 to 2^24"),
        (["prepare", "--server", "http://127.0.0.1:99999"], "port 99999: expected a port from 1 to 65535"),
        (["prepare", "--server", "http://127.0.0.1:0"], "port 0: expected a port from 1 to 65535"),
        (["prepare", "--server", "127.0.0.1:8080"], "expected an http:// or https:// URL"),
        (["prepare", "--server-timeouts", "1e300,1,1"], "expected three positive numbers of seconds (each 0.001"),
        (["prepare", "--time-budget-minutes", "1e300"], "expected a number of minutes > 0 and ≤ 1e6"),
    ],
)
def test_numbers_past_their_range_are_one_line_at_parsing(argv, expected, capsys):
    line = _one_line_error(capsys, main(argv))
    assert line.startswith(f"dflashkit {argv[0]}: error: {argv[1]} ") and expected in line, line


def test_a_tiny_temperature_is_refused_with_the_greedy_hint(capsys):
    line = _one_line_error(capsys, main(["eval", "--dataset", "mtbench", "--out", "o", "--temperatures", "0,1e-300"]))
    assert "1e-300 is not valid: expected 0 (greedy) or a number from 0.0001 to 100" in line
    assert "use 0 for greedy" in line


def test_doctor_compares_the_context_with_the_targets_positions(tiny_llama_dir, tmp_path, capsys):
    argv = ["doctor", "--target", str(tiny_llama_dir), "--drafter", str(tmp_path / "none"), "--context", "100000"]
    line = _one_line_error(capsys, main(argv))
    assert "--context 100000: expected at most the target's 512 positions (its max_position_embeddings)" in line


# ---------------------------------------------------------------------------------------------- nothing, or ignored
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["plan", "--gpus", ""], '--gpus "": expected N×NAME'),
        (["plan", "--name", " "], '--name " ": expected a non-empty string'),
        (["prepare", "--data", "sharegpt", "--out", "o", "--concurrency", "4"], "--concurrency applies to --server"),
        (["prepare", "--data", "sharegpt", "--out", "o", "--server-timeouts", "1,2,3"], "no --server given"),
        (
            ["prepare", "--data", "sharegpt", "--out", "o", "--server", "http://h:1", "--batch-size", "4"],
            "--batch-size applies to generation in process",
        ),
        (["prepare", "--data", "sharegpt", "--out", "o", "--top-p", "0.9"], "--top-p 0.9 applies when sampling"),
        (["generate", "--method", "ar", "--prompt", "hi", "--top-k", "5"], "--top-k 5 applies when sampling"),
        (
            ["generate", "--drafter", "d", "--prompt", "hi", "--tree-budget", "8"],
            "--tree-budget applies to --method tree; --method is chain",
        ),
        (
            ["eval", "--dataset", "mtbench", "--out", "o", "--methods", "ar,chain", "--tree-top-k", "4"],
            "--tree-top-k applies to ddtree methods",
        ),
        (["eval", "--dataset", "mtbench", "--out", "o", "--top-p", "0.5"], "expected a temperature > 0 with it"),
        (
            ["simulate", "--dataset", "mtbench", "--cache", "c", "--out", "o", "--budgets", "", "--no-chain"],
            "--no-chain with empty --budgets: nothing to simulate",
        ),
        (["convert", "a", "b", "--outtype", "q8_0"], "--outtype q8_0 applies to --to gguf; --to is zlab"),
        (["plan", "--calibrate", "--gpus", "8xH100"], "--calibrate measures this CPU"),
    ],
)
def test_empty_values_and_options_without_their_partner_are_refused(argv, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = _one_line_error(capsys, main(argv))
    assert expected in line, line
    assert not (tmp_path / "o").exists()


def test_a_tree_budget_with_the_tree_method_still_runs_its_checks(capsys):
    """The partner given: the refusal is about something else (here the missing drafter), not the pair."""
    line = _one_line_error(capsys, main(["generate", "--prompt", "hi", "--method", "tree", "--tree-budget", "8"]))
    assert "needs --drafter" in line


# ---------------------------------------------------------------------------------------------- config doors
def _moe(tmp_path, **change):
    from tests.helpers.published_configs import QWEN3_30B_A3B

    path = tmp_path / "moe"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, **change}))
    return path


def test_a_moe_config_with_more_experts_per_token_than_experts_is_refused(tmp_path, capsys):
    target = _moe(tmp_path, num_experts_per_tok=200)
    line = _one_line_error(capsys, main(["plan", "--target", str(target), "--out", str(tmp_path / "p")]))
    assert f"{target}/config.json: num_experts_per_tok = 200: expected at most num_experts (128)" in line
    assert not (tmp_path / "p").exists()


def test_the_experts_rule_reads_every_family_naming():
    from dflashkit.target.shape import experts_problem

    assert "n_routed_experts (64)" in experts_problem({"n_routed_experts": 64, "num_experts_per_tok": 65})
    assert "num_local_experts (8)" in experts_problem({"num_local_experts": 8, "experts_per_token": 9}, "")
    assert experts_problem({"num_experts": 8, "num_experts_per_tok": 8}) is None
    assert experts_problem({"num_experts_per_tok": 8}) is None  # a dense config of a MoE family
    prefixed = experts_problem({"num_experts": 4, "num_experts_per_tok": 5}, "text_config.")
    assert prefixed.startswith("text_config.num_experts_per_tok = 5: expected at most text_config.num_experts (4)")


def test_the_target_shape_reader_refuses_it_too(tmp_path):
    from dflashkit.target.shape import read_target_shape

    with pytest.raises(TargetError, match="num_experts_per_tok = 129: expected at most num_experts"):
        read_target_shape(_moe(tmp_path, num_experts_per_tok=129))


@pytest.mark.parametrize("heads", [0, -2])
def test_a_speculators_config_without_heads_or_head_dim_is_one_line(heads, tmp_path, capsys):
    path = tmp_path / "spec"
    speculators_checkpoint(path)
    raw = json.loads((path / "config.json").read_text())
    raw["transformer_layer_config"]["num_attention_heads"] = heads
    raw["transformer_layer_config"].pop("head_dim")
    (path / "config.json").write_text(json.dumps(raw))
    line = _one_line_error(capsys, main(["convert", str(path), str(tmp_path / "out")]))
    assert f"(transformer_layer_config): field 'num_attention_heads' = {heads}: expected an integer ≥ 1" in line


def test_a_speculators_top_level_field_goes_through_its_type(tmp_path, capsys):
    path = tmp_path / "spec"
    speculators_checkpoint(path)
    raw = json.loads((path / "config.json").read_text())
    raw["block_size"] = 10**6
    (path / "config.json").write_text(json.dumps(raw))
    line = _one_line_error(capsys, main(["convert", str(path), str(tmp_path / "out")]))
    assert "field 'block_size' = 1000000: expected an integer from 2 to 1024" in line


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "dflash"])
def test_head_fields_stored_as_integral_floats_read_as_backbone_fields_do(kind):
    cfg = small_config(kind=kind)
    names = [n for n, owner in kind_fields().items() if owner == kind and type(cfg.head_fields()[n]) is int]
    assert names, f"{kind}: no integer head field to check"
    raw = cfg.to_zlab_dict()
    for where in (raw, raw["dflash_config"]):
        for name in [*names, "hidden_size", "num_attention_heads"]:
            if type(where.get(name)) is int:
                where[name] = float(where[name])  # 16 → 16.0, as some JSON writers store it
    assert DrafterConfig.from_zlab_dict(raw, source="c.json") == cfg
    bad = cfg.to_zlab_dict()
    where = bad["dflash_config"] if names[0] in bad["dflash_config"] else bad
    where[names[0]] = 16.5  # not integral: still refused, naming the field
    with pytest.raises(ConfigError, match=f"{names[0]}' must be an integer"):
        DrafterConfig.from_zlab_dict(bad, source="c.json")


def test_a_memory_refusal_names_the_field_that_costs_the_most(tiny_llama_dir, tmp_path, capsys):
    argv = ["init-drafter", str(tmp_path / "d"), "--target", str(tiny_llama_dir), "kind=xpress"]
    line = _one_line_error(capsys, main([*argv, "xpress_rank=100000000"]))
    assert "xpress_rank = 100000000: this drafter" in line and "xpress_rank is the size that costs the most" in line
    assert "GB for its weights" in line and not (tmp_path / "d").exists()


# ---------------------------------------------------------------------------------------------- long-context
def test_no_length_fits_says_the_cap_is_the_positions_minus_the_new_tokens():
    from dflashkit.evaluate.stats import prompts_for, read_prompts

    target = SimpleNamespace(
        text_config=SimpleNamespace(max_position_embeddings=512), tokenizer=SimpleNamespace(chat_template="x")
    )
    with pytest.raises(DataError) as e:
        prompts_for(target, read_prompts("long-context"), max_new_tokens=500)
    assert "no length ≥ 64 tokens fits" in str(e.value)
    assert "the cap is 12 tokens = the target's 512 positions minus the 500 new tokens (--max-new-tokens)" in str(
        e.value
    )


# ---------------------------------------------------------------------------------------------- printed commands
def _plan_commands(name: str, target: str, data: str | None = None) -> list[str]:
    from dflashkit.diagnose.plan import Hardware, PlanRequest
    from dflashkit.diagnose.plan_files import plan_commands

    request = PlanRequest(
        target=target, hardware=Hardware(count=2, gpu="H100", gpu_mem_gib=80), name=name, out=f"{name}/plan",
        max_new_tokens=2048, data=data, from_drafter=f"{name}/base drafter",
    )  # fmt: skip
    plan = SimpleNamespace(
        request=request,
        name=name,
        drafter=small_config(),
        sections={
            "data": {"samples": {"value": 10}, "conversations": {"value": data or "conversations.jsonl (yours)"}},
            "memory": {"_choice": ("offline, DDP", False, "ddp")},
        },
    )
    return [cmd for _, cmd in plan_commands(plan)]


@pytest.mark.parametrize(
    "name", ["my run", "it's", 'a "quoted" $HOME run', "semi;colon & `tick`", "-dash", "tab\there"]
)
def test_every_printed_plan_command_pastes_back_into_the_same_arguments(name, tmp_path):
    commands = _plan_commands(name, str(tmp_path / "models" / "Qwen 3 (8B)"), data=str(tmp_path / "my data.jsonl"))
    for cmd in commands:
        assert subprocess.run(["sh", "-n", "-c", cmd], capture_output=True).returncode == 0, cmd
        argv = shlex.split(cmd)
        assert "\n" not in cmd
        if "--out" in argv:
            out = argv[argv.index("--out") + 1]
            assert out.split("/")[1].startswith(name), (cmd, out)
        if "--target" in argv:
            assert argv[argv.index("--target") + 1] == str(tmp_path / "models" / "Qwen 3 (8B)")
        if "--data" in argv:
            assert argv[argv.index("--data") + 1] == str(tmp_path / "my data.jsonl")
    (train,) = [shlex.split(c) for c in commands if " train " in c]
    assert train[-1] == f"{name}/plan/train.yaml"
    (base,) = [shlex.split(c) for c in commands if "base=" in c]
    assert base[base.index("--drafter") + 1] == f"base={name}/base drafter"


def test_plan_prints_a_run_name_with_a_space_quoted(tmp_path, capsys):
    rc = main(["plan", "--name", "my run", "--samples", "3", "--out", str(tmp_path / "p")])
    assert rc == 0
    printed = [line.strip() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("dflashkit ")]
    prepare = next(shlex.split(line) for line in printed if " prepare " in line)
    assert prepare[prepare.index("--out") + 1] == "data/my run"
    assert "--out 'data/my run'" in next(line for line in printed if " prepare " in line)


def test_commands_in_messages_are_quoted(tmp_path):
    from dflashkit.shell import shell_line

    assert shell_line("dflashkit", "convert", tmp_path / "a b", "OUT") == f"dflashkit convert '{tmp_path}/a b' OUT"
    assert shlex.split(shell_line("x", "it's", "$HOME", "")) == ["x", "it's", "$HOME", ""]
