"""The former name of `raycap.capture.sink`, kept for one release: the same module object."""

import sys

from raycap.capture import sink as _module

sys.modules[__name__] = _module
