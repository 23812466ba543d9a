"""`python -m jobs.sweep`: the `raycap sweep` job (`raycap.cli.sweep`), run from a checkout."""

import sys

from raycap.cli.command import ending, run_entry
from raycap.cli.sweep import main

if __name__ == "__main__":
    sys.exit(ending(run_entry(main)))
