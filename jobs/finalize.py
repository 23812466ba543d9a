"""`python -m jobs.finalize`: the `raycap finalize` job (`raycap.cli.finalize`), run from a checkout."""

import sys

from raycap.cli.command import ending, run_entry
from raycap.cli.finalize import main

if __name__ == "__main__":
    sys.exit(ending(run_entry(main)))
