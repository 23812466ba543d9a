"""The stream for asynchronous training: readiness, the watch, what was delivered, and
each step's commit.

Imports: `raycap.observe`, `raycap.capture`, `raycap.rows`, `raycap.output`, `raycap.finalize` (a submitted
record is finalized as a results file's is); node actors (`raycap.cluster`) lazily, for
directories given as NODE:/path.
"""

# Checked by tests/test_layout.py: the raycap packages this one imports at module level,
# and those it may reach only inside a function (a call that needs them).
MAY_IMPORT = ("raycap.capture", "raycap.rows", "raycap.output", "raycap.finalize", "raycap.observe")
MAY_CALL_LAZILY = ("raycap.cluster",)
