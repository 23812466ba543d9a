"""The former name of `raycap.capture.config`, kept for one release: the same module object."""

import sys

from raycap.capture import config as _module

sys.modules[__name__] = _module
