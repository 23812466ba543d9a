"""A stream over directories that node actors serve, from the driver's side:
`driver_dirs` is the stream's directories there (`NodeDirectories`), `driver_hub` the actor on the
driver's node that talks to the node actors (whose side is `raycap.cluster.nodes.node_stream`).

Imports: `raycap.cluster.plumbing`, `raycap.cluster.nodes`.
"""
