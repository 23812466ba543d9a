"""`raycap finalize DIR... --results FILE --output OUT` (or `--config FILE`, or `python -m
jobs.finalize` from a checkout): a rollout collection's results file in, one durable dataset
out. Flags and a config combine as for `rebuild`, through the run and main the two share
(`raycap.cli.outputjob`).

It validates the config (`raycap.cli.jobconfig.FinalizeJobConfig`, every key documented
in `raycap config finalize`), then runs `raycap.finalize_rollouts`, which holds the whole
policy (reuse, the durable commit of rows and finalized records, the mask check,
`records_file`, retirement), and prints the summary (the records by outcome: finalized,
masked by reason, left unchanged, unusable). A results file that is empty or one JSON
array, not JSONL, is refused before anything is written.

Ray is started (or joined) only when the records are finalized there (`executor`, and
for auto the size of the results and captures: see `raycap.rows.executor.decide`).
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

from raycap.cli import outputjob
from raycap.cli.jobconfig import FinalizeJobConfig
from raycap.cli.jobs import CannotStart, Console, ensure_fleet
from raycap.output.faults import OutputError
from raycap.runs.handoff import Outcome
from raycap.runs.rollouts import ResultsError, finalize_rollouts

PROG = "jobs.finalize"


def _call(config: FinalizeJobConfig, config_path: str, verbose: bool, console: Console) -> Outcome:
    return finalize_rollouts(
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
        worker_stall_s=config.worker_stall_s,
        verbose=verbose,
        progress=outputjob.progress_for(console, "finalize"),
        log=outputjob.log_to(console),
        # Called only when the records are finalized (or retired) on Ray.
        start=lambda: ensure_fleet(config, config_path, executor="ray"),
    )


JOB = outputjob.OutputJob(
    "finalize", PROG, "Finalize a rollout collection's results file into one durable dataset.", FinalizeJobConfig,
    _call,
    refused=(OutputError, CannotStart, ResultsError, ValueError, TypeError, FileNotFoundError),
    failed=(RuntimeError,),
)


def run(config: FinalizeJobConfig, **options: Any) -> tuple[Outcome | None, int]:
    """The job on a validated config: (outcome or None, exit status); see `outputjob.run`."""
    return outputjob.run(JOB, config, **options)


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """The job from its arguments; see `outputjob.main`."""
    return outputjob.main(JOB, argv, prog)


if __name__ == "__main__":
    sys.exit(main())
