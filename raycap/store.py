"""The former name of `raycap.capture.store`, kept for one release: the same module object."""

import sys

from raycap.capture import store as _module

sys.modules[__name__] = _module
