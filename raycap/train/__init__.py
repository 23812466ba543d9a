"""The trainer's side: committed rows as Ray Datasets and fixed-shape token batches,
trainer conventions and rewards. A new trainer's batch dict is a function in `trainers`;
token batches are `tokenbatch` and `feed`'s, data-parallel feeding `parallel`'s.

Imports: `raycap.observe`, `raycap.capture`, `raycap.rows`, `raycap.output`; Ray's connection
(`raycap.cluster`) lazily.
"""

# Checked by tests/test_layout.py: the raycap packages this one imports at module level,
# and those it may reach only inside a function (a call that needs them).
MAY_IMPORT = ("raycap.capture", "raycap.rows", "raycap.output", "raycap.observe")
MAY_CALL_LAZILY = ("raycap.cluster",)
