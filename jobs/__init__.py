"""A checkout's entry files: `python -m jobs.NAME` runs the job `raycap NAME` runs.

Each file here is one import: the jobs live in `raycap.cli` (installed with raycap). On a
cluster whose nodes have raycap installed, submit the command itself (`ray job submit
--address ... -- raycap rebuild --config /abs/rebuild.yaml`); these files serve a
checkout shipped as the job's working directory (`ray job submit --working-dir . --
python -m jobs.rebuild ...`). This folder is not installed.
"""
