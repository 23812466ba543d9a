"""Results files: a rollout collection's records in, rows and finalized records out:
the scan, a batch's finalize, the local worker pool and the records file.

Imports: `raycap.observe`, `raycap.capture`, `raycap.rows`, `raycap.output`. What runs a finalize (here or
on Ray) is `raycap.runs.rollouts`'.
"""

# Checked by tests/test_layout.py: the raycap packages this one imports at module level,
# and those it may reach only inside a function (a call that needs them).
MAY_IMPORT = ("raycap.capture", "raycap.rows", "raycap.output", "raycap.observe")
MAY_CALL_LAZILY = ()
