"""The rebuild session on Ray: a `Session` keeps placement and actors between calls
(`session`); builder tasks are scheduled over them (`scheduler`, a training step cut by
`step_split`), or, on a cold first call, this process builds beside them (`cold`).
`driver_refs` is the driver's one call for a step over many nodes; `shared_output` checks that every node sees a staging
directory.

Imports: `raycap.cluster.plumbing`, `raycap.cluster.nodes`.
"""
