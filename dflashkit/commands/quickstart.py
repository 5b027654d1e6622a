"""`dflashkit quickstart`: prepare → capture → train → export → evaluate on the embedded default, one screen."""

from __future__ import annotations

import argparse
from dataclasses import fields

from dflashkit.cli import command


def _args(p: argparse.ArgumentParser) -> None:
    from dflashkit.quickstart import QuickstartSettings

    defaults = QuickstartSettings()
    for f in fields(QuickstartSettings):
        value = getattr(defaults, f.name)
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(value), default=value,
                       help=f"(default: {value})")


@command("quickstart", "the whole job on the embedded default target: data → features → drafter → evaluation", _args)
def _quickstart(args: argparse.Namespace) -> int:
    from dflashkit.quickstart import QuickstartSettings, run_quickstart, summary_screen

    settings = QuickstartSettings(**{f.name: getattr(args, f.name) for f in fields(QuickstartSettings)})
    state = run_quickstart(settings)
    print(summary_screen(state))
    return 0
