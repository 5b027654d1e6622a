"""The `dflashkit` command: parses arguments and calls the library, nothing else.

    dflashkit info [--target PATH|default] [--drafter CKPT]   target, default drafter config, parameter counts, cache
    dflashkit init-drafter OUT [--target …] [key=value …]     write a freshly initialised drafter checkpoint
        [--warm-start [--warm-start-layers 28,29] [--warm-start-fc last|mean|random]]  … from the target's layers

User errors (`DFlashError`) print one line and exit 2; no traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from dflashkit.errors import DFlashError

Command = Callable[[argparse.Namespace], int]
_COMMANDS: dict[str, tuple[Command, Callable[[argparse.ArgumentParser], None], str]] = {}


def command(
    name: str, help_text: str, add_args: Callable[[argparse.ArgumentParser], None]
) -> Callable[[Command], Command]:
    """Register a subcommand (its arguments and its entry point)."""

    def wrap(fn: Command) -> Command:
        _COMMANDS[name] = (fn, add_args, help_text)
        return fn

    return wrap


def target_args(p: argparse.ArgumentParser) -> None:
    """The --target/--device/--trust-remote-code options shared by every command that loads a target."""
    p.add_argument(
        "--target", default="default", help="model directory, .gguf file, or 'default' (embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument("--device", default="cpu", help="device for the target (cpu, cuda, cuda:1, …)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow code from the target's directory")


def _load_commands() -> None:
    """Import every module in dflashkit.commands; each registers its subcommands with @command."""
    import importlib
    import pkgutil

    import dflashkit.commands as pkg

    for mod in sorted(m.name for m in pkgutil.iter_modules(pkg.__path__)):
        importlib.import_module(f"dflashkit.commands.{mod}")


def build_parser() -> argparse.ArgumentParser:
    _load_commands()
    parser = argparse.ArgumentParser(
        prog="dflashkit", description="Train, evaluate, diagnose and export DFlash drafters."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (fn, add_args, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(func=fn)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """parse_args, except that `key=value` overrides may also follow options (`init-drafter OUT --target T k=v`):
    argparse matches consecutive positionals only once, so overrides after an option would be rejected."""
    args, extra = parser.parse_known_args(argv)
    if (
        extra
        and isinstance(getattr(args, "overrides", None), list)
        and all("=" in x and not x.startswith("-") for x in extra)
    ):
        args.overrides.extend(extra)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(build_parser(), argv)
    try:
        return int(args.func(args) or 0)
    except DFlashError as e:
        print(f"dflashkit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dflashkit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # Run through the imported module so subcommands register in the same registry as `dflashkit.cli`.
    from dflashkit.cli import main as _main

    sys.exit(_main())
