"""`python -m jobs.rebuild --config FILE`: capture directories in, one durable Parquet dataset out.

Runs as a plain script (embedded Ray) or under `ray job submit --working-dir . -- python
-m jobs.rebuild --config ...`. It validates the config (`raycap.jobconfig.RebuildJobConfig`),
then runs `raycap.handoff.rebuild_to_output`, which holds the whole policy (reuse, the
arrived-rollouts refusal, the durable commit, the mask gate, set-aside, retirement, and
the test pause hooks), prints the summary and exits with the status described in `jobs`.

Ray is started (or joined) only when the rows are built there: `executor` in the config
(see `jobs.uses_ray`). The summary says which executor built the rows, and why.
"""

from __future__ import annotations

import sys
from typing import Sequence

from jobs import (
    EXIT_FAILED,
    EXIT_USAGE,
    CannotStart,
    ensure_fleet,
    fail,
    file_system_fault,
    job_logging,
    outcome_status,
    parse_arguments,
)
from raycap.handoff import Outcome, rebuild_to_output
from raycap.jobconfig import ConfigError, RebuildJobConfig, load_config
from raycap.outputerrors import OutputError, OutputWriteError
from raycap.summary import ProgressLine

PROG = "jobs.rebuild"


def run(config: RebuildJobConfig, *, config_path: str = "", verbose: bool = False) -> tuple[Outcome | None, int]:
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
            log=lambda message: print(f"{PROG}: {message}", file=sys.stderr, flush=True),
            start=lambda: ensure_fleet(config, config_path, executor=config.executor, rollout_ids=config.rollout_ids),
        )
    except OutputWriteError as exc:
        # The output's file system failed mid-run: nothing was committed or retired,
        # and a rerun once it is fixed builds the rows.
        return None, fail(PROG, str(exc), EXIT_FAILED)
    except (OutputError, CannotStart) as exc:
        return None, fail(PROG, str(exc), EXIT_USAGE)
    except OSError as exc:
        return None, file_system_fault(PROG, exc, config.output)
    return outcome, outcome_status(PROG, outcome)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_arguments(PROG, "Rebuild capture directories into one durable Parquet dataset.", argv)
    with job_logging(args.verbose):
        try:
            config = load_config(args.config, RebuildJobConfig)
        except ConfigError as exc:
            return fail(PROG, str(exc))
        _, status = run(config, config_path=args.config, verbose=args.verbose)
    return status


if __name__ == "__main__":
    sys.exit(main())
