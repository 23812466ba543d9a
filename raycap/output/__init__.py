"""The committed output, local or on an object store: where it lives, its manifest and
committed parts, the one commit protocol and its summary.

Imports: `raycap.observe`, `raycap.capture`, `raycap.rows`.
"""

# Checked by tests/test_layout.py: the raycap packages this one imports at module level,
# and those it may reach only inside a function (a call that needs them).
MAY_IMPORT = ("raycap.capture", "raycap.rows", "raycap.observe")
MAY_CALL_LAZILY = ()
