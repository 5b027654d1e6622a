"""`python -m dflashkit …` is the `dflashkit` command."""

from dflashkit.cli import run

run()
