"""`python -m jobs.clear`: the `raycap clear` job (`raycap.cli.clear`), run from a checkout."""

import sys

from raycap.cli.clear import main
from raycap.cli.command import ending, run_entry

if __name__ == "__main__":
    sys.exit(ending(run_entry(main)))
