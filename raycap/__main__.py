"""`python -m raycap`: the `raycap` command (see `raycap.cli.command`)."""

import sys

from raycap.cli.command import console

sys.exit(console())
