"""`python -m jobs.rebuild --config FILE`: capture directories in, one durable Parquet file out.

Runs as a plain script (embedded Ray) or under `ray job submit --working-dir . -- python
-m jobs.rebuild --config ...`. In order:

1. Validate the config (`raycap.jobconfig.RebuildJobConfig`).
2. Decide whether the output is reused or written (`raycap.output.check_output`): an
   existing output recording the same inputs is reused, because rollouts it retired can
   no longer be rebuilt; one recording other inputs is refused unless `overwrite: true`.
3. Connect to Ray and start one actor per capture directory.
4. Stream the rebuilt rows into the output durably (temp file, fsync, rename, fsync).
5. Summarise the output and check the masked share against `max_mask_fraction`.
6. Only then, with `retire: true` and a passing check, drop the snapshots of successful
   unmasked rows, read back from the durable file. A failing check retires nothing, so
   the captures are still there for a rerun with a fixed config.
7. Print the summary and write it to `<output>.summary.json`.

A crash anywhere loses nothing: before the rename nothing was retired and a rerun rebuilds
the same rows (freezing is idempotent); after it, a rerun reuses the file and finishes the
retirement (dropping a snapshot twice is harmless).

Exit status as described in `jobs`. For tests, RAYCAP_JOB_PAUSE_AFTER_FIRST_BATCH and
RAYCAP_JOB_PAUSE_BEFORE_RETIRE (seconds) make the driver announce the stage on stderr and
sleep there, so a test can kill it at a known point.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Iterable, Iterator, Sequence

import pyarrow as pa

from jobs import EXIT_FAILED, EXIT_MASKED, EXIT_OK, fail, parse_config_argument, start_fleet
from raycap.arrow import CHAIN_SCHEMA, ROLLOUT_SCHEMA
from raycap.jobconfig import ConfigError, RebuildJobConfig, load_config
from raycap.output import (
    Inputs,
    OutputError,
    check_output,
    iter_retirable,
    output_rollout_ids,
    set_aside,
    summary_path,
    write_durably,
    write_json_durably,
)
from raycap.summary import ProgressLine, RebuildSummary, RetireCounts, Throughput, mask_gate, summarize

PROG = "jobs.rebuild"
PAUSE_ENV_PREFIX = "RAYCAP_JOB_PAUSE_"


def _pause(stage: str) -> None:
    seconds = os.environ.get(PAUSE_ENV_PREFIX + stage)
    if seconds:
        print(f"{PROG}: test hook: pausing {seconds} s at {stage}", file=sys.stderr, flush=True)
        time.sleep(float(seconds))


def _pause_after_first(tables: Iterable[pa.Table]) -> Iterator[pa.Table]:
    for index, table in enumerate(tables):
        yield table
        if index == 0:
            _pause("AFTER_FIRST_BATCH")


def inputs_of(config: RebuildJobConfig) -> Inputs:
    """The inputs an output of this config records (what decides reuse)."""
    ids = None if config.rollout_ids is None else tuple(config.rollout_ids)
    return Inputs(tuple(config.labels), ids, config.builder, config.model, config.delivery)


def _build(config: RebuildJobConfig, inputs: Inputs) -> Throughput:
    from raycap.cluster.rebuild import iter_rebuild

    progress = ProgressLine("rebuild")
    started = time.monotonic()
    tables = iter_rebuild(
        config.capture_dirs,
        config.rollout_ids,
        builder=config.builder,
        model=config.model,
        delivery=config.delivery,
        batch_size=config.batch_size,
        # Listing a directory again after an earlier run retired part of it: the consumed
        # rollouts are not this run's work.
        skip_retired=config.rollout_ids is None,
        max_in_flight=config.max_in_flight,
        progress=progress,
    )
    schema = CHAIN_SCHEMA if config.delivery == "chains" else ROLLOUT_SCHEMA
    written = write_durably(config.output, _pause_after_first(tables), metadata=inputs.metadata(), schema=schema)
    progress.finish()
    seconds = max(time.monotonic() - started, 1e-9)
    return Throughput(round(seconds, 3), round(written.rows / seconds, 2), round(written.arrow_bytes / 1e6 / seconds, 2))


def _retire(config: RebuildJobConfig) -> RetireCounts:
    from raycap.cluster.rebuild import retire

    counts = RetireCounts()
    for table in iter_retirable(config.output):
        report = retire(table, config.capture_dirs)
        counts.dropped += report.dropped
        counts.changed += len(report.changed)
        counts.errors.extend(report.errors)
    return counts


def run(config: RebuildJobConfig, *, config_path: str = "") -> tuple[RebuildSummary | None, int]:
    """The job on a validated config: (summary or None, exit status)."""
    inputs = inputs_of(config)
    try:
        reuse = check_output(config.output, inputs, overwrite=config.overwrite)
    except OutputError as exc:
        return None, fail(PROG, str(exc))
    if not reuse or config.retire or config.rollout_ids is None:
        status = start_fleet(PROG, config, config_path)
        if status is not None:
            return None, status
    if reuse and config.rollout_ids is None:
        # "Every listed rollout" is only the same input while no new rollout has arrived.
        from raycap.cluster.rebuild import list_rollouts

        arrived = sorted(set(list_rollouts(config.capture_dirs, skip_retired=True)) - output_rollout_ids(config.output))
        if arrived and not config.overwrite:
            return None, fail(
                PROG,
                f"{config.output} was built from these directories before {len(arrived)} more rollouts "
                f"arrived (e.g. {arrived[0]}); write them to a new output, or set overwrite: true to rebuild all",
            )
        reuse = not arrived

    throughput = None
    if reuse:
        print(f"{PROG}: {config.output} already holds the rows of these inputs; reusing it", file=sys.stderr)
    else:
        try:
            throughput = _build(config, inputs)
        except OutputError as exc:
            return None, fail(PROG, str(exc))

    summary = summarize(config.output, reused=reuse, throughput=throughput)
    summary.mask_check = mask_gate(summary, config.max_mask_fraction, config.mask_fraction_min_samples)
    rejected = summary.mask_check is not None and not summary.mask_check.passed
    if config.retire and rejected:
        summary.retire_skipped = "the mask check failed; captures are kept for a rerun"
    elif config.retire:
        _pause("BEFORE_RETIRE")
        summary.retired = _retire(config)
    write_json_durably(summary_path(config.output), summary.to_json())
    print(summary.render(), flush=True)

    if rejected:
        # The output path only ever holds rows that passed the check: a consumer watching
        # for it must not train on a rejected batch. The rows stay for inspection.
        kept = set_aside(config.output)
        return summary, fail(
            PROG,
            f"mask check {summary.mask_check.message}; nothing was retired, the rows are kept at {kept}; "
            "fix the captures (or max_mask_fraction) and rerun",
            EXIT_MASKED,
        )
    if summary.retired is not None and summary.retired.errors:
        for error in summary.retired.errors[:10]:
            print(f"{PROG}: retire: {error}", file=sys.stderr)
        return summary, fail(
            PROG,
            f"{len(summary.retired.errors)} snapshots could not be retired; their captures are kept, "
            "rerun the job to finish",
            EXIT_FAILED,
        )
    return summary, EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    config_path = parse_config_argument(PROG, "Rebuild capture directories into one durable Parquet file.", argv)
    try:
        config = load_config(config_path, RebuildJobConfig)
    except ConfigError as exc:
        return fail(PROG, str(exc))
    _, status = run(config, config_path=config_path)
    return status


if __name__ == "__main__":
    sys.exit(main())
