"""Ray: placement, node actors, builder tasks, the rebuild session, a stream's node
side, finalizing on Ray, and the Ray-served sink and source. The only package that
imports Ray at module level; what decides to use it is `raycap.runs`.

Imports: `raycap.capture`, `raycap.rows`, `raycap.output`, `raycap.finalize`,
`raycap.stream`.
"""

# Checked by tests/test_layout.py: the raycap packages this one imports at module level,
# and those it may reach only inside a function (a call that needs them).
MAY_IMPORT = ("raycap.capture", "raycap.rows", "raycap.output", "raycap.finalize", "raycap.stream")
MAY_CALL_LAZILY = ()
