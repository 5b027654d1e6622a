"""`dflashkit CMD` imports only CMD's module: the map that says which module registers each command is whole and
right, and a command parses the same with one module loaded as with all."""

from __future__ import annotations

import subprocess
import sys

from dflashkit import cli


def test_every_command_is_mapped_to_the_module_that_registers_it() -> None:
    cli._load_commands()
    registered = {name: fn.__module__.rsplit(".", 1)[1] for name, (fn, _, _) in cli._COMMANDS.items()}
    assert registered == cli.MODULE_OF


def test_a_command_starts_without_the_other_commands_modules() -> None:
    code = (
        "import sys\nfrom dflashkit import cli\n"
        "try:\n    cli.main(['train', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m.rsplit('.', 1)[1] for m in sys.modules if m.startswith('dflashkit.commands.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "['train']"
    assert "usage: dflashkit train" in out.stdout
