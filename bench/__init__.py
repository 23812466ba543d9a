"""raycap's benchmark: how fast rows come back, against the JSON parse floor and a
straightforward consumer. Not part of the library and not installed with it.

- `run`    the benchmark's parts, their ratios and targets (`python -m bench`)
- `proc`   runs in fresh processes and against a `ray start` head of its own
- `step`   a training step's rebuild against a directory with history
- `stream` streaming for asynchronous training: freeze -> take latency and rows/s, fresh
           and with retired history (`python -m bench.stream`)
- `finalize` a results file finalized at once (`raycap.finalize_rollouts`) against Gym's
           one-at-a-time loop, and the finalizing driver's peak memory
           (`python -m bench.finalize`; `make bench` runs all three)

The benchmark sits beside the code it measures rather than in `jobs/`, which holds only
the entry points a user runs.
"""
