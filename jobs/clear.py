"""`python -m jobs.clear`: the `raycap clear` job (`raycap.cli.clear`), as `ray job submit` runs it."""

import sys

from raycap.cli.clear import main
from raycap.cli.command import ending

if __name__ == "__main__":
    sys.exit(ending(main()))
