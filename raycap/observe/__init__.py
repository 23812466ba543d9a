"""What a run shows while it runs and after: progress lines, stage timings, metrics.

- `raycap.observe.progress`: the progress line of a job (redrawn on a terminal; plain,
  periodic lines in a job log or a pipe) and the job console's rules.
- `raycap.observe.timing`: seconds per stage, measured where the work runs and summed.
- `raycap.observe.metrics`: the same figures as `raycap_*` series through Ray's metrics
  API, recorded only in a process where Ray runs; objects made once per process.
- `raycap.observe.figures`: a stream's figures as a flat dict, for a trainer's logger.
- `grafana.json`: a Grafana dashboard of the series (see docs/outputs.md).

A low package: every other package may import it. It imports no raycap package and does
not import Ray at module level.
"""

# Checked by tests/test_layout.py: the raycap packages this one imports at module level,
# and those it may reach only inside a function (a call that needs them).
MAY_IMPORT = ()
MAY_CALL_LAZILY = ()
