"""`python -m jobs.rebuild --config FILE` (or `raycap rebuild DIR... --output OUT`): capture
directories in, one durable Parquet dataset out.

The arguments are a config file, flags (`jobs.parse_arguments`), or both, the flags
winning key by key; either way they become one config mapping, validated once, so a
value is refused with the same line whichever way it came.

Runs as a plain script (embedded Ray) or under `ray job submit --working-dir . -- python
-m jobs.rebuild --config ...`. It validates the config (`raycap.cli.jobconfig.RebuildJobConfig`),
then runs `raycap.runs.handoff.rebuild_to_output`, which holds the whole policy (reuse, the
arrived-rollouts refusal, the durable commit, the mask gate, set-aside, retirement, and
the test pause hooks), prints the summary and exits with the status described in `jobs`.

Ray is started (or joined) only when the rows are built there: `executor` in the config
(see `jobs.uses_ray`). The summary says which executor built the rows, and why.
"""

from __future__ import annotations

import sys
from typing import Sequence

from raycap.cli.jobconfig import ConfigError, RebuildJobConfig, load_job_config
from raycap.cli.jobs import (
    EXIT_FAILED,
    EXIT_USAGE,
    CannotStart,
    UsageError,
    ensure_fleet,
    fail,
    file_system_fault,
    job_logging,
    outcome_status,
    parse_arguments,
)
from raycap.output.faults import OutputError, OutputWriteError
from raycap.output.summary import ProgressLine
from raycap.runs.handoff import Outcome, rebuild_to_output

PROG = "jobs.rebuild"


def run(
    config: RebuildJobConfig, *, config_path: str = "", verbose: bool = False,
    prog: str = PROG,
) -> tuple[Outcome | None, int]:
    """The job on a validated config: (outcome or None, exit status). `verbose` logs each
    masked rollout and failed build in detail (see `jobs`)."""
    try:
        outcome = rebuild_to_output(
            config.capture_dirs,
            config.output,
            config.rollout_ids,
            storage_options=config.storage_options,
            builder=config.builder, model=config.model, delivery=config.delivery, batch_size=config.batch_size,
            max_in_flight=config.max_in_flight, executor=config.executor, verbose=verbose,
            max_capture_bytes=config.max_capture_bytes,
            overwrite=config.overwrite,
            retire=config.retire,
            max_mask_fraction=config.max_mask_fraction,
            mask_fraction_min_samples=config.mask_fraction_min_samples,
            address=config.ray.address,
            progress=ProgressLine("rebuild"),
            log=lambda message: print(f"{prog}: {message}", file=sys.stderr, flush=True),
            start=lambda: ensure_fleet(config, config_path, executor=config.executor, rollout_ids=config.rollout_ids),
        )
    except OutputWriteError as exc:
        # The output's file system failed mid-run: nothing was committed or retired,
        # and a rerun once it is fixed builds the rows.
        return None, fail(prog, str(exc), EXIT_FAILED)
    except (OutputError, CannotStart) as exc:
        return None, fail(prog, str(exc), EXIT_USAGE)
    except OSError as exc:
        return None, file_system_fault(prog, exc, config.output)
    return outcome, outcome_status(prog, outcome)


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """The job from its arguments: `--config FILE`, the flags, or both (flags win). `prog`
    names it in usage and error lines (the `raycap` command passes "raycap rebuild")."""
    try:
        args = parse_arguments(prog, "Rebuild capture directories into one durable Parquet dataset.", argv, job="rebuild")
    except UsageError as exc:
        return fail(prog, str(exc))
    with job_logging(args.verbose):
        try:
            config = load_job_config(args.config, RebuildJobConfig, args.overrides, args.flags)
        except ConfigError as exc:
            return fail(prog, str(exc))
        _, status = run(config, config_path=args.dirs_from, verbose=args.verbose, prog=prog)
    return status


if __name__ == "__main__":
    sys.exit(main())
