"""The command line: `raycap` and its subcommands, job configs, the jobs themselves,
synthetic corpora and `inspect`.

A new subcommand is a module here with `main(argv, prog)` and one line in
`command._COMMANDS`. The dataset jobs' run and main are written once (`outputjob`), the
exit statuses once (`jobs.EXIT_STATUSES`), the config keys in `jobconfig`.

Imports: every other package and the public API (`raycap`); nothing imports it.
"""

# Checked by tests/test_layout.py: the raycap packages this one imports at module level,
# and those it may reach only inside a function (a call that needs them).
MAY_IMPORT = ("raycap", "raycap.capture", "raycap.rows", "raycap.output", "raycap.finalize", "raycap.stream", "raycap.train", "raycap.cluster", "raycap.runs", "raycap.api", "raycap.observe")
MAY_CALL_LAZILY = ()
