"""Retirement: drop the exact snapshots of a committed output's successful, unmasked rows.

Only committed rows can be retired from: dropping first could lose a capture whose
trajectory was never written. An output of finalized records (`raycap.finalize_rollouts`)
also lists, in its manifest, the redundant captures of records that carry their own
token ids; its snapshots are gathered first (`listed_snapshots`) so that each is
dropped once, however many records named its rollout. The shards come from the output's manifest, whose names
are checked to be inside the output (`raycap.output.manifest`), and are opened without
following a link: retirement never reads another output's rows. A shard's retirable rows (`raycap.rows.arrow.retirable`) name
their directory by label, their snapshot id and version; a snapshot that changed since
its build is kept and reported, never dropped. Dropping is idempotent, so retiring the
same output again after a failure finishes the job; `RetireReport` says what happened.
Before its marker and any drop, every part the commit wrote (shards and records parts)
is checked to be there with its size and sha256 (`raycap.output.protocol.verify`): nothing is dropped
from an output that lost or changed a part, whose rows may be the only copy.
"""

from __future__ import annotations

import logging
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from raycap.capture.consumer import error_text
from raycap.capture.directory import CaptureDir
from raycap.capture.outcomes import DropOutcome
from raycap.capture.store import TokenCaptureStore
from raycap.output.location import Location, as_location, check_writable
from raycap.output.manifest import mark_retiring
from raycap.output.protocol import backend_of, checked_lock, verify
from raycap.output.recordparts import RECORDS_DIR
from raycap.rows.arrow import RETIRE_COLUMNS, retirable
from raycap.rows.executor import ray_running

if TYPE_CHECKING:
    from raycap.cluster.nodes.actor import DirectoryHandle
    from raycap.cluster.nodes.fleet import Fleet
    from raycap.output.commit import OutputLock
    from raycap.output.manifest import Manifest

logger = logging.getLogger(__name__)


@dataclass
class RetireReport:
    """What `retire` did: parts dropped, rollouts changed since their build, errors."""

    dropped: int = 0
    changed: list[str] = field(default_factory=list)  # snapshot changed since the build: kept
    errors: list[str] = field(default_factory=list)

    def merge(self, other: "RetireReport") -> None:
        self.dropped += other.dropped
        self.changed.extend(other.changed)
        self.errors.extend(other.errors)


def _read_retirable(output: Location, shard: str | Location) -> list[tuple[str, str, str, int]]:
    """The retirable snapshots of a committed shard of `output`, as retirement holds it
    (`Backend.for_tasks`), opened where this node sees it (`local_path`) as every shard
    is opened (`Backend.open_part`: locally never through a link)."""
    backend = backend_of(output)
    return retirable(backend.read_table(backend.from_tasks(shard, _local_path), RETIRE_COLUMNS))


def _local_path(path: str) -> str:
    """`raycap.cluster.plumbing.placement.local_path`; a process without Ray (a retirement here,
    where this module is imported without Ray) opens every path as it is."""
    if not ray_running():
        return path
    from raycap.cluster.plumbing.placement import local_path

    return local_path(path)


def _retirable_by_dir(output: Location, shard: str | Location) -> dict[str, list[tuple[str, str, int]]]:
    per_dir: dict[str, list[tuple[str, str, int]]] = defaultdict(list)
    for label, rid, sid, version in _read_retirable(output, shard):
        per_dir[label].append((rid, sid, version))
    return per_dir


def _tally(report: RetireReport, label: str, items: list[tuple[str, str, int]], outcomes: Sequence[DropOutcome]) -> None:
    for (rid, _, _), outcome in zip(items, outcomes):
        if outcome.dropped:
            report.dropped += 1
        elif outcome.changed:
            report.changed.append(rid)
            logger.warning("rollout %s in %s changed since it was built; its capture is kept", rid, label)
        else:
            report.errors.append(f"{rid}: {outcome.error}")


def _retire_locally(
    output: Location, shard: str | Location, stores: dict[str, TokenCaptureStore], pool: ThreadPoolExecutor
) -> RetireReport:
    return _drop_locally(_retirable_by_dir(output, shard), stores, pool)()


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
    per_dir: dict[str, list[tuple[str, str, int]]], stores: dict[str, TokenCaptureStore], pool: ThreadPoolExecutor
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
    per_dir: dict[str, list[tuple[str, str, int]]], handles: dict[str, DirectoryHandle]
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


def _collect_drops(report: RetireReport, per_dir: dict[str, list[tuple[str, str, int]]], refs: dict[str, Any]) -> RetireReport:
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


def retire_here(
    output: Location, shards: Sequence[str | Location], dirs: Sequence[CaptureDir], on_shard: OnShard | None
) -> RetireReport:
    """Retire the shards of `output` from this process, through the directories' stores."""
    stores = {d.label: TokenCaptureStore(d.path, create=False) for d in dirs}
    report = RetireReport()
    with _dropping() as pool:
        for shard in shards:
            report.merge(_retire_locally(output, shard, stores, pool))
            if on_shard:
                on_shard(shard, report)
    return report


def retire_on_ray(output: Location, shards: Sequence[str | Location], fleet: Fleet, on_shard: OnShard | None) -> RetireReport:
    """Retire the shards of `output` through the fleet's actors. This process reads each
    shard's retirable rows (a few small columns of a shard `verify` has just read whole),
    a few shards ahead on threads, and the actors drop them, a few shards' drops in
    flight: no task, so retiring starts no worker process (a task that takes no CPU gets
    a new one for each task running at once)."""
    with ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="raycap-retire") as pool:
        steps = _ahead((str(shard), pool.submit(_retirable_by_dir, output, shard).result) for shard in shards)
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
    steps: Iterator[tuple[str, Callable[[], dict[str, list[tuple[str, str, int]]]]]],
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

# (name, directory label -> [(rollout id, snapshot id, version)]): what one step drops.
Listed = list[tuple[str, dict[str, list[tuple[str, str, int]]]]]


def listed_snapshots(
    output: Location, shards: Sequence[str | Location], redundant: Sequence[tuple[str, str, str, int]], records: str
) -> Listed:
    """What retirement drops from an output of finalized records, each snapshot once:
    shard by shard, the snapshots its rows allow (`raycap.rows.arrow.retirable`), then the
    redundant captures its manifest lists (named `records`). A rollout id given by several
    records appears in several shards, or among both; its snapshot is dropped once, by
    the first step that lists it."""
    seen: set[tuple[str, str, str, int]] = set()
    out: Listed = []

    def step(name: str, snapshots: Sequence[tuple[str, str, str, int]]) -> None:
        per_dir: dict[str, list[tuple[str, str, int]]] = defaultdict(list)
        for snapshot in snapshots:
            if snapshot not in seen:
                seen.add(snapshot)
                per_dir[snapshot[0]].append(snapshot[1:])
        out.append((name, dict(per_dir)))

    for shard in shards:
        step(str(shard), _read_retirable(output, shard))
    step(records, redundant)
    return out


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
    location = as_location(output)  # parsed once, here
    check_writable(location)  # retirement writes its marker into the output
    backend = backend_of(location)
    where = backend.where(location)
    if lock is not None:
        checked_lock(location, lock)
    with nullcontext() if lock is not None else backend.lock(location):
        manifest = backend.committed_manifest(location, manifest)
        backend.finish(location, manifest)
        # Every shard is checked (inside the output, a regular file, in place) before
        # the marker. A shard travels to a task as the backend hands it over.
        committed = backend.shards(location, manifest)
        # And every part the commit wrote is there, whole, before anything is dropped.
        verify(location, manifest, committed)
        shards = [backend.for_tasks(path) for path in committed]
        mark_retiring(location, "started", fingerprint=manifest.fingerprint)
        local = here()
        if manifest.records is not None:
            # Finalized records: each snapshot once, the redundant captures included.
            listed = listed_snapshots(location, shards, manifest.records.redundant(), f"{where}/{RECORDS_DIR}")
            report = drop_listed_here(listed, dirs, on_shard) if local else drop_listed_on_ray(listed, fleet(), on_shard)
        elif local:
            report = retire_here(location, shards, dirs, on_shard)
        else:
            report = retire_on_ray(location, shards, fleet(), on_shard)
        mark_retiring(
            location,
            "incomplete" if report.errors else "finished",
            dropped=report.dropped,
            changed=len(report.changed),
            errors=len(report.errors),
        )
    return report
