"""Property: every field of the training, drafter and evaluation configs refuses every value outside its declared
domain — wrong type, NaN/inf, negative, zero, huge, empty, wrong nesting — through the CLI, with exit code 2, one
line, no traceback, and nothing written to the output directory.

The values come from one pool of YAML texts; whether a value is in a field's domain is decided by an oracle
written here by hand for each declared type (not by the types themselves). The suite grows with types and doors,
not fields: each type against its oracle over the whole pool; each door (a training option, a drafter field through
train and init-drafter) with every refused value of each type; and each field with one refused value, so a field
checked late, or with another type than declared, still fails.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from pathlib import Path

import pytest

from dflashkit.cli import main
from dflashkit.drafter.config import DrafterConfig
from dflashkit.train.config import TrainConfig
from dflashkit.validation import (
    AdamBetas,
    BlockSize,
    Bool,
    CompileSetting,
    Fraction,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Probability,
    Seed,
    Temperature,
    Text,
    TokenCount,
    UnitInterval,
    field_types,
    parse_yaml_value,
    problem,
)
from helpers.bad_input import _one_line_error

# the pool: (YAML text as a user types it, what it is)
POOL = [
    ('"5"', "numeric string"),
    ('"nope"', "string"),
    ('""', "empty string"),
    ("5.5", "fraction"),
    ("true", "bool"),
    ("[1]", "list"),
    ("[]", "empty list"),
    ("{a: 1}", "mapping"),
    ("{}", "empty mapping"),
    ("[[0.9], 0.9]", "nested"),
    (".nan", "NaN"),
    (".inf", "inf"),
    ("-.inf", "-inf"),
    ("-1", "negative"),
    ("-0.5", "negative float"),
    ("0", "zero"),
    ("1e30", "huge float"),
    ("10000000000000000000000", "huge int"),
    ("null", "null"),
]


def _int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


ORACLE: dict[object, Callable[[object], bool]] = {  # declared type → does it accept v
    PositiveInt: lambda v: _int(v) and 1 <= v < 2**31,
    NonNegativeInt: lambda v: _int(v) and 0 <= v < 2**31,
    TokenCount: lambda v: _int(v) and 1 <= v <= 2**24,
    Seed: lambda v: _int(v) and 0 <= v < 2**63,
    BlockSize: lambda v: _int(v) and 2 <= v <= 1024,
    PositiveFloat: lambda v: _num(v) and 0 < v <= 1e12,
    NonNegativeFloat: lambda v: _num(v) and 0 <= v <= 1e12,
    Temperature: lambda v: _num(v) and (v == 0 or 1e-4 <= v <= 100),
    Fraction: lambda v: _num(v) and 0 <= v < 1,
    UnitInterval: lambda v: _num(v) and 0 <= v <= 1,
    Probability: lambda v: _num(v) and 0 < v <= 1,
    Bool: lambda v: isinstance(v, bool),
    CompileSetting: lambda v: isinstance(v, bool) or v in ("auto", "on", "off"),
    Text: lambda v: isinstance(v, str) and v.strip() != "",
    AdamBetas: lambda v: isinstance(v, list) and len(v) == 2 and all(_num(x) and 0 <= x < 1 for x in v),
}


def oracle(t: object, name: str = "") -> Callable[[object], bool] | None:
    """The hand-written acceptance rule of a declared field type (None: no rule here; the field is skipped)."""
    if name in BY_NAME:
        return BY_NAME[name]
    if t in ORACLE:
        return ORACLE[t]
    inner = typing.get_args(t)[0] if typing.get_args(t) else None
    members = typing.get_args(inner) if inner is not None else ()
    if typing.get_origin(inner) is typing.Literal:  # choice(...)
        return lambda v: isinstance(v, str) and v in members
    if type(None) in members:  # optional(X, ...): X's rule, or null
        base = next((rule for known, rule in ORACLE.items() for m in members if m == known), None)
        return (lambda v: v is None or base(v)) if base else None
    return None


def _acts() -> set[str]:
    from transformers.activations import ACT2FN

    return set(ACT2FN)


BY_NAME: dict[str, Callable[[object], bool]] = {  # fields whose type is private to their module
    "hidden_act": lambda v: isinstance(v, str) and v in _acts(),
    "rms_norm_eps": lambda v: _num(v) and 0 < v < 1,
    "target_layer_ids": lambda v: (
        isinstance(v, list) and len(v) > 0 and all(_int(x) and 0 <= x < 8 for x in v) and len(set(v)) == len(v)
    ),
    "drafter_device": lambda v: v in ("auto", "cpu"),
    "target_device": lambda v: v in ("auto", "cpu"),
}


def _refused(rule: Callable[[object], bool]) -> list[tuple[str, str]]:
    """The pool's values (YAML text, what it is) that `rule` refuses."""
    return [(text, what) for text, what in POOL if not rule(parse_yaml_value(text, "pool"))]


# Fields set by every case below (so a bad value of another field is the only problem) or not simple values.
TRAIN_SKIP = {"drafter", "features", "tokens", "online", "out", "target"}
# The target couples hidden_size, vocab_size and num_target_layers; dicts are checked as mappings elsewhere.
DRAFTER_SKIP = {"extra", "hidden_size", "vocab_size", "num_target_layers", "layer_types"}
FIELDS = {
    "train": {n: t for n, t in field_types(TrainConfig).items() if n not in TRAIN_SKIP},
    "drafter": {n: t for n, t in field_types(DrafterConfig).items() if n not in DRAFTER_SKIP},
}


def test_the_pool_reaches_every_declared_field():
    """Every field of both configs has an oracle (so the properties cover it) unless it is skipped on purpose."""
    for which, fields in FIELDS.items():
        uncovered = [n for n, t in fields.items() if oracle(t, n) is None]
        assert not uncovered, f"{which}: no oracle for {uncovered}"


# One property per validation type: the type itself accepts exactly what its oracle accepts, over the whole pool.
TYPES = {repr(t): t for fields in FIELDS.values() for n, t in fields.items() if n not in BY_NAME}


@pytest.mark.parametrize("key", sorted(TYPES))
def test_each_type_accepts_exactly_what_its_oracle_accepts(key):
    t = TYPES[key]
    rule = oracle(t)
    for text, what in POOL:
        value = parse_yaml_value(text, "pool")
        assert (problem(t, value) is None) == rule(value), (key, text, what)


def _train(field: str, text: str, out: Path) -> list[str]:
    return ["train", "-", f"out={out}", "features=feats", f"{field}={text}"]


def _assert_refused(capsys, rc: int, out: Path) -> str:
    line = _one_line_error(capsys, rc)
    assert not out.exists(), f"{out} was written"
    return line


# One property per input door and validation type: every value of the pool the type refuses, through one field of
# that type at the door, is one line naming the field, and nothing is written.
def _one_field_per_type(fields: dict[str, object]) -> list[str]:
    seen: dict[str, str] = {}
    for name, t in fields.items():
        seen.setdefault(name if name in BY_NAME else repr(t), name)
    return sorted(seen.values())


DOOR_CASES = [("train", n) for n in _one_field_per_type(FIELDS["train"])]
DOOR_CASES += [("drafter", n) for n in _one_field_per_type(FIELDS["drafter"])]


@pytest.mark.parametrize("which,name", DOOR_CASES, ids=[f"{w}.{n}" for w, n in DOOR_CASES])
def test_every_refused_value_of_a_type_is_one_line_at_each_door(which, name, tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "run"
    field = name if which == "train" else f"drafter.{name}"
    for text, what in _refused(oracle(FIELDS[which][name], name)):
        line = _assert_refused(capsys, main(_train(field, text, out)), out)
        assert f"{field} = " in line and "expected" in line, (what, line)
        if which == "drafter":
            rc = main(["init-drafter", str(out), "--target", str(tiny_llama_dir), f"{name}={text}"])
            assert f"{name} = " in _assert_refused(capsys, rc, out), what


# Every field reaches its type at the door (one refused value each): a field checked late, or not at all, fails.
FIELD_CASES = [(w, n) for w, fields in FIELDS.items() for n in fields]


@pytest.mark.parametrize("which,name", FIELD_CASES, ids=[f"{w}.{n}" for w, n in FIELD_CASES])
def test_every_field_is_checked_at_the_door(which, name, tmp_path, capsys):
    out = tmp_path / "run"
    field = name if which == "train" else f"drafter.{name}"
    text, what = _refused(oracle(FIELDS[which][name], name))[0]
    line = _assert_refused(capsys, main(_train(field, text, out)), out)
    assert f"{field} = " in line, (what, line)


# Evaluation: every typed flag of `eval` (and generate's own), each given values outside its type.
EVAL_FLAGS = {  # flag → declared type
    "--limit": PositiveInt,
    "--max-new-tokens": TokenCount,
    "--temperature": Temperature,
    "--top-p": Probability,
    "--top-k": NonNegativeInt,
    "--block-size": BlockSize,
    "--seed": Seed,
    "--triage-threshold": NonNegativeFloat,
}
FLAG_POOL = ["nan", "inf", "-1", "0", "-0.5", "1.5", "abc", "", " ", "1e30", "1e400", "1e-300", "5e-5", "2000"]
FLAG_POOL += ["99999999999999999999999", "2147483648", "16777217"]


def _flag_value(text: str, t: object):
    try:
        return int(text) if t in (PositiveInt, NonNegativeInt, BlockSize, Seed, TokenCount) else float(text)
    except ValueError:
        return text


EVAL_CASES = [(f, v) for f, t in EVAL_FLAGS.items() for v in FLAG_POOL if not ORACLE[t](_flag_value(v, t))]


@pytest.mark.parametrize("flag,value", EVAL_CASES)
def test_every_bad_evaluation_flag_is_one_line_and_writes_nothing(flag, value, tmp_path, capsys):
    out = tmp_path / "eval"
    rc = main(["eval", "--dataset", "mtbench", "--drafter", "d", "--out", str(out), flag, value])
    line = _assert_refused(capsys, rc, out)
    assert line.startswith(f"dflashkit eval: error: {flag} "), line


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--max-new-tokens", "0"),
        ("--max-new-tokens", "-5"),
        ("--tree-budget", "0"),
        ("--block-size", "1"),
        ("--block-size", "-3"),
        ("--prompt-ids", "1,x"),
        ("--temperature", "nan"),
        ("--top-p", "0"),
    ],
)
def test_generate_refuses_what_it_used_to_replace_or_ignore(flag, value, capsys):
    args = ["generate", "--method", "ar"] + (["--prompt", "hi"] if flag != "--prompt-ids" else [])
    rc = main([*args, flag, value])
    assert _one_line_error(capsys, rc).startswith(f"dflashkit generate: error: {flag} ")


def test_training_yaml_errors_name_the_file_and_line(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"out: {tmp_path / 'run'}\nfeatures: feats\nlr: .nan\n")
    assert "run.yaml:3: lr = nan: expected a finite number > 0" in _one_line_error(capsys, main(["train", str(cfg)]))
    cfg.write_text("features: feats\ndrafter:\n  block_size: 1\n")
    line = _one_line_error(capsys, main(["train", str(cfg)]))
    assert "run.yaml:3: drafter.block_size = 1: expected an integer from 2 to 1024" in line
    cfg.write_text("features: feats\nepochs: 2\nepochs: 3\n")
    assert "run.yaml:3: key 'epochs' is given twice (first at line 2)" in _one_line_error(
        capsys, main(["train", str(cfg)])
    )
    cfg.write_text("features: feats\nmax_steps: '100'\n")
    assert 'max_steps = "100": expected an integer ≥ 1' in _one_line_error(capsys, main(["train", str(cfg)]))
    assert not (tmp_path / "run").exists()
