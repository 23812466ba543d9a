"""A local output, one backend of the commit protocol: `writes` (the staging directory,
the lock file, the rename that commits, moving aside, the retire marker) and `reads`
(the manifest, shards and records parts, opened without following a link).

`raycap.output.protocol.BACKENDS` registers it for plain paths.
"""
