"""`dflashkit quickstart`: prepare → capture → train → export → evaluate on the embedded default, one screen."""

from __future__ import annotations

import argparse
from dataclasses import fields

from dflashkit.cli import command
from dflashkit.validation import field_types, flag, key_value_flag, parse_assignments


def _args(p: argparse.ArgumentParser) -> None:
    from dflashkit.quickstart.run import QuickstartSettings

    defaults = QuickstartSettings()
    types = field_types(QuickstartSettings)
    for f in fields(QuickstartSettings):
        value = getattr(defaults, f.name)
        if f.name == "drafter_extra":  # repeatable KEY=VALUE (DrafterConfig fields)
            p.add_argument(
                "--drafter",
                dest=f.name,
                type=key_value_flag("KEY=VALUE"),
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="another DrafterConfig field for the drafter, e.g. --drafter num_features=3 (repeatable)",
            )
            continue
        if f.name == "train_overrides":  # repeatable KEY=VALUE (TrainConfig fields)
            p.add_argument(
                "--train",
                dest=f.name,
                type=key_value_flag("KEY=VALUE"),
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="another TrainConfig field for the training stage, e.g. --train loss=ce (repeatable)",
            )
            continue
        if isinstance(value, bool):  # --warm-start / --no-warm-start (type=bool would read "False" as True)
            p.add_argument(
                f"--{f.name.replace('_', '-')}",
                action=argparse.BooleanOptionalAction,
                default=value,
                help=f"(default: {value})",
            )
            continue
        p.add_argument(
            f"--{f.name.replace('_', '-')}", type=flag(types[f.name]), default=value, help=f"(default: {value})"
        )


@command("quickstart", "the whole job on the embedded default target: data → features → drafter → evaluation", _args)
def _quickstart(args: argparse.Namespace) -> int:
    from dflashkit.drafter.defaults import parse_overrides
    from dflashkit.quickstart.run import QuickstartSettings, run_quickstart
    from dflashkit.quickstart.screen import summary_screen

    values = {f.name: getattr(args, f.name) for f in fields(QuickstartSettings)}
    values["drafter_extra"] = parse_overrides(values["drafter_extra"])
    values["train_overrides"] = parse_assignments(values["train_overrides"], example="loss=ce")[0]
    settings = QuickstartSettings(**values)
    state = run_quickstart(settings)
    print(summary_screen(state))
    return 0
