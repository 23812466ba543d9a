"""Streaming for asynchronous training: rows as rollouts finish, delivered until committed.

The capture directories are the queue. A rollout is *ready* when its capture is frozen
(in every directory that holds part of it), it is not retired, and it has no commit
marker for its current snapshot that settles it (`raycap.store.CommitMarker`). A stream
keeps no state that the directories do not hold: what it has built ahead or handed out
lives only in its memory, so a new stream over the same directories after a crash starts
from exactly what the directories say.

Readiness. `submit(ids)` freezes rollouts the caller says finished and makes them
ready, in submission order. A stream never freezes a rollout nobody said had finished:
that would cut it. So `submit` takes a list of ids (a lone str or bytes is a TypeError,
never one id per character), and refuses, with the reason in `Submitted.refused`, an
invalid id and an id that no directory holds a capture of (freezing it would make a
phantom rollout). At start, and with `watch=True` continuously, it also finds rollouts
that others froze (a finalizer, or a dead stream's submits), in the order their state
files were written. Watching costs in proportion to the live (unretired) rollouts, not
to the retired history: on Linux an inotify watch reports each state file renamed into
place (every freeze renames one); the directories are rescanned only when the watch
asks (its queue overflowed) and, on a network file system, where a watch sees only this
machine's renames, every `RESCAN_SECONDS` as a safety net. Elsewhere the directories
are rescanned every `POLL_SECONDS`. A rescan is one pass over names (the history's
tombstones included, skipped by name) plus one state read per live rollout.

Take. `take(n)` returns the next rows in ready order, blocking until `n` rollouts are
built or the timeout passes, then what is there; `take(1)` returns as soon as one
rollout is built. `n` counts rollouts: in chain delivery a rollout's chain rows always
come together, so a table may hold more than `n` rows. Masked rows are rows. A
background thread builds ahead through a `raycap.Rebuilder` session (the same builder
tasks and node actors as `rebuild`), bounded by `max_ahead_rows` and `max_ahead_bytes`
(a waiting taker may lift the row bound to its own `n`, so a large take never waits on
the bound).

Where rows live. A taker of tables gets rows built into this process (they are the rows
it returns). Once a take has asked for refs, and while the rebuilder builds on Ray (its
workers up), built rows stay in the object store: this process holds only their
metadata (`META_COLUMNS`: identity, snapshots, verdict, `version_min`), which is all
that ordering, staleness, commit and retirement read. `take(n)` then fetches the rows it
returns; `take(n, refs=True)` fetches nothing: a Ray task slices the taken rollouts out
of their build batches and applies the stale masks there (the same masks this process
computes on the metadata), and `commit(refs, output=...)` writes the step dataset in a
Ray task. Rows built in this
process (executor local, or the first call on a cold Ray) are handed out as they are,
through `ray.put` for refs.

Staleness. With `version_key`, rows carry per-call versions (`raycap.arrow`). Given the
trainer's `current_version` (an int) and `max_staleness` (an int >= 0), a row whose
`version_min` is below `current_version - max_staleness` is delivered masked with the
reason `stale` (in `mask_reasons`, which summaries count by reason) and weight 0 in
chain delivery. Rows without versions are never stale, so the first such row of a take
that bounds staleness (a missing or non-integer version, or no `version_key`) is said
once per stream, as a warning. Stale rows are masked rows: committing them keeps their
captures as evidence. `take` checks all its arguments before it takes anything.

Commit (`raycap.stepcommit`). A commit is tied to what was delivered: it accepts only
rows this stream delivered and no commit has claimed, whole rollouts, unchanged (their
verdicts as delivered), or the refs take(refs=True) returned, and claims them atomically,
so of two commits of the same rows exactly one wins (`raycap.ledger`). Its step output is
placed as `rebuild_to_output`'s must be, and must be new, or hold exactly this commit's
snapshots (a retried commit). Anything else is refused before any marker is written:
nothing is retired, and the rows stay taken. Then, in this order, each step durable
before the next, from the rows the stream delivered, never the caller's values:
1. a commit marker for each rollout's current snapshot (in the directory of its first
   snapshot part), naming the output (or null) and whether its rows are masked;
2. with `output`, the rows as one committed dataset in the rebuild job's format
   (`raycap.output`: shards, manifest, atomic rename), one directory per step;
3. the exact snapshots of the rollouts whose rows are all unmasked are dropped (which
   removes their marker). Masked rollouts keep their capture and marker as evidence and
   are never delivered again.

Recovery, when a stream finds a frozen, unretired rollout whose marker is current: if
the marker names no output, or names a committed output that holds a row of the rollout
with exactly the marker's snapshot (directory, snapshot id, version; never the id alone,
which a reused step directory may hold for another capture), the commit happened and is
finished (an unmasked rollout is dropped, a masked one stays as evidence); otherwise the
step died before its dataset was renamed into place, so the marker is removed and the
rollout is ready again. A damaged marker, or one naming a step that cannot be read,
holds its rollout back, neither delivered nor retired, and is said once as a warning
(damaged markers are counted in `StreamStats`). Hence, under any interleaving and a
crash at any moment: every ready rollout is delivered; what was taken but not committed
is delivered again; nothing committed is delivered again; nothing is retired before its
row is committed; an interrupted retirement is finished; and each rollout is in exactly
one committed step dataset.

One stream consumes a set of directories at a time: it holds an exclusive lock on
`.raycap-stream.lock` in each, because two consumers would deliver the same rollouts
twice. The directories are plain local paths (or one shared file system); building may
still run on Ray.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import math
import numbers
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from raycap.batch import schema_of
from raycap.capturedir import capture_dirs as parse_capture_dirs
from raycap.capturedir import local_paths
from raycap.capturefiles import open_capture
from raycap.options import RebuildOptions
from raycap.outputerrors import OutputError
from raycap.stepcommit import CommitReport, StepCommit
from raycap.steps import (
    Built,
    SnapshotPart,
    batch_slices,
    committed_parts,
    conform,
    mask_stale,
    ray_task,
    split_by_rollout,
)
from raycap.store import TokenCaptureStore, validate_rollout_id
from raycap.watch import Inotify, is_local_file_system

logger = logging.getLogger(__name__)

DEFAULT_MAX_AHEAD_ROWS = 256
DEFAULT_MAX_AHEAD_BYTES = 256 << 20
# The most rollouts one build call takes: a training step's batch, so task overhead is
# paid once per step, not once per rollout.
BUILD_BATCH = 64
# The safety net under inotify: it misses nothing on a local file system, but a watch
# on a network file system sees only this machine's renames.
RESCAN_SECONDS = 10.0
POLL_SECONDS = 0.1
# A build call that failed (a lost node, say) is retried after this pause; its
# rollouts stay at the front of the queue.
RETRY_SECONDS = 1.0
LOCK_NAME = ".raycap-stream.lock"
IO_THREADS = 8

_STATE_SUFFIX = ".tokens.state.json"


@dataclass
class StreamStats:
    """What a stream has done since it started (rollouts unless named rows)."""

    submitted: int = 0
    discovered: int = 0
    delivered: int = 0
    rows_delivered: int = 0
    stale: int = 0
    committed: int = 0
    retired: int = 0
    kept_as_evidence: int = 0
    recovered_finished: int = 0
    recovered_ready: int = 0
    build_failures: int = 0
    # Rollouts held back because their commit marker is damaged (each logged once).
    damaged_markers: int = 0


@dataclass(frozen=True)
class Submitted:
    """What `submit` did: the ids now ready, and the ids refused with the reason."""

    ready: tuple[str, ...]
    refused: dict[str, str] = field(default_factory=dict)


class Stream:
    """A stream of built rows over capture directories (see the module docstring)."""

    def __init__(
        self,
        capture_dirs: Sequence[Any],
        *,
        builder: str = "prefix_merging",
        model: str = "",
        delivery: str = "rollout",
        executor: str = "auto",
        watch: bool = False,
        version_key: str | None = None,
        max_ahead_rows: int = DEFAULT_MAX_AHEAD_ROWS,
        max_ahead_bytes: int = DEFAULT_MAX_AHEAD_BYTES,
        address: str | None = None,
    ) -> None:
        # The options are checked once, as every rebuild's are (ValueError naming the
        # known values); the session below builds with the same value.
        options = RebuildOptions(
            builder=builder, model=model, delivery=delivery, executor=executor, version_key=version_key,
        )
        for name, value in (("max_ahead_rows", max_ahead_rows), ("max_ahead_bytes", max_ahead_bytes)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        local = local_paths(parse_capture_dirs(capture_dirs))
        if not local.readable:
            raise ValueError(
                f"a stream reads its capture directories in this process, but {local.why_not}; give local paths"
            )
        paths = list(local.paths)
        from raycap.cluster.rebuild import Rebuilder

        self.paths = paths
        self.builder, self.model, self.delivery, self.version_key = builder, model, delivery, version_key
        self.watch = watch
        self.max_ahead_rows, self.max_ahead_bytes = max_ahead_rows, max_ahead_bytes
        self.stores = {path: TokenCaptureStore(path, create=False) for path in paths}
        self.stats = StreamStats()
        self._schema = schema_of(delivery, version_key)
        self._cond = threading.Condition()
        self._ready: deque[str] = deque()
        # Every rollout this stream holds in memory: ready, being built, built, or taken
        # and not yet committed. Discovery never queues these again.
        self._known: set[str] = set()
        self._judging: set[str] = set()
        self._again: set[str] = set()
        self._built: deque[Built] = deque()
        self._ahead_rows = 0
        self._ahead_bytes = 0
        self._wanted = 0
        self._warned_versions = False
        self._held: set[str] = set()  # rollouts held back, said once each
        # Whether the latest take asked for refs: builds keep rows on Ray only then, so
        # a taker of tables gets them without a second round trip to the object store.
        self._refs_wanted = False
        self._commits = 0  # commits finished; see _consider
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._inotify: Inotify | None = None
        self._rescan_now = threading.Event()
        self._lock_fds: list[int] = []
        # Markers and drops of a step wait on fsyncs, not the CPU: a few threads overlap them.
        self._io = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="raycap-stream-io")
        # What take() delivered, and the commits that claim it (`raycap.stepcommit`).
        self._commit = StepCommit(self.stores, self._step_inputs, self._io)
        try:
            self._lock_directories()
            self.rebuilder = Rebuilder(
                paths, builder=options.builder, model=options.model, delivery=options.delivery,
                executor=options.executor, address=address, version_key=options.version_key,
            )
            if watch:
                # Before the first scan, so no freeze falls between the scan and the watch.
                self._inotify = Inotify.open(paths)
            self._rescan()
        except BaseException:
            self.close()
            raise
        self._start_thread(self._build_loop, "raycap-stream-build")
        if watch:
            if self._inotify is not None:
                self._start_thread(self._watch_loop, "raycap-stream-watch")
            self._start_thread(self._rescan_loop, "raycap-stream-rescan")

    # -- lifecycle ----------------------------------------------------------------------------

    def _lock_directories(self) -> None:
        for path in self.paths:
            lock = os.path.join(path, LOCK_NAME)
            # Opened like a capture file: a link planted in the directory is refused,
            # never followed to create or lock a file elsewhere.
            fd = open_capture(LOCK_NAME, Path(lock), os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RuntimeError(
                    f"another stream consumes {path} (it holds {lock}); two consumers would deliver the same "
                    "rollouts twice: close the other stream first"
                ) from None
            self._lock_fds.append(fd)

    def _start_thread(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def close(self) -> None:
        """Stop building and watching and release the directories. Writes nothing: what
        was taken and not committed is delivered again by the next stream."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._rescan_now.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=30)
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None
        for fd in self._lock_fds:
            os.close(fd)
        self._lock_fds = []
        self._io.shutdown(wait=True)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- readiness -----------------------------------------------------------------------------

    def submit(self, rollout_ids: Sequence[str]) -> Submitted:
        """These rollouts finished: freeze them (in every directory holding them) and make
        them ready, in this order. Refused with the reason, and never frozen: an invalid
        id, an id no directory holds a capture of (freezing it would make a phantom
        rollout), a retired rollout, or one already committed as masked evidence. A single
        str or bytes is a TypeError: iterating it would submit one id per character."""
        ids = _submitted_ids(rollout_ids)
        refused: dict[str, str] = {}
        for rid in ids:
            try:
                validate_rollout_id(rid)
            except ValueError as exc:
                refused[rid] = str(exc)
        holders = self._holders([rid for rid in ids if rid not in refused])
        for rid, where in holders.items():
            if not where:
                refused[rid] = (
                    f"no capture of rollout {rid} is in any of the stream's directories ({', '.join(self.paths)}); "
                    "submit a rollout after its calls were captured"
                )
        for path, store in self.stores.items():
            mine = [rid for rid in ids if path in holders.get(rid, ())]
            for rid, frozen in zip(mine, store.freeze_many(mine, read=False)):
                if isinstance(frozen, str):
                    refused.setdefault(rid, frozen)
        ready, queued = [], 0
        for rid in ids:
            if rid in refused:
                continue
            verdict = self._consider(rid)
            if verdict is None or verdict == "queued":
                ready.append(rid)
                queued += verdict == "queued"
            else:
                refused[rid] = verdict
        with self._cond:
            self.stats.submitted += queued
        for rid, reason in refused.items():
            logger.warning("rollout %s was submitted but is not ready: %s", rid, reason)
        return Submitted(tuple(ready), refused)

    def _holders(self, ids: Sequence[str]) -> dict[str, list[str]]:
        """The directories holding each (valid) id; none for an id no directory holds."""
        held = {path: store.held(ids) for path, store in self.stores.items()}
        return {rid: [p for p in self.paths if rid in held[p]] for rid in ids}

    def _rescan(self) -> None:
        """One pass over each directory's names: queue the live, frozen, uncommitted
        rollouts not yet known, oldest freeze first."""
        found: dict[str, int] = {}
        for store in self.stores.values():
            for rid in store.rollout_ids(skip_retired=True):
                if rid in self._known:
                    continue
                try:
                    mtime = os.stat(store.paths(rid).state).st_mtime_ns
                except FileNotFoundError:
                    continue  # never frozen (no state), or gone since the listing
                found[rid] = min(mtime, found.get(rid, mtime))
        outputs: dict[str, set[tuple[str, str, str, int]] | None] = {}
        for rid in sorted(found, key=lambda r: (found[r], r)):
            if self._consider(rid, outputs) == "queued":
                with self._cond:
                    self.stats.discovered += 1

    def _consider(self, rid: str, outputs: dict[str, set[tuple[str, str, str, int]] | None] | None = None) -> str | None:
        """Queue `rid` if it is ready. Returns "queued", None when it was known already,
        or why it is not ready. Finishes an interrupted commit of its snapshot."""
        with self._cond:
            # One judge per rollout at a time: the watch and a rescan may both see it, and
            # finishing an interrupted commit twice would only log a failed second drop.
            if rid in self._known or self._closed:
                return None
            if rid in self._judging:
                # Its state changed while the judge read it (a freeze right after another
                # write): the judge reads it again before letting go, so no event is lost.
                self._again.add(rid)
                return None
            self._judging.add(rid)
        try:
            while True:
                with self._cond:
                    commits = self._commits
                    self._again.discard(rid)
                status = self._status(rid, {} if outputs is None else outputs)
                if status != "ready":
                    with self._cond:
                        if rid in self._again and not self._closed:
                            continue
                    return status
                with self._cond:
                    if rid in self._known or self._closed:
                        return None
                    if commits != self._commits:
                        # A commit finished while the state was read: the rollout may have
                        # been queued, taken and committed meanwhile, so judge it again.
                        continue
                    self._known.add(rid)
                    self._ready.append(rid)
                    self._cond.notify_all()
                return "queued"
        finally:
            with self._cond:
                self._judging.discard(rid)

    def _status(self, rid: str, outputs: dict[str, set[tuple[str, str, str, int]] | None]) -> str:
        holders = []
        for path, store in self.stores.items():
            try:
                life = store.lifecycle(rid)
            except (OSError, ValueError) as exc:
                return f"its state in {path} is unreadable ({type(exc).__name__}: {exc})"
            if life.frozen or life.retired:
                holders.append((path, store, life))
            elif store.held([rid]):
                return "not frozen (not finished)"
        if not holders:
            return "not frozen (not finished)"
        if any(life.retired for _, _, life in holders):
            return "retired"
        path, store, life = holders[0]
        try:
            marker = store.read_commit(rid)
        except ValueError as exc:
            if self._held_back(rid, f"its commit marker {store.commit_path(rid)} is damaged ({exc})"):
                with self._cond:
                    self.stats.damaged_markers += 1
            return str(exc)
        # A marker belongs to a snapshot, not to a version: a call marked incomplete after
        # the commit bumps the version, and the rollout is still committed.
        if marker is None or marker.snapshot_id != life.snapshot_id:
            return "ready"
        if marker.output is not None:
            if marker.output not in outputs:
                try:
                    outputs[marker.output] = committed_parts(marker.output)
                except OutputError as exc:
                    # Whether it holds the rows cannot be told: neither delivered (maybe
                    # twice) nor retired (maybe lost) until someone looks.
                    self._held_back(rid, f"its commit marker names the step {marker.output}, whose {exc}")
                    return f"its step {marker.output} cannot be read"
            held = outputs[marker.output]
            if held is None or (rid, os.path.realpath(path), marker.snapshot_id, marker.version) not in held:
                # The step died before its dataset was renamed into place, or the output
                # holds another capture of this id (a reused step directory): this
                # snapshot was never committed.
                store.remove_commit(rid, marker.snapshot_id)
                with self._cond:
                    self.stats.recovered_ready += 1
                logger.info("rollout %s: its step %s was never committed; delivering it again", rid, marker.output)
                return "ready"
        if marker.masked:
            return f"committed as masked evidence ({marker.reason})"
        # Committed and unmasked, but not yet retired: finish the retirement, of exactly
        # the committed version (a changed capture is then kept, as evidence, by the drop).
        parts = [SnapshotPart(p, life.snapshot_id, life.version) for p, _, life in holders]
        parts[0] = SnapshotPart(parts[0].label, marker.snapshot_id, marker.version)
        self._commit.drop(rid, parts)
        with self._cond:
            self.stats.recovered_finished += 1
        logger.info("rollout %s: finished the retirement of its committed snapshot", rid)
        return "committed"

    def _held_back(self, rid: str, why: str) -> bool:
        """Say once per rollout that it is held back, neither delivered nor retired
        until someone looks; True the first time."""
        with self._cond:
            if rid in self._held:
                return False
            self._held.add(rid)
        logger.warning("rollout %s is held back, neither delivered nor retired: %s", rid, why)
        return True

    def _watch_loop(self) -> None:
        """Consider each rollout whose state file was renamed into place (a freeze renames
        one); an overflowed event queue asks for a rescan."""
        while not self._closed:
            try:
                names, overflow = self._inotify.read(timeout=0.5)
                if overflow:
                    self._rescan_now.set()
                for name in names:
                    if name.endswith(_STATE_SUFFIX):
                        rid = name[: -len(_STATE_SUFFIX)]
                        try:
                            validate_rollout_id(rid)
                        except ValueError:
                            continue
                        if self._consider(rid) == "queued":
                            with self._cond:
                                self.stats.discovered += 1
            except Exception as exc:  # noqa: BLE001 - the watch must outlive one bad file
                logger.warning("watching %s failed once (%s); rescanning", ", ".join(self.paths), exc)
                self._rescan_now.set()
                time.sleep(POLL_SECONDS)

    def _rescan_loop(self) -> None:
        """The safety net under the watch, or the whole of it where inotify is missing.
        Its own thread: a rescan of a large directory never delays the watch's events.
        On local file systems the watch misses nothing, so a rescan runs only when it
        asks (its queue overflowed, or it failed): a rescan reads every name, retired
        tombstones included, and discovery must not cost in proportion to the history."""
        if self._inotify is None:
            interval: float | None = POLL_SECONDS
        elif all(is_local_file_system(path) for path in self.paths):
            interval = None
        else:
            interval = RESCAN_SECONDS
        while not self._closed:
            self._rescan_now.wait(interval)
            self._rescan_now.clear()
            if self._closed:
                return
            try:
                self._rescan()
            except Exception as exc:  # noqa: BLE001 - the next rescan tries again
                logger.warning("rescanning %s failed (%s); trying again", ", ".join(self.paths), exc)

    # -- building ahead ------------------------------------------------------------------------

    def _room(self) -> bool:
        rows_bound = max(self.max_ahead_rows, self._wanted)
        if self._ahead_rows >= rows_bound:
            return False
        return self._ahead_bytes < self.max_ahead_bytes or self._ahead_rows < self._wanted

    def _build_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not (self._ready and self._room()):
                    self._cond.wait()
                if self._closed:
                    return
                room = max(self.max_ahead_rows, self._wanted) - self._ahead_rows
                ids = [self._ready.popleft() for _ in range(min(len(self._ready), BUILD_BATCH, room))]
            try:
                pieces = self._build(ids)
            except Exception as exc:  # noqa: BLE001 - retried: nothing was taken or dropped
                logger.warning("building %d ready rollouts failed (%s); retrying in %.0f s", len(ids), exc, RETRY_SECONDS)
                with self._cond:
                    self.stats.build_failures += 1
                    self._ready.extendleft(reversed(ids))
                    self._cond.wait(RETRY_SECONDS)
                continue
            with self._cond:
                for piece in pieces:
                    self._built.append(piece)
                    self._ahead_rows += piece.rows
                    self._ahead_bytes += piece.nbytes
                self._cond.notify_all()

    def _build(self, ids: list[str]) -> list[Built]:
        """Build `ids`, one `Built` per rollout in their order. Where the rebuilder builds
        on Ray (and its workers are up), the rows stay in the object store and only their
        metadata comes to this process: a taker asking for refs gets rows that never
        passed through here, and the others fetch them when they take."""
        choice = self.rebuilder.decide(ids, self.rebuilder.options)
        if choice.executor != "ray" or choice.cold or not self._refs_wanted:
            table = conform(self.rebuilder.rebuild(ids), self._schema, self.version_key)
            return [Built(rid, piece, piece.get_total_buffer_size()) for rid, piece in split_by_rollout(table)]
        import ray

        refs = self.rebuilder.rebuild_refs(ids)
        describe = ray_task("describe")
        # A batch lost while it ran raises here: every id of this build is built again.
        described = ray.get([describe.remote(ref, self._schema, self.version_key) for ref in refs])
        out = []
        for ref, (meta, sizes) in zip(refs, described):
            offset = 0
            for (rid, piece), nbytes in zip(split_by_rollout(meta), sizes):
                out.append(Built(rid, piece, nbytes, ref, offset))
                offset += piece.num_rows
        return out

    # -- taking --------------------------------------------------------------------------------

    def take(
        self,
        n: int,
        timeout: float | None = None,
        current_version: int | None = None,
        max_staleness: int | None = None,
        *,
        refs: bool = False,
    ) -> pa.Table | list[Any]:
        """The next `n` rollouts' rows in ready order (see the module docstring): waits
        until `n` are built or `timeout` seconds pass, then returns what is there (maybe
        none). With refs=True, a list holding the ObjectRef of the Arrow table (Ray), for
        trainer workers on other nodes. The arguments are checked before anything is
        taken (TypeError or ValueError, one line)."""
        oldest = _checked_take(n, timeout, current_version, max_staleness, refs)
        deadline = None if timeout is None else time.monotonic() + max(float(timeout), 0.0)
        with self._cond:
            self._refs_wanted = refs
            self._wanted = max(self._wanted, n)
            self._cond.notify_all()
            try:
                while len(self._built) < n and not self._closed:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        break
                    self._cond.wait(remaining)
            finally:
                self._wanted = 0
            pieces = [self._built.popleft() for _ in range(min(n, len(self._built)))]
            for piece in pieces:
                self._ahead_rows -= piece.rows
                self._ahead_bytes -= piece.nbytes
            self._cond.notify_all()
        try:
            result, delivered, stale = self._deliver(pieces, oldest, refs)
        except BaseException:
            # Nothing was handed out (a batch lost on Ray, say): build them again, first.
            with self._cond:
                self._ready.extendleft(reversed([p.rollout_id for p in pieces]))
                self._cond.notify_all()
            raise
        rows = delivered.num_rows
        if oldest is not None and rows:
            self._warn_unversioned(delivered)
        with self._cond:
            self.stats.delivered += len(pieces)
            self.stats.rows_delivered += rows
            self.stats.stale += stale
        return result

    def _deliver(self, pieces: list[Built], oldest: int | None, refs: bool) -> tuple[Any, pa.Table, int]:
        """What take returns for `pieces` (stale masks applied), the rows (or metadata)
        recorded as delivered, and how many rollouts staleness masked."""
        remote = [p for p in pieces if p.ref is not None]
        counts = [(p.rollout_id, p.rows) for p in pieces]
        result: pa.Table | list[Any]
        if refs and pieces and len(remote) == len(pieces):
            # The rows are assembled (and masked) where they are; this process computes
            # the same masks on the metadata, which is what commit reads.
            meta, stale = mask_stale(pa.concat_tables([p.table for p in pieces]), oldest)
            slices, batches = batch_slices(pieces)
            ref = ray_task("assemble").remote(self._schema, self.version_key, slices, oldest, *batches)
            self._commit.ledger.record(meta, counts, whole=False, ref=ref)
            result, delivered = [ref], meta
        else:
            table, stale = mask_stale(self._fetch(pieces), oldest)
            result, delivered = table, table
            if refs:
                import ray

                result = [ray.put(table)]  # rows built here: they are in this process already
            self._commit.ledger.record(table, counts, whole=True, ref=result[0] if refs else None)
        return result, delivered, stale

    def _fetch(self, pieces: list[Built]) -> pa.Table:
        """The rows of `pieces` in this process, in order (rows built on Ray are fetched)."""
        if not pieces:
            return self._schema.empty_table()
        batches: dict[Any, pa.Table] = {}
        remote = list(dict.fromkeys(p.ref for p in pieces if p.ref is not None))
        if remote:
            import ray

            for ref, table in zip(remote, ray.get(remote)):
                batches[ref] = conform(table, self._schema, self.version_key)
        return pa.concat_tables(
            [p.table if p.ref is None else batches[p.ref].slice(p.offset, p.rows) for p in pieces]
        )

    async def take_async(self, n: int, timeout: float | None = None, current_version: int | None = None,
                         max_staleness: int | None = None, *, refs: bool = False) -> pa.Table | list[Any]:
        """`take` without blocking the event loop (its arguments checked here, first)."""
        _checked_take(n, timeout, current_version, max_staleness, refs)
        return await asyncio.to_thread(self.take, n, timeout, current_version, max_staleness, refs=refs)

    def _warn_unversioned(self, rows: pa.Table) -> None:
        """Staleness was asked for: say once if a built row carries no version, since
        such a row is never stale (a missing or non-integer version, or no version_key)."""
        if self._warned_versions:
            return
        if self.version_key is None:
            self._warned_versions = True
            logger.warning("take() was given current_version and max_staleness, but this stream has no version_key: "
                           "no row is ever stale; give Stream(version_key=...) the record field holding the version")
            return
        unversioned = pc.and_(pc.is_null(rows.column("version_min")), pc.is_null(rows.column("error")))
        if not pc.any(unversioned).as_py():
            return
        self._warned_versions = True
        rid = rows.filter(unversioned).column("rollout_id")[0].as_py()
        logger.warning(
            "rollout %s has no integer %r in its records (missing, or not an integer such as \"5\" or 5.5): its rows "
            "are never stale, so staleness does not bound them; write integer versions under %r (said once per "
            "stream)", rid, self.version_key, self.version_key,
        )

    # -- committing ----------------------------------------------------------------------------

    def commit(self, rows: pa.Table | Sequence[Any], output: str | os.PathLike | None = None) -> CommitReport:
        """Make `rows` durable, then retire the exact snapshots of the rollouts whose rows
        are all unmasked. `rows` is what take() returned, whole rollouts: a table, or the
        refs of take(refs=True). With `output`, the rows become one committed dataset
        there (one new directory per step); without, the caller declares them durable
        elsewhere (its checkpoint).

        Refused before anything is written, the rows staying taken: rows this stream did
        not deliver, or changed, or committed already, or another thread is committing
        (ValueError, `raycap.ledger`); an output placed where `rebuild_to_output` refuses
        one, or one that already holds other rows (`StepRefused`, a ValueError too). The
        step is written from the rows this stream delivered, never the caller's values;
        refs are written by a Ray task, never fetched into this process
        (`raycap.stepcommit`)."""
        if self._closed:
            raise RuntimeError("this stream is closed; its taken rows are delivered again by the next stream")
        report, settled = self._commit.commit(rows, output)
        with self._cond:
            self._commits += 1
            self._known.difference_update(settled)
            self.stats.committed += report.rollouts
            self.stats.retired += report.retired
            self.stats.kept_as_evidence += report.kept_as_evidence
        return report

    def _step_inputs(self, ids: list[str]) -> Any:
        """What a step dataset of `ids` records as its inputs (`raycap.output.Inputs`)."""
        from raycap.output import Inputs

        return Inputs(tuple(self.paths), tuple(ids), self.builder, self.model, self.delivery)


# -- argument checks -------------------------------------------------------------------------------

_INT64 = (-(1 << 63), (1 << 63) - 1)


def _is_int(value: Any) -> bool:
    # bool is an int, but take(True) or max_staleness=False is a slip, never a count.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _checked_take(n: Any, timeout: Any, current_version: Any, max_staleness: Any, refs: Any) -> int | None:
    """take()'s arguments checked before anything is taken; the oldest version that is
    not stale (None: no staleness bound)."""
    if not _is_int(n):
        raise TypeError(f"take(n) counts rollouts: n must be an int, not {type(n).__name__} {n!r:.40}")
    if n < 1:
        raise ValueError(f"take(n) needs n >= 1, got {n}")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
            raise TypeError(f"timeout must be a number of seconds or None, not {type(timeout).__name__} {timeout!r:.40}")
        if not math.isfinite(timeout):
            raise ValueError(f"timeout must be a finite number of seconds or None (wait forever), not {timeout}")
    if not isinstance(refs, bool):
        raise TypeError(f"refs must be True or False, not {type(refs).__name__}")
    if (current_version is None) != (max_staleness is None):
        raise ValueError("give both current_version and max_staleness to bound staleness, or neither")
    if current_version is None:
        return None
    for name, value in (("current_version", current_version), ("max_staleness", max_staleness)):
        if not _is_int(value):
            raise TypeError(f"{name} must be an int, not {type(value).__name__} {value!r:.40}")
        if not _INT64[0] <= value <= _INT64[1]:
            raise ValueError(f"{name} {value} does not fit in 64 bits, as versions in rows do")
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0 (0: only the current version is fresh), not {max_staleness}")
    # Clamped: below the lowest 64-bit version nothing is stale, as the unclamped bound says.
    return max(int(current_version) - int(max_staleness), _INT64[0])


def _submitted_ids(rollout_ids: Any) -> list[str]:
    """submit()'s ids, checked: a collection of strings (duplicates once each)."""
    if isinstance(rollout_ids, (str, bytes, bytearray)):
        raise TypeError(
            f"submit takes a list of rollout ids, not the single {type(rollout_ids).__name__} {rollout_ids!r:.40}; "
            "wrap a single id in a list"
        )
    if isinstance(rollout_ids, Mapping) or not isinstance(rollout_ids, Iterable):
        raise TypeError(f"submit takes a list of rollout ids, not {type(rollout_ids).__name__}")
    ids = list(rollout_ids)
    for rid in ids:
        if not isinstance(rid, str):
            raise TypeError(f"rollout id {rid!r:.40} is not a string; give ids as strings")
    return list(dict.fromkeys(ids))
