"""Ray, one concern per folder, lowest first: `plumbing` (connecting, placement, failures,
the builder task), `nodes` (the node actors and what they run on their nodes), `rebuild`
(the rebuild session), `streaming` (a stream over node-served directories, from the
driver's side); then `finalizer` (finalizing a results file on Ray) and `sink` (the
Ray-served TokenSink and TokenSource, named in run configs). The only package that
imports Ray at module level; what decides to use it is `raycap.runs`.

Imports: `raycap.observe`, `raycap.capture`, `raycap.rows`, `raycap.output`, `raycap.finalize`,
`raycap.stream`.
"""

# Checked by tests/test_layout.py: the raycap packages this one imports at module level,
# and those it may reach only inside a function (a call that needs them).
MAY_IMPORT = ("raycap.capture", "raycap.rows", "raycap.output", "raycap.finalize", "raycap.stream", "raycap.observe")
MAY_CALL_LAZILY = ()
