"""Captures to Arrow rows, on either executor: the row schema, a batch's build, chains,
and the one decision of where a request runs.

Imports: `raycap.observe`, `raycap.capture`. The local executor hands a batch's rows to the writer its
caller gives (a shard writer of `raycap.output.shards`), so it writes without knowing
the output.
"""

# Checked by tests/test_layout.py: the raycap packages this one imports at module level,
# and those it may reach only inside a function (a call that needs them).
MAY_IMPORT = ("raycap.capture", "raycap.observe")
MAY_CALL_LAZILY = ()
