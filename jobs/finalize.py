"""`python -m jobs.finalize`: the `raycap finalize` job (`raycap.cli.finalize`), as `ray job submit` runs it."""

import sys

from raycap.cli.command import ending
from raycap.cli.finalize import main

if __name__ == "__main__":
    sys.exit(ending(main()))
