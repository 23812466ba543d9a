"""`python -m jobs.sweep --config FILE`: remove retired tombstones older than a retention period.

Retiring a rollout leaves a tombstone (its state file, retired) so that a late writer of
the consumed attempt is still refused. Tombstones are small but accumulate; this job
removes those whose state file is older than `older_than_seconds`, through the
directories' actors. Choose a retention longer than any writer can lag behind: a removed
tombstone can no longer refuse a late write.

Exit status as described in `jobs`.
"""

from __future__ import annotations

import sys
from typing import Sequence

from raycap.cli.jobconfig import ConfigError, SweepJobConfig, load_config
from raycap.cli.jobs import EXIT_OK, fail, job_logging, parse_arguments, start_fleet

PROG = "jobs.sweep"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_arguments(PROG, "Remove retired tombstones older than a retention period.", argv)
    with job_logging(args.verbose):
        return _run(args.config)


def _run(config_path: str) -> int:
    try:
        config = load_config(config_path, SweepJobConfig)
    except ConfigError as exc:
        return fail(PROG, str(exc))
    status = start_fleet(PROG, config, config_path)
    if status is not None:
        return status

    from raycap.runs.directories import sweep

    counts = sweep(config.capture_dirs, config.older_than_seconds)
    for label, count in counts.items():
        print(f"{PROG}: {label}: {count:,} tombstones removed")
    print(f"{PROG}: {sum(counts.values()):,} tombstones older than {config.older_than_seconds:g} s removed", flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
