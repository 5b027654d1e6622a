"""Subcommand modules: each file registers its subcommands with `dflashkit.cli.command` (one family per file)."""
