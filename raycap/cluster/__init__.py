"""Ray: placement, node actors, builder tasks, the rebuild session, and the Ray-served
sink and source. The only package that imports Ray at module level.

Imports: `raycap.observe`, `raycap.capture`, `raycap.rows`, `raycap.output`, `raycap.finalize`,
`raycap.stream`.
"""

# Checked by tests/test_layout.py: the raycap packages this one imports at module level,
# and those it may reach only inside a function (a call that needs them).
MAY_IMPORT = ("raycap.capture", "raycap.rows", "raycap.output", "raycap.finalize", "raycap.stream", "raycap.observe")
MAY_CALL_LAZILY = ()
