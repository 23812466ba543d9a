"""The former name of `raycap.capture.builder`, kept for one release: the same module object."""

import sys

from raycap.capture import builder as _module

sys.modules[__name__] = _module
