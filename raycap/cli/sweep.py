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

from raycap.cli.jobconfig import ConfigError, SweepJobConfig, load_job_config
from raycap.cli.jobs import (
    EXIT_OK,
    Arguments,
    CannotStart,
    Console,
    UsageError,
    ensure_fleet,
    fail,
    interrupted,
    job_logging,
    parse_arguments,
)
from raycap.observe.progress import heartbeat

PROG = "jobs.sweep"


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    try:
        args = parse_arguments(prog, "Remove retired tombstones older than a retention period.", argv, job="sweep")
    except UsageError as exc:
        return fail(prog, str(exc))
    console = args.console(prog)
    with job_logging(args.verbose):
        try:
            return _run(args, console)
        except KeyboardInterrupt:
            return console.finish(interrupted(console, text="some tombstones may be removed already; rerun to finish"))


def _run(args: Arguments, console: Console) -> int:
    try:
        config = load_job_config(args.config, SweepJobConfig, args.overrides, args.flags)
    except ConfigError as exc:
        return console.finish(console.fail(str(exc)))
    try:
        ensure_fleet(config, args.dirs_from)
    except CannotStart as exc:
        return console.finish(console.fail(str(exc)))

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
