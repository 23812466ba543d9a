"""The former name of `raycap.capture.protocols`, kept for one release: the same module object."""

import sys

from raycap.capture import protocols as _module

sys.modules[__name__] = _module
