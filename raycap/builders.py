"""The former name of `raycap.builder`, kept for existing imports.

NeMo Gym names its builder module `builder`, and raycap's lives there. Importing this
module gives `raycap.builder` itself (the same module object), so every name, and every
patch a test applies to one of them, is the builder's own.
"""

import sys

from raycap import builder

sys.modules[__name__] = builder
