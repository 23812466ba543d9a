"""`raycap sweep DIR... --older-than-seconds S` (or `--config FILE`, or `python -m jobs.sweep`
from a checkout): remove retired tombstones older than a retention period.

Retiring a rollout leaves a tombstone (its state file, retired) so that a late writer of
the consumed attempt is still refused. Tombstones are small but accumulate; this job
removes those whose state file is older than `older_than_seconds`, through the
directories' actors. Choose a retention longer than any writer can lag behind: a removed
tombstone can no longer refuse a late write.

Exit status as described in `raycap.cli.jobs`. Under --json the document has
`older_than_seconds`, `removed` (tombstones removed by capture directory) and `total`.
"""

from __future__ import annotations

import sys
from typing import Sequence

from raycap.cli.jobconfig import SweepJobConfig
from raycap.cli.jobs import EXIT_OK, Console, directory_job
from raycap.observe.progress import heartbeat

PROG = "jobs.sweep"


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    return directory_job(
        prog, "Remove retired tombstones older than a retention period.", argv, job="sweep",
        config_type=SweepJobConfig, work=_sweep, stopped="some tombstones may be removed already; rerun to finish",
    )


def _sweep(config: SweepJobConfig, _prepared: None, console: Console) -> int:
    from raycap.runs.directories import sweep

    with heartbeat("sweep", f"removing old tombstones in {len(config.capture_dirs)} capture directories"):
        counts = sweep(config.capture_dirs, config.older_than_seconds)
    for label, count in counts.items():
        console.say(f"{console.prog}: {label}: {count:,} tombstones removed")
    total = sum(counts.values())
    console.say(f"{console.prog}: {total:,} tombstones older than {config.older_than_seconds:g} s removed")
    return console.finish(
        EXIT_OK, older_than_seconds=config.older_than_seconds, removed=dict(counts), total=total
    )


if __name__ == "__main__":
    sys.exit(main())
