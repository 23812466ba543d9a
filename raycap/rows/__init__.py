"""Captures to Arrow rows, on either executor: the row schema, a batch's build, chains,
and the one decision of where a request runs.

Imports: `raycap.observe`, `raycap.capture`. The local executor writes a batch's shard through
`raycap.output.shards` (called lazily), as a builder task does.
"""

# Checked by tests/test_layout.py: the raycap packages this one imports at module level,
# and those it may reach only inside a function (a call that needs them).
MAY_IMPORT = ("raycap.capture", "raycap.observe")
MAY_CALL_LAZILY = ("raycap.output", "raycap.cluster")
