"""The stream's parts for asynchronous training: readiness, the watch, what was
delivered, each step's commit, and the directories served from this process. The
`Stream` that runs them is `raycap.runs.stream`; the node side is `raycap.cluster`'s.
How a step retires after its commit (claim, mark, write, drop) is `stepcommit`'s;
whether a rollout is ready, or a half-done commit happened, is `readiness`'.

Imports: `raycap.observe`, `raycap.capture`, `raycap.rows`, `raycap.output`, `raycap.finalize` (a submitted
record is finalized as a results file's is).
"""

# Checked by tests/test_layout.py: the raycap packages this one imports at module level,
# and those it may reach only inside a function (a call that needs them).
MAY_IMPORT = ("raycap.capture", "raycap.rows", "raycap.output", "raycap.finalize", "raycap.observe")
MAY_CALL_LAZILY = ()
