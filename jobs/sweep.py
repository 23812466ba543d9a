"""`python -m jobs.sweep`: the `raycap sweep` job (`raycap.cli.sweep`), as `ray job submit` runs it."""

import sys

from raycap.cli.command import ending
from raycap.cli.sweep import main

if __name__ == "__main__":
    sys.exit(ending(main()))
