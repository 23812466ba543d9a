"""The former name of `raycap.capture.delivery`, kept for one release: the same module object."""

import sys

from raycap.capture import delivery as _module

sys.modules[__name__] = _module
