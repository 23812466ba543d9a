"""`python -m bench`: run the benchmark (see `bench.run` for its parts and options)."""

import sys

from bench.run import main

sys.exit(main())
