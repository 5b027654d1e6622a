"""Property: every command-line value enters through a declared type that refuses what means nothing or what the
arithmetic behind it cannot hold — at parsing, in one line naming the option, exit 2, no traceback, in
milliseconds (nothing is loaded).

The doors are found in the parsers themselves (every option and positional of every command that takes a value),
so a new flag is covered the day it is added. Each door is fed one pool of extreme values. Whether a door may accept
0, 1e-300 or an empty value is decided here from its help text (the range it states), not from its type: a door
that accepts a value its help does not admit, or refuses one its help admits, fails.
"""

from __future__ import annotations

import argparse
import re

import pytest

from dflashkit.cli import build_parser, main
from helpers.bad_input import _one_line_error

POOL = ["0", "-1", "1e-300", "1e300", "1e400", "nan", "inf", "", " "]
NEVER = {"-1", "1e300", "1e400", "nan", "inf"}  # no number door takes these (below every floor, above every ceiling)
NUMERIC_PROBES = ("1", "2", "8", "0.5", "1,1,1", "8,8,8")


def _doors() -> list[tuple[str, argparse.Action]]:
    parser = build_parser()
    out = []
    for command, sub in parser.command_parsers.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or action.nargs == 0 or action.dest == "overrides":
                continue  # flags without a value; `key=value` overrides go through the config's own types
            out.append((command, action))
    return out


DOORS = _doors()


def _name(action: argparse.Action) -> str:
    return action.option_strings[0] if action.option_strings else action.dest


def _argv(command: str, action: argparse.Action, value: str) -> list[str]:
    if action.option_strings:
        return [command, _name(action), value]
    before = []  # a positional after others: valid ones first
    for other in build_parser().command_parsers[command]._actions:
        if other.dest == action.dest:
            break
        if not other.option_strings:
            before.append("x")
    return [command, *before, value]


def _converts(action: argparse.Action, text: str) -> tuple[bool, object]:
    if action.choices is not None:
        return text in action.choices, text
    try:
        return True, action.type(text)
    except (argparse.ArgumentTypeError, TypeError, ValueError):
        return False, None


def _numeric(action: argparse.Action) -> bool:
    """A number door: it turns some number-like probe into something other than text."""
    return action.choices is None and any(
        ok and not isinstance(value, str) for ok, value in (_converts(action, p) for p in NUMERIC_PROBES)
    )


def _admits(action: argparse.Action, value: str) -> bool | None:
    """Whether the door's stated range admits `value` (the oracle: what its help says — the words its type declares
    are the end of its help — not what the type does); None: text whose form the pool does not probe."""
    stated = getattr(action.type, "expect", None) or ""
    if value.strip() == "":
        return "empty:" in (action.help or "")  # an empty value with a stated meaning ("empty: chain only")
    if action.choices is not None:
        return False  # no choice is a number
    if not _numeric(action):
        return None  # a path, a name, a URL, a device: any form of its own
    if value in NEVER:
        return False
    if value == "0":  # "from 0 to", "≥ 0", "0 (greedy)", "each 0 (…)"
        return re.search(r"(from 0 |≥ 0\b|\b0 \()", stated) is not None
    # 1e-300: only a real number whose floor is 0 itself (a temperature, a rate or GiB have a floor above it)
    return re.search(r"\bnumbers? (?:of [\w/]+ )?(?:> 0\b|≥ 0\b|from 0 )", stated) is not None


def test_every_door_declares_its_type_and_states_its_range():
    for command, action in DOORS:
        assert action.type is not None or action.choices is not None, f"{command} {_name(action)}: no declared type"
        expect = getattr(action.type, "expect", None)
        if action.choices is None:
            assert expect, f"{command} {_name(action)}: its type says nothing of what it accepts"
            assert expect in (action.help or ""), f"{command} {_name(action)}: help does not state {expect!r}"
    assert len(DOORS) > 120


@pytest.mark.parametrize("command,action", DOORS, ids=[f"{c} {_name(a)}" for c, a in DOORS])
def test_every_door_refuses_what_its_range_does_not_admit(command, action, capsys):
    for value in POOL:
        ok, _ = _converts(action, value)
        admits = _admits(action, value)
        if admits is None:
            continue
        if admits:
            assert ok, f"{command} {_name(action)} refuses {value!r}, which its help admits: {action.help!r}"
            continue
        assert not ok, f"{command} {_name(action)} accepts {value!r}, which its help does not admit: {action.help!r}"
        line = _one_line_error(capsys, main(_argv(command, action, value)))
        assert line.startswith(f"dflashkit {command}: error: {_name(action)} "), line
