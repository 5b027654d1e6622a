"""The `dflashkit` command: parses arguments and calls the library, nothing else.

    dflashkit info [--target PATH|default] [--drafter CKPT]   target, default drafter config, parameter counts, cache
    dflashkit init-drafter OUT [--target …] [key=value …]     write a freshly initialised drafter checkpoint
        [--warm-start [--warm-start-layers 28,29] [--warm-start-fc last|mean|random]]  … from the target's layers

Bad input prints one line and exits 2 (no traceback); a bug prints its traceback and exits 1 (`main`).
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

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


def device_flag(text: str) -> str:
    """argparse `type=` of --device: a device this machine has (dflashkit.target.devices)."""
    from dflashkit.target.devices import device_problem

    why = device_problem(text)
    if why:
        raise argparse.ArgumentTypeError(f"{text!r}: {why}")
    return text


device_flag.expect = "a device this machine has"  # type: ignore[attr-defined]


def target_args(p: argparse.ArgumentParser) -> None:
    """The --target/--device/--trust-remote-code options shared by every command that loads a target."""
    from dflashkit.validation import Text, flag

    p.add_argument(
        "--target",
        type=flag(Text),
        default="default",
        help="model directory, .gguf file, or 'default' (embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--device", type=device_flag, default="cpu", help="device for the target (cpu, cuda, cuda:1, …)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow code from the target's directory")


def compile_arg(p: argparse.ArgumentParser, what: str) -> None:
    """The --compile auto|on|off option of a command whose target layers may run through torch.compile; `what` says
    where (its help's middle)."""
    p.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help=f"run the target's decoder layers through torch.compile {what}: auto (where measured to pay; default), "
        "on, off",
    )


# The module of dflashkit.commands that registers each command (tests/commands/test_cli_modules.py keeps it whole):
# a command imports only its own module, not every command's dependencies (a second or more of its start).
MODULE_OF = {
    "info": "basic", "init-drafter": "basic", "capture": "capture", "convert": "convert", "inspect": "diagnose",
    "diff": "diagnose", "doctor": "diagnose", "logs": "diagnose", "generate": "evaluate", "eval": "evaluate",
    "simulate": "evaluate", "report": "evaluate", "plan": "plan", "prepare": "prepare", "quickstart": "quickstart",
    "serve-check": "serve", "train": "train",
}  # fmt: skip


def _load_commands(name: str | None = None) -> None:
    """Import the module of command `name`, or every module in dflashkit.commands; each registers its subcommands
    with @command."""
    import importlib
    import pkgutil

    import dflashkit.commands as pkg

    mods = [MODULE_OF[name]] if name in MODULE_OF else sorted(m.name for m in pkgutil.iter_modules(pkg.__path__))
    for mod in mods:
        importlib.import_module(f"dflashkit.commands.{mod}")


class _Parser(argparse.ArgumentParser):
    """argparse with the one-line error every other bad input gets: `dflashkit generate: error: --max-new-tokens
    -5: expected an integer from 1 to 2^24 (16,777,216 tokens) (see dflashkit generate --help)`, exit code 2, no usage
    block."""

    def error(self, message: str) -> NoReturn:
        message = re.sub(r"^argument (\S+?)(?:/\S+)?: ", r"\1 ", message)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _state_ranges(p: argparse.ArgumentParser) -> None:
    """End each option's help with what its declared type accepts (`flag(T)`'s words, the ones its error uses), so
    every range is stated in --help, from the one place that checks it."""
    for action in p._actions:
        expect = getattr(action.type, "expect", None)
        if expect and expect not in (action.help or ""):
            stated = expect.replace("%", "%%")
            action.help = f"{action.help}; {stated}" if action.help else stated


def build_parser(name: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or at least of command `name` (only its module imported)."""
    _load_commands(name)
    parser = _Parser(
        prog="dflashkit", description="Train, evaluate, diagnose and export DFlash drafters.", allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands: dict[str, argparse.ArgumentParser] = {}
    for name, (fn, add_args, help_text) in _COMMANDS.items():
        # no abbreviations: `convert SRC --out DIR` must not become `--outtype DIR`, nor a typo another flag
        p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        add_args(p)
        _state_ranges(p)
        p.set_defaults(func=fn)
        commands[name] = p
    parser.command_parsers = commands  # for `_parse`: an unknown flag is named with its command
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
    elif extra:  # named by the command's own parser: `dflashkit eval: error: … (see dflashkit eval --help)`
        own = getattr(parser, "command_parsers", {}).get(getattr(args, "command", None), parser)
        own.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


EXIT_BAD_INPUT, EXIT_BUG, EXIT_INTERRUPTED = 2, 1, 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Bad input — a `DFlashError`, or a known failure class of a dependency (files, safetensors,
    memory, devices, distributed environment: `dflashkit.failures`) — prints one line and returns 2; anything else
    is a bug: its traceback, a request to report it, and 1."""
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        args = _parse(build_parser(argv[0] if argv else None), argv)
    except SystemExit as e:  # argparse: --help (0) or a bad flag (2, its one line printed): a code, not a raise
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    name = f"dflashkit {args.command}"
    try:
        return int(args.func(args) or 0)
    except DFlashError as e:
        print(f"{name}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        from dflashkit.failures import known_failure

        known = known_failure(e)
        if known is not None:
            print(f"{name}: error: {known}", file=sys.stderr)
            return EXIT_BAD_INPUT
        traceback.print_exc()
        print(
            f"{name}: internal error ({type(e).__name__}): this is a bug in dflashkit, not in your input; please "
            f"report it with the traceback above",
            file=sys.stderr,
        )
        return EXIT_BUG


def run() -> None:
    """The `dflashkit` program: `main`, then exit with its code. What is left is freed at exit without a last cyclic
    collection (`gc.freeze`): with torch and transformers loaded that collection alone takes about a second, and
    every object is still released when the process ends. atexit handlers run as usual."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    # Run through the imported module so subcommands register in the same registry as `dflashkit.cli`.
    from dflashkit.cli import run as _run

    _run()
