"""The distributed layer (Ray): placement, node actors, builder tasks and the rebuild session.

One concern per module, in the order a call meets them:

- `connect`: joining a cluster by address, or starting an embedded Ray.
- `placement`: which node serves each capture directory; unplaceable ones fail up front.
- `actor`: one detached, named actor per node serving its capture directories, batch
  calls, no state; shared by every driver and writer process.
- `fleet`: placement plus the node actors; `RayTokenSource`, a directory's TokenSource.
- `sink`: `RayTokenSink`, a directory's TokenSink, constructible from a run's config.
- `task`: the builder task, the only code of a rebuild that runs in Ray's workers.
- `failures`: Ray errors as the one-line texts of masked rows.
- `scheduler`: batches in, results out in rollout order, bounded in flight, dead nodes.
- `cold`: a session's first call, built here alongside Ray's first builder tasks.
- `retirement`: dropping the snapshots a committed output holds.
- `shared_output`: every building node must see the output's staging directory.
- `rebuild`: the session (placement and actors, never a caller's options) and the
  module API over cached sessions.

The public entry points are re-exported by the `raycap` package (`raycap.Rebuilder`,
`raycap.retire`, `raycap.token_source`, `raycap.RayTokenSink`); this package imports Ray, the core modules do not.
"""
