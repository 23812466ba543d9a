"""`python -m jobs.finalize --config FILE` (or `raycap finalize DIR... --results FILE --output
OUT`): a rollout collection's results file in, one durable dataset out. Flags and a config
combine as for `jobs.rebuild`.

Runs as a plain script (embedded Ray) or under `ray job submit --working-dir . -- python
-m jobs.finalize --config ...`, like `jobs.rebuild`. It validates the config
(`raycap.cli.jobconfig.FinalizeJobConfig`, every key documented in `configs/finalize.yaml`),
then runs `raycap.finalize_rollouts`, which holds the whole policy (reuse, the durable
commit of rows and finalized records, the mask check, `records_file`, retirement, the
test pause hooks), prints the summary (the records by outcome: finalized, masked by
reason, left unchanged, unusable) and exits with the status described in `jobs`: 0
done, 1 part of it failed (a retirement, the output's file system), 2 it could not start
(bad config, a results file that is not one, a missing directory, a refused output), 3
the masked share exceeded max_mask_fraction.

Ray is started (or joined) only when the records are finalized there (`executor`, and
for auto the size of the results and captures: see `raycap.rows.executor.decide`).
"""

from __future__ import annotations

import sys
from typing import Sequence

from raycap.cli.jobconfig import ConfigError, FinalizeJobConfig, load_job_config
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
    runs_embedded,
)
from raycap.output.faults import OutputError, OutputWriteError
from raycap.output.summary import ProgressLine
from raycap.runs.handoff import Outcome
from raycap.runs.rollouts import ResultsError, finalize_rollouts

PROG = "jobs.finalize"


def run(
    config: FinalizeJobConfig, *, config_path: str = "", verbose: bool = False,
    prog: str = PROG,
) -> tuple[Outcome | None, int]:
    """The job on a validated config: (outcome or None, exit status)."""
    if runs_embedded(config.ray) or config.executor == "local":
        missing = config.missing_local_dirs()
        if missing:
            return None, fail(prog, f"capture directory {missing[0]} does not exist; check capture_dirs in {config_path}")
    try:
        outcome = finalize_rollouts(
            config.capture_dirs,
            config.results,
            config.output,
            storage_options=config.storage_options,
            retire=config.retire,
            builder=config.builder,
            record_fields=config.record_fields,
            records_file=config.records_file,
            max_mask_fraction=config.max_mask_fraction,
            mask_fraction_min_samples=config.mask_fraction_min_samples,
            overwrite=config.overwrite,
            executor=config.executor,
            address=config.ray.address,
            batch_size=config.batch_size,
            max_in_flight=config.max_in_flight,
            max_capture_bytes=config.max_capture_bytes,
            verbose=verbose,
            progress=ProgressLine("finalize"),
            log=lambda message: print(f"{prog}: {message}", file=sys.stderr, flush=True),
            # Called only when the records are finalized (or retired) on Ray.
            start=lambda: ensure_fleet(config, config_path, executor="ray"),
        )
    except OutputWriteError as exc:
        return None, fail(prog, str(exc), EXIT_FAILED)
    except (OutputError, CannotStart, ResultsError, ValueError, TypeError, FileNotFoundError) as exc:
        return None, fail(prog, str(exc), EXIT_USAGE)
    except OSError as exc:
        return None, file_system_fault(prog, exc, config.output)
    except RuntimeError as exc:
        # A finalize task failed for good: nothing was committed or retired.
        return None, fail(prog, str(exc), EXIT_FAILED)
    return outcome, outcome_status(prog, outcome)


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """The job from its arguments: `--config FILE`, the flags, or both (flags win). `prog`
    names it in usage and error lines (the `raycap` command passes "raycap finalize")."""
    try:
        args = parse_arguments(prog, "Finalize a rollout collection's results file into one durable dataset.", argv, job="finalize")
    except UsageError as exc:
        return fail(prog, str(exc))
    with job_logging(args.verbose):
        try:
            config = load_job_config(args.config, FinalizeJobConfig, args.overrides, args.flags)
        except ConfigError as exc:
            return fail(prog, str(exc))
        _, status = run(config, config_path=args.dirs_from, verbose=args.verbose, prog=prog)
    return status


if __name__ == "__main__":
    sys.exit(main())
