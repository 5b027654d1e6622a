"""Subcommand modules: each file registers its subcommands with `dflashkit.cli.command` (one command family per file)."""
