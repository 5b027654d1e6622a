"""`python -m dflashkit …` is the `dflashkit` command."""

import sys

from dflashkit.cli import main

sys.exit(main())
