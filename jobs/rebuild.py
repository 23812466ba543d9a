"""`python -m jobs.rebuild`: the `raycap rebuild` job (`raycap.cli.rebuild`), as `ray job submit` runs it."""

import sys

from raycap.cli.command import ending
from raycap.cli.rebuild import main

if __name__ == "__main__":
    sys.exit(ending(main()))
