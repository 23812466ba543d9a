"""`python -m jobs.clear`: the `raycap clear` job (`raycap.cli.clear`), as `ray job submit` runs it."""

import sys

from raycap.cli.clear import main

if __name__ == "__main__":
    sys.exit(main())
