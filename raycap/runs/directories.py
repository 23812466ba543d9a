"""Work on the capture directories themselves: retire what a committed output holds,
list, clear and sweep.

`retire_dirs` is the one retirement path: `raycap.retire`, a rebuild's and a finalize's
retirement and `Rebuilder.retire` all take it. It runs in this process when the
dispatch says so (`raycap.runs.dispatch`), and then never loads Ray; else through the
directories' Ray session, which decides once the output is checked. What retirement
does is `raycap.runs.retirement`'s. Clearing and sweeping run on Ray, through the
directories' node actors.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Iterable

from raycap.capture.directory import CaptureDir
from raycap.output.commit import OutputLock
from raycap.output.manifest import Manifest
from raycap.rows.executor import Request
from raycap.rows.options import RebuildOptions
from raycap.runs.dispatch import Local, executor_for, here_or_on_ray, parsed_dirs, ray_session
from raycap.runs.retirement import OnShard, RetireReport, retire_output


def retire_on(
    runner: Any,
    output: Any,
    dirs: tuple[CaptureDir, ...],
    *,
    executor: str = "auto",
    on_shard: OnShard | None = None,
    manifest: Manifest | None = None,
    lock: OutputLock | None = None,
) -> RetireReport:
    """Retire `output` through `runner` (`Local`, or a Ray session: see `retire_dirs`)."""
    if isinstance(runner, Local):
        here, fleet = (lambda: True), None
    else:
        here, fleet = (lambda: runner.decide(None, RebuildOptions(executor=executor), "retire").executor == "local"), runner.fleet
    return retire_output(output, dirs, here=here, fleet=fleet, on_shard=on_shard, manifest=manifest, lock=lock)


def retire_dirs(
    dirs: tuple[CaptureDir, ...],
    output: Any,
    *,
    address: str | None = None,
    on_shard: OnShard | None = None,
    executor: str = "auto",
    manifest: Manifest | None = None,
    lock: OutputLock | None = None,
) -> RetireReport:
    """Drop the exact snapshots of the committed output's successful, unmasked rows,
    shard by shard (in parallel on Ray). `on_shard(shard, report so far)` runs after
    each shard's drops have finished. An output of finalized records
    (`raycap.finalize_rollouts`) also drops its redundant captures (records with
    their own token ids), as its manifest lists them, and each snapshot once: exactly
    what Gym's `capture_build_can_retire` allows of the records' builds.

    Only a committed output can be retired from, at the place its commit put it
    (`raycap.output.manifest.committed_manifest`): a staging directory, a `.rejected` or
    superseded copy, or a copied dataset raises OutputError and nothing is dropped;
    so does one missing a part its commit wrote, or holding one of another size or
    sha256 (`raycap.output.protocol.verify`). Holding the output's lock, it writes the
    `.retire.json` marker durably before the first drop, as the rebuild job does, so no
    later policy step deletes these rows, and records there how it ended. `manifest` is
    the output's manifest when the caller read it already; it is checked all the same.
    `lock` is the output's lock when the caller holds it (the lock is not re-entrant).

    `output` is a path, a URI or a `raycap.output.location.Location`. On an object store the
    commit's roll-forward is finished first (`raycap.output.backend.Backend.finish`): nothing
    is retired before every committed shard is in place."""
    runner = here_or_on_ray(Request(dirs, None, RebuildOptions(executor=executor), "retire", address))
    return retire_on(runner, output, dirs, executor=executor, on_shard=on_shard, manifest=manifest, lock=lock)


def retire(
    capture_dirs: Iterable[Any] | str | os.PathLike,
    output: str | os.PathLike | Iterable[Any],
    *,
    address: str | None = None,
    on_shard: OnShard | None = None,
    executor: str = "auto",
) -> RetireReport:
    """Drop the exact snapshots of a committed output's successful, unmasked rows (see
    `retire_dirs`).

    The directories come first, as everywhere in raycap. The older order (output,
    capture_dirs) is deprecated: it still works, with a DeprecationWarning."""
    if isinstance(capture_dirs, (str, os.PathLike)) and not isinstance(output, (str, os.PathLike)):
        warnings.warn(
            "raycap.retire(output, capture_dirs) is deprecated: call raycap.retire(capture_dirs, output), "
            "directories first as in every raycap call",
            DeprecationWarning,
            stacklevel=2,
        )
        capture_dirs, output = output, capture_dirs
    return retire_dirs(parsed_dirs(capture_dirs), output, address=address, on_shard=on_shard, executor=executor)


def list_rollouts(
    capture_dirs: Iterable[Any], *, skip_retired: bool = False, address: str | None = None, executor: str = "auto"
) -> list[str]:
    """The sorted rollout ids with capture files in any of the directories."""
    dirs = parsed_dirs(capture_dirs)
    options = RebuildOptions(skip_retired=skip_retired, executor=executor)
    runner, _ = executor_for(Request(dirs, None, options, "list", address))
    return runner.list_rollouts(skip_retired=skip_retired, executor=executor)


def clear(capture_dirs: Iterable[Any], rollout_ids: Iterable[str], *, address: str | None = None) -> list[str]:
    """Delete the captures of these rollouts in every directory (on Ray); returns error texts."""
    return ray_session(parsed_dirs(capture_dirs), address).clear(rollout_ids)


def sweep(capture_dirs: Iterable[Any], older_than_seconds: float, *, address: str | None = None) -> dict[str, int]:
    """Remove retired tombstones older than the cutoff (on Ray); count per directory."""
    return ray_session(parsed_dirs(capture_dirs), address).sweep(older_than_seconds)
