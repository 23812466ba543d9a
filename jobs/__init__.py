"""Entry files for `ray job submit`: `python -m jobs.NAME` runs the job `raycap NAME` runs.

Each file here is one import: the jobs live in `raycap.cli` (installed with raycap), so
`ray job submit --working-dir . -- python -m jobs.rebuild --config ...` and the `raycap`
command run the same code. This folder is not installed; it ships with the working
directory a job is submitted from.
"""
