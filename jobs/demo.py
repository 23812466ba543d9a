"""`python -m jobs.demo`: the `raycap demo` job (`raycap.cli.demo`), run from a checkout."""

import sys

from raycap.cli.command import ending, run_entry
from raycap.cli.demo import main

if __name__ == "__main__":
    sys.exit(ending(run_entry(main)))
