"""`raycap clear DIR... --records FILE` (or `--config FILE`, or `python -m jobs.clear` from a
checkout): delete stale captures before rollouts are dispatched.

Rollout ids are deterministic (SPEC §5: `_ng_rollout_id`, else "{task}-{rollout}", with
"-a{n}" for a retried attempt) and the capture store appends, so a rollout id dispatched
again would merge the new attempt's records with a previous attempt's. This job takes the
JSONL of run records about to be dispatched (`records` in the config), derives each
record's rollout id with `raycap.rollout_id_from_record`, and deletes those rollouts'
captures in every capture directory, through the directories' actors. Records without a
rollout id are skipped. Deleting a rollout that has no capture is a no-op.

Exit status as described in `raycap.cli.jobs`: 2 when the config, the records file or a
record's rollout id is invalid (nothing is deleted then), 1 when some deletions failed.
Under --json the document has `cleared` (rollout ids), `capture_dirs`,
`records_without_id` and `errors`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from raycap.capture.consumer import rollout_id_from_record
from raycap.capture.records import loads_line
from raycap.capture.store import validate_rollout_id
from raycap.cli.jobconfig import ClearJobConfig
from raycap.cli.jobs import EXIT_FAILED, EXIT_OK, Console, directory_job
from raycap.observe.progress import heartbeat

PROG = "jobs.clear"


def rollout_ids_of_records(path: Path) -> tuple[list[str], int]:
    """The distinct rollout ids of a JSONL of run records, in file order, and the number
    of records that carry none. Raises ValueError naming the line of a bad record."""
    ids: dict[str, None] = {}
    without_id = 0
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = loads_line(line)
                if not isinstance(record, dict):
                    raise ValueError("a run record must be a JSON object")
                rollout_id = rollout_id_from_record(record)
                if rollout_id is not None:
                    validate_rollout_id(rollout_id)  # the store's rule too: refused here, not mid-clear
            except ValueError as exc:  # json.JSONDecodeError is a ValueError too
                raise ValueError(f"records file {path} line {number}: {exc}; fix or remove that record") from None
            if rollout_id is None:
                without_id += 1
            else:
                ids[rollout_id] = None
    return list(ids), without_id


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    return directory_job(
        prog, "Delete stale captures of the rollouts about to be dispatched.", argv, job="clear",
        config_type=ClearJobConfig, prepare=lambda config: rollout_ids_of_records(config.records), work=_clear,
        stopped="some captures may be cleared already; rerun to clear the rest",
    )


def _clear(config: ClearJobConfig, prepared: tuple[list[str], int], console: Console) -> int:
    rollout_ids, without_id = prepared
    from raycap.runs.directories import clear

    with heartbeat("clear", f"clearing {len(rollout_ids):,} rollout ids in {len(config.capture_dirs)} capture directories"):
        errors = clear(config.capture_dirs, rollout_ids)
    console.say(
        f"{console.prog}: cleared {len(rollout_ids):,} rollout ids in {len(config.capture_dirs)} capture "
        f"directories ({without_id:,} records carry no rollout id)"
    )
    status = EXIT_OK
    if errors:
        for error in errors[:20]:
            print(f"{console.prog}: {error}", file=sys.stderr)
        status = console.fail(f"{len(errors)} deletions failed; rerun the job once the cause is fixed", EXIT_FAILED)
    return console.finish(
        status, cleared=len(rollout_ids), capture_dirs=config.labels, records_without_id=without_id,
        errors=[str(error) for error in errors],
    )


if __name__ == "__main__":
    sys.exit(main())
