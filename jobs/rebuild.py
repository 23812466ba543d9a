"""`python -m jobs.rebuild`: the `raycap rebuild` job (`raycap.cli.rebuild`), run from a checkout."""

import sys

from raycap.cli.command import ending, run_entry
from raycap.cli.rebuild import main

if __name__ == "__main__":
    sys.exit(ending(run_entry(main)))
