"""`python -m raycap`: the `raycap` command (see `raycap.cli.command`)."""

import sys

from raycap.cli.command import main

sys.exit(main())
