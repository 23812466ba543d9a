"""Retirement's drops: the snapshots a committed output allows, dropped from the directories.

What may be dropped, and the output's checks and marker, are the output's
(`raycap.output.retiring`); this module drops them, from this process through the
directories' stores or through the fleet's directory actors, a few shards at a time.
A snapshot that changed since its build is kept and reported, never dropped. Dropping
is idempotent, so retiring the same output again after a failure finishes the job;
`RetireReport` says what happened.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from raycap.capture.consumer import error_text
from raycap.capture.directory import CaptureDir
from raycap.capture.outcomes import DropOutcome
from raycap.capture.store import TokenCaptureStore
from raycap.output.retiring import Listed, PerDir, RetireReport, RetiringOutput, retiring
from raycap.rows.executor import ray_running

if TYPE_CHECKING:
    from raycap.cluster.nodes.actor import DirectoryHandle
    from raycap.cluster.nodes.fleet import Fleet
    from raycap.output.commit import OutputLock
    from raycap.output.manifest import Manifest

__all__ = ["Listed", "OnShard", "RetireReport", "retire_output"]

logger = logging.getLogger(__name__)


def _local_path(path: str) -> str:
    """`raycap.cluster.plumbing.placement.local_path`; a process without Ray (a retirement here,
    where this module is imported without Ray) opens every path as it is."""
    if not ray_running():
        return path
    from raycap.cluster.plumbing.placement import local_path

    return local_path(path)


def _tally(report: RetireReport, label: str, items: list[tuple[str, str, int]], outcomes: Sequence[DropOutcome]) -> None:
    for (rid, _, _), outcome in zip(items, outcomes):
        if outcome.dropped:
            report.dropped += 1
        elif outcome.changed:
            report.changed.append(rid)
            logger.warning("rollout %s in %s changed since it was built; its capture is kept", rid, label)
        else:
            report.errors.append(f"{rid}: {outcome.error}")


# Drops made at once from this process: each waits on its fsyncs (the tombstone, the
# directory twice), and a directory actor overlaps them the same way.
DROP_THREADS = 8


def _drop_one(store: TokenCaptureStore, item: tuple[str, str, int]) -> DropOutcome:
    rid, sid, version = item
    try:
        return DropOutcome.of(store.drop_now(rid, snapshot_id=sid, version=version))
    except Exception as exc:  # noqa: BLE001 - reported per rollout
        return DropOutcome.failed(error_text(exc))


@contextmanager
def _dropping() -> Iterator[ThreadPoolExecutor]:
    """The threads of one retirement's drops from this process. Interrupted, the drops
    not yet started are cancelled (dropping is idempotent: retiring again finishes)."""
    pool = ThreadPoolExecutor(DROP_THREADS, thread_name_prefix="raycap-drop")
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _drop_locally(
    per_dir: PerDir, stores: dict[str, TokenCaptureStore], pool: ThreadPoolExecutor
) -> Callable[[], RetireReport]:
    """Each snapshot dropped as `drop_now` drops it, a few at once on `pool`'s threads
    (each drop holds its own rollout's lock alone, so none waits on another's while
    holding one): submitted now, and the report once they have ended."""
    report = RetireReport()
    submitted = []
    for label, items in per_dir.items():
        store = stores.get(label)
        if store is None:
            report.errors.extend(f"{rid}: capture directory {label} is not among {sorted(stores)}" for rid, _, _ in items)
            continue
        submitted.append((label, items, [pool.submit(_drop_one, store, item) for item in items]))

    def ended() -> RetireReport:
        for label, items, futures in submitted:
            _tally(report, label, items, [future.result() for future in futures])
        return report

    return ended


def _submit_drops(
    per_dir: PerDir, handles: dict[str, DirectoryHandle]
) -> tuple[RetireReport, dict[str, Any]]:
    """Ask each directory's actor to drop its snapshots; the refs of its outcomes, and
    the errors of snapshots whose directory has no actor."""
    report, refs = RetireReport(), {}
    for label, items in per_dir.items():
        if label not in handles:
            report.errors.extend(f"{rid}: capture directory {label} is not among {sorted(handles)}" for rid, _, _ in items)
            continue
        refs[label] = handles[label].drop_batch(items)
    return report, refs


def _collect_drops(report: RetireReport, per_dir: PerDir, refs: dict[str, Any]) -> RetireReport:
    import ray

    from raycap.cluster.plumbing.failures import cause_text

    for label, ref in refs.items():
        try:
            outcomes = ray.get(ref)
        except ray.exceptions.RayError as exc:
            # Nothing of this directory is known to be dropped; dropping is idempotent,
            # so retiring the same output again later finishes the job.
            reason = cause_text(exc)
            report.errors.extend(f"{rid}: capture directory {label}: {reason}" for rid, _, _ in per_dir[label])
            continue
        _tally(report, label, per_dir[label], outcomes)
    return report


OnShard = Callable[[Any, RetireReport], None]


def retire_here(retired: RetiringOutput, dirs: Sequence[CaptureDir], on_shard: OnShard | None) -> RetireReport:
    """Retire the output's shards from this process, through the directories' stores."""
    stores = {d.label: TokenCaptureStore(d.path, create=False) for d in dirs}
    report = RetireReport()
    with _dropping() as pool:
        for shard in retired.shards:
            report.merge(_drop_locally(retired.by_dir(shard, _local_path), stores, pool)())
            if on_shard:
                on_shard(shard, report)
    return report


def retire_on_ray(retired: RetiringOutput, fleet: Fleet, on_shard: OnShard | None) -> RetireReport:
    """Retire the output's shards through the fleet's actors. This process reads each
    shard's retirable rows (a few small columns of a shard `verify` has just read whole),
    a few shards ahead on threads, and the actors drop them, a few shards' drops in
    flight: no task, so retiring starts no worker process (a task that takes no CPU gets
    a new one for each task running at once)."""
    with ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="raycap-retire") as pool:
        steps = _ahead((str(shard), pool.submit(retired.by_dir, shard, _local_path).result) for shard in retired.shards)
        return _drop_in_flight(steps, fleet.by_label(), on_shard, what="shard ")


# Shards read ahead, and shards' drops in flight at once.
IN_FLIGHT = 4


def _ahead(steps: Iterator[tuple[str, Callable[[], Any]]]) -> Iterator[tuple[str, Callable[[], Any]]]:
    """The steps in order, each made (its read submitted) IN_FLIGHT steps before it is handed out."""
    pending: deque = deque()
    for step in steps:
        pending.append(step)
        if len(pending) > IN_FLIGHT:
            yield pending.popleft()
    yield from pending


def _drop_in_flight(
    steps: Iterator[tuple[str, Callable[[], PerDir]]],
    handles: dict[str, DirectoryHandle],
    on_shard: OnShard | None,
    *,
    what: str,
) -> RetireReport:
    """Drop each step's snapshots (`get()` gives them by directory) through the actors,
    IN_FLIGHT steps at once; `on_shard(name, report so far)` runs, in order, after each
    step's drops have finished. A step that cannot be read drops nothing and says so."""
    from raycap.cluster.plumbing.failures import cause_text

    report = RetireReport()
    in_flight: deque = deque()

    def finish_one() -> None:
        name, per_dir, refs, step = in_flight.popleft()
        report.merge(_collect_drops(step, per_dir, refs))
        if on_shard:
            on_shard(name, report)

    for name, get in steps:
        try:
            per_dir = get()
        except Exception as exc:  # noqa: BLE001 - retiring again later finishes the job
            failed = RetireReport(errors=[f"{what}{name}: {cause_text(exc)}; nothing of it is known to be dropped, rerun to finish"])
            in_flight.append((name, {}, {}, failed))
        else:
            step, refs = _submit_drops(per_dir, handles)
            in_flight.append((name, per_dir, refs, step))
        if len(in_flight) >= IN_FLIGHT:
            finish_one()
    while in_flight:
        finish_one()
    return report


# --- an output of finalized records: every snapshot listed once ----------------------------------


def drop_listed_here(listed: Listed, dirs: Sequence[CaptureDir], on_shard: OnShard | None) -> RetireReport:
    """Drop listed snapshots from this process, through the directories' stores."""
    stores = {d.label: TokenCaptureStore(d.path, create=False) for d in dirs}
    report = RetireReport()
    with _dropping() as pool:
        # The drops of a few steps submitted ahead (`_ahead`), each step reported in
        # order once its own have ended.
        for name, ended in _ahead((name, _drop_locally(per_dir, stores, pool)) for name, per_dir in listed):
            report.merge(ended())
            if on_shard:
                on_shard(name, report)
    return report


def drop_listed_on_ray(listed: Listed, fleet: Fleet, on_shard: OnShard | None) -> RetireReport:
    """Drop listed snapshots through the fleet's actors, a few steps in flight (no task)."""
    return _drop_in_flight(((name, lambda per_dir=per_dir: per_dir) for name, per_dir in listed), fleet.by_label(), on_shard, what="")


def retire_output(
    output: Any,
    dirs: Sequence[CaptureDir],
    *,
    here: Callable[[], bool],
    fleet: Callable[[], Fleet] | None,
    on_shard: OnShard | None = None,
    manifest: Manifest | None = None,
    lock: OutputLock | None = None,
) -> RetireReport:
    """The body of `raycap.runs.directories.retire_dirs` (see there): from this process
    when `here()` says so, else through `fleet()`'s actors. Imported without Ray, so a
    retirement here never loads it."""
    with retiring(output, manifest=manifest, lock=lock) as retired:
        local = here()
        if retired.records:
            # Finalized records: each snapshot once, the redundant captures included.
            listed = retired.listed(_local_path)
            report = drop_listed_here(listed, dirs, on_shard) if local else drop_listed_on_ray(listed, fleet(), on_shard)
        elif local:
            report = retire_here(retired, dirs, on_shard)
        else:
            report = retire_on_ray(retired, fleet(), on_shard)
        retired.ended(report)
    return report
