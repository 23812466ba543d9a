"""`python -m jobs.demo`: the `raycap demo` job (`raycap.cli.demo`), as `ray job submit` runs it."""

import sys

from raycap.cli.command import ending
from raycap.cli.demo import main

if __name__ == "__main__":
    sys.exit(ending(main()))
