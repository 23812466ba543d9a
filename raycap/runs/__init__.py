"""What runs a call: the one executor dispatch (this process or Ray, decided once) and
the policies of a rebuild into an output, a finalize, a retirement, a clear or sweep of
capture directories, and a stream.

Owns: `dispatch` (which executor a request gets), `handoff` (`rebuild_to_output`),
`rollouts` (`finalize_rollouts`), `retirement` (dropping what a committed output allows,
here or through Ray's actors; what it allows is `raycap.output.retiring`'s),
`directories` (`retire`, `list_rollouts`, `clear`, `sweep`), `rebuilder` (`Rebuilder`),
`stream` (`Stream`; its step's commit and retirement are `raycap.stream.stepcommit`'s)
and `streamdirs` (where a stream's directories are served).
Imports: every package below it. `rebuilder` is a Ray session itself; every other module
reaches Ray (`raycap.cluster`) only inside a function, once the dispatch has chosen it,
so a call that runs in this process never loads Ray.
"""

# Checked by tests/test_layout.py: the raycap packages this one imports at module level,
# and those it may reach only inside a function (a call that needs them).
MAY_IMPORT = ("raycap.capture", "raycap.rows", "raycap.output", "raycap.finalize", "raycap.stream", "raycap.cluster", "raycap.observe")
MAY_CALL_LAZILY = ()
