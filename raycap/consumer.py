"""The former name of `raycap.capture.consumer`, kept for one release: the same module object."""

import sys

from raycap.capture import consumer as _module

sys.modules[__name__] = _module
