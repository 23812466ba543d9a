"""The former name of `raycap.capture.records`, kept for one release: the same module object."""

import sys

from raycap.capture import records as _module

sys.modules[__name__] = _module
