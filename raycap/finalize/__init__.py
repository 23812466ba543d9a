"""Results files: a rollout collection's records in, rows and finalized records out.

Imports: `raycap.observe`, `raycap.capture`, `raycap.rows`, `raycap.output`; Ray (`raycap.cluster`) lazily,
when the ray executor runs.
"""

# Checked by tests/test_layout.py: the raycap packages this one imports at module level,
# and those it may reach only inside a function (a call that needs them).
MAY_IMPORT = ("raycap.capture", "raycap.rows", "raycap.output", "raycap.observe")
MAY_CALL_LAZILY = ("raycap.cluster",)
