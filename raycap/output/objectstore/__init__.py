"""An output on an object store, one backend of the commit protocol: `writes` (staging
attempts, the conditional write that commits, the roll-forward, moving aside), `reads`
(the manifest, shards and records parts, checked in place) and `client` (the file
system, the S3 client and the conditional PUT).

`raycap.output.protocol.BACKENDS` registers it for the schemes it commits to.
"""
