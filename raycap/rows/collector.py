"""The cyclic garbage collector paused over work that makes many objects and needs none
of them collected at once.

A batch's parsed records and builds are acyclic but hold millions of list slots, and a
module load makes tens of thousands of objects; every pass of the collector meanwhile
walks all of them and everything else the process holds (a Ray driver holds about
100,000 objects, a trainer often more). What the work frees is freed by reference
counts; the collector resumes, as it was, when the work ends.

This module imports nothing of raycap, so the package's front door can use it.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (see the module docstring)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
