"""The validated boundary itself: declared types refuse what they should (strictly: no numeric strings, no bools as
numbers, no NaN), messages name the source, field, value and expectation; YAML files keep line numbers, refuse
duplicated keys and read 2e-3 as a number; command-line flags use the same types and messages."""

from __future__ import annotations

import argparse
import math

import pytest

from dflashkit.errors import ConfigError
from dflashkit.validation import (
    AdamBetas,
    BlockSize,
    Fraction,
    Minutes,
    NonNegativeFloat,
    NonNegativeInt,
    Port,
    PositiveFloat,
    PositiveInt,
    Probability,
    ServerUrl,
    Temperature,
    Text,
    TokenCount,
    TreeBudget,
    choice,
    flag,
    float_list,
    int_list,
    json_problem,
    key_value_flag,
    load_yaml,
    optional,
    parse_yaml_value,
    problem,
    show,
    text_flag,
)


@pytest.mark.parametrize(
    "t,good,bad",
    [
        (PositiveInt, [1, 7, 2**31 - 1], [0, -1, 2**31, 10**22, "5", 5.0, True, None, [1], math.nan]),
        (NonNegativeInt, [0, 3, 2**31 - 1], [-1, 2**31, "0", False, 0.5]),
        (BlockSize, [2, 16, 1024], [1, 0, -4, 1025, "16", 16.0]),
        (PositiveFloat, [1e-6, 3, 2.5, 1e12], [0, -1e-9, 1e13, 1e300, math.nan, math.inf, -math.inf, "1e-3", True]),
        (NonNegativeFloat, [0, 1e-300, 1e12], [-1e-300, 1e300, math.inf]),
        (TokenCount, [1, 4096, 2**24], [0, 2**24 + 1, 10**9, 1.0]),
        (TreeBudget, [1, 8, 4096], [0, 4097, 10**12]),
        (Temperature, [0, 0.0, 1e-4, 0.7, 1, 100], [1e-300, 5e-5, -1, 101, 1e300, math.nan, math.inf]),
        (Minutes, [1e-6, 30, 1e6], [0, -1, 1e7, math.inf]),
        (Port, [1, 8080, 65535], [0, -1, 65536, 99999, "80"]),
        (Text, ["a", " a ", "-1"], ["", " ", "\t\n", 3, None]),
        (
            ServerUrl,
            ["http://127.0.0.1:8080", "https://h", "http://h:1/v1"],
            [
                "",
                "127.0.0.1:80",
                "ftp://h:1",
                "http://",
                "http://h:0",
                "http://h:65536",
                "http://127.0.0.1:99999",
                "http://h:x",
            ],
        ),
        (Fraction, [0, 0.5, 0.999], [1, 1.5, -0.1, math.nan]),
        (Probability, [1, 0.3], [0, 1.01, math.nan]),
        (AdamBetas, [[0.9, 0.95], [0, 0.5]], [[2.0, 0.9], [0.9], [0.9, 0.9, 0.9], 0.9, ["a", 0.9], [[0.9], 0.9]]),
        (choice("ce", "kl"), ["ce", "kl"], ["CE", "mse", 1, None]),
        (optional(PositiveInt, "off"), [None, 3], [0, "3", math.nan]),
    ],
)
def test_types_accept_their_domain_and_nothing_else(t, good, bad):
    for v in good:
        assert problem(t, v) is None, (v, problem(t, v))
    for v in bad:
        assert problem(t, v), v


def test_messages_say_what_was_expected():
    assert problem(PositiveInt, -5) == "expected an integer ≥ 1 and < 2^31"
    assert problem(PositiveFloat, math.nan) == "expected a finite number > 0 and ≤ 1e12"
    assert problem(choice("ce", "kl"), "x") == "expected one of 'ce', 'kl'"
    assert problem(optional(PositiveInt, "all captured"), 0) == (
        "expected an integer ≥ 1 and < 2^31, or null (all captured)"
    )
    assert "use 0 for greedy" in problem(Temperature, 1e-300)
    assert problem(ServerUrl, "http://127.0.0.1:99999").startswith("port 99999: expected a port from 1 to 65535")
    assert show(math.nan) == "nan" and show("5") == '"5"' and show([2.0, 0.9]) == "[2.0, 0.9]"


def test_yaml_keeps_lines_refuses_duplicates_and_reads_exponents(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 2e-3\nnoise_std: 1.0e-2\ndrafter:\n  block_size: 8\n  num_hidden_layers: 2\nseed: .nan\n")
    data, lines = load_yaml(path)
    assert data["lr"] == 0.002 and isinstance(data["lr"], float) and data["noise_std"] == 0.01
    assert lines[("lr",)] == 1 and lines[("drafter", "num_hidden_layers")] == 5 and lines[("seed",)] == 6
    assert math.isnan(data["seed"])
    path.write_text("lr: 1.0\nepochs: 2\nlr: 3.0\n")
    with pytest.raises(ConfigError, match=r"c.yaml:3: key 'lr' is given twice \(first at line 1\)"):
        load_yaml(path)
    path.write_text("drafter:\n  block_size: 8\n  block_size: 4\n")
    with pytest.raises(ConfigError, match=r"c.yaml:3: key 'drafter.block_size' is given twice"):
        load_yaml(path)
    path.write_bytes(b"lr: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"c.yaml: not valid UTF-8 \(byte offset 4\)"):
        load_yaml(path)
    path.write_text("lr: [1, 2\n")
    with pytest.raises(ConfigError, match=r"c.yaml:\d+: not valid YAML"):
        load_yaml(path)
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping of options"):
        load_yaml(path)
    with pytest.raises(ConfigError, match="file not found"):
        load_yaml(tmp_path / "missing.yaml")
    assert parse_yaml_value("5e-1", "x") == 0.5 and parse_yaml_value('"5"', "x") == "5"


def test_flags_parse_and_check_with_the_same_types():
    parse = flag(PositiveInt)
    assert parse("12") == 12
    for text, why in (
        ("0", "0: expected an integer ≥ 1"),
        ("-5", "-5: expected an integer ≥ 1"),
        ("abc", '"abc": expected an integer ≥ 1'),
        ("1.5", '"1.5": expected an integer ≥ 1'),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            parse(text)
    with pytest.raises(argparse.ArgumentTypeError, match="nan: expected a finite number > 0"):
        flag(PositiveFloat)("nan")
    ids = int_list(NonNegativeInt, what="comma-separated layer ids")
    assert ids("1, 8,14") == [1, 8, 14]
    with pytest.raises(argparse.ArgumentTypeError, match="expected comma-separated layer ids"):
        ids("1,x")
    with pytest.raises(argparse.ArgumentTypeError, match="-2 is not valid: expected an integer ≥ 0"):
        ids("1,-2")
    with pytest.raises(argparse.ArgumentTypeError, match="at least one"):
        ids(",")


def test_json_problem_names_the_first_wrong_field_by_its_path():
    from pydantic import BaseModel, ConfigDict

    class Inner(BaseModel):
        model_config = ConfigDict(extra="ignore")
        n: int
        xs: list[float] | None = None

    class Doc(BaseModel):
        model_config = ConfigDict(extra="ignore")
        runs: dict[str, Inner]
        note: str | None = None

    assert json_problem(Doc, {"runs": {"a": {"n": 1, "xs": [0.5, 2]}}, "other": [1]}) is None  # ints are numbers
    assert json_problem(Doc, {"runs": {"a": {"n": "1"}}}) == 'runs.a.n = "1": expected an integer'  # strict
    assert json_problem(Doc, {"runs": {"a": {"n": True}}}) == "runs.a.n = true: expected an integer"
    assert json_problem(Doc, {"runs": {"a": {"n": 1, "xs": [0.5, "z"]}}}) == 'runs.a.xs[1] = "z": expected a number'
    assert json_problem(Doc, {"runs": {"a": {}}}) == "runs.a.n: missing (a required field)"
    assert json_problem(Doc, {}) == "runs: missing (a required field)"
    assert json_problem(Doc, [1]) == "the document = [1]: expected an object"


def test_flags_state_what_they_accept_and_refuse_blank_values():
    assert flag(TokenCount).expect == "an integer from 1 to 2^24 (16,777,216 tokens)"
    temperatures = float_list(Temperature, what="comma-separated temperatures")
    assert temperatures("0,0.7") == [0.0, 0.7] and "each 0 (greedy)" in temperatures.expect
    with pytest.raises(argparse.ArgumentTypeError, match=r"1e-300 is not valid: .* use 0 for greedy"):
        temperatures("0,1e-300")
    with pytest.raises(argparse.ArgumentTypeError, match=r'" ": expected a non-empty string \(not only spaces\)'):
        flag(Text)(" ")
    for blank in ("", "  "):
        with pytest.raises(argparse.ArgumentTypeError, match="expected non-empty UTF-8 text"):
            text_flag(blank)
    pairs = key_value_flag("KEY=VALUE")
    assert pairs("loss=ce") == "loss=ce" and pairs("init_from=") == "init_from="
    for bad in ("", "loss", "=ce", " =ce"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected KEY=VALUE"):
            pairs(bad)
    named = key_value_flag("NAME=CKPT", key_optional=True)
    assert named("runs/a") == "runs/a" and named("a=runs/a") == "a=runs/a"
    with pytest.raises(argparse.ArgumentTypeError):
        named(" ")
