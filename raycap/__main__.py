"""`python -m raycap`: the `raycap` command (see `raycap.cli`)."""

import sys

from raycap.cli import main

sys.exit(main())
