"""The distributed layer (Ray): node actors, builder tasks and the rebuild driver.

- `placement`: which node serves each capture directory; unplaceable ones fail up front.
- `actor`: one actor per node serving its capture directories, a TokenSource per
  directory with batch calls, no state of its own, file work on a thread pool.
- `rebuild`: the driver: batches of rollouts frozen by the actors and built by tasks,
  with bounded work in flight, into Arrow rows; then `retire`, `clear` and `sweep`.

The public entry points are re-exported by the `raycap` package (`raycap.rebuild`,
`raycap.retire`); this package imports Ray, the core modules do not.
"""
