"""`raycap rebuild DIR... --output OUT` (or `--config FILE`, or `python -m jobs.rebuild` from a
checkout): capture directories in, one durable Parquet dataset out.

The arguments are a config file, flags, or both, the flags winning key by key; either
way they become one config mapping (`raycap.cli.jobconfig.RebuildJobConfig`), validated
once, so a value is refused with the same line whichever way it came. The job runs
`raycap.runs.handoff.rebuild_to_output`, which holds the whole policy (reuse, the
arrived-rollouts refusal, the durable commit, the mask gate, set-aside, retirement),
through the run and main it shares with `finalize` (`raycap.cli.outputjob`).

Ray is started (or joined) only when the rows are built there: `executor` in the config
(see `raycap.cli.jobs.uses_ray`). The summary says which executor built the rows, and why.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

from raycap.cli import outputjob
from raycap.cli.jobconfig import RebuildJobConfig
from raycap.cli.jobs import Console, ensure_fleet
from raycap.runs.handoff import Outcome, rebuild_to_output

PROG = "jobs.rebuild"


def _call(config: RebuildJobConfig, config_path: str, verbose: bool, console: Console) -> Outcome:
    return rebuild_to_output(
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
        allow_empty=config.allow_empty,
        address=config.ray.address,
        progress=outputjob.progress_for(console, "rebuild"),
        log=outputjob.log_to(console),
        start=lambda: ensure_fleet(
            config, config_path, executor=config.executor, rollout_ids=config.rollout_ids,
            refuses_empty=not config.allow_empty,
        ),
    )


JOB = outputjob.OutputJob(
    "rebuild", PROG, "Rebuild capture directories into one durable Parquet dataset.", RebuildJobConfig, _call
)


def run(config: RebuildJobConfig, **options: Any) -> tuple[Outcome | None, int]:
    """The job on a validated config: (outcome or None, exit status); see `outputjob.run`."""
    return outputjob.run(JOB, config, **options)


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """The job from its arguments; see `outputjob.main`."""
    return outputjob.main(JOB, argv, prog)


if __name__ == "__main__":
    sys.exit(main())
