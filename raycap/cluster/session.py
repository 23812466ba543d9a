"""The rebuild session and the module API: capture directories in, Arrow rows (or shards) out.

A `Session` holds what is worth keeping between calls on one list of capture
directories, and nothing else: placement, the node actors and the cluster's CPU count,
found on first use, so a call costs in proportion to its ids (the training step's case),
not to the directories' history. It never holds a caller's options: every call brings
its own `RebuildOptions`, so two calls on one session with different options each build
with theirs. A `Rebuilder` is a session that users make, with the options they gave it
as the default of its calls. `iter_rebuild`, `rebuild`, `retire`, `list_rollouts`,
`clear` and `sweep` run on a cached session per directory list.

Where a call runs is asked of `raycap.rows.executor.decide`; the work is done by the local
executor (`raycap.rows.local`), the cold first-call plan (`cold`) or the scheduler
(`scheduler`, builder tasks in `task`). Nothing fails the whole rebuild because of one
rollout (see `raycap.rows.batch` and `scheduler`); only a directory that cannot be placed or
started (before any work, see `fleet`), and one that cannot be listed, raise.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import pyarrow as pa
import ray

from raycap.capture.directory import CaptureDir, capture_dirs
from raycap.capture.spares import MAX_SPARES, SparePool
from raycap.cluster.cold import run_cold
from raycap.cluster.connect import connect, connect_here, ray_session
from raycap.cluster.failures import cause_text
from raycap.cluster.fleet import Fleet, first_use, fleet, prewarm, token_source, unwarm
from raycap.cluster.noderefs import node_refs
from raycap.cluster.placement import local_path
from raycap.runs.retirement import OnShard, RetireReport, retire_output
from raycap.cluster.scheduler import BatchScheduler, plan_ids
from raycap.cluster.shared_output import check_shared_output
from raycap.rows.arrow import retirable  # noqa: F401 - part of this module's API for tests
from raycap.rows.batch import schema_of
from raycap.rows.executor import ExecutorChoice, Kind, RayState, Request, decide
from raycap.rows.local import Progress, iter_local, local_ids
from raycap.rows.options import MAX_CAPTURE_BYTES, RebuildOptions, checked_rollout_ids
from raycap.rows.run import Run

if TYPE_CHECKING:
    from raycap.output.commit import OutputLock
    from raycap.output.manifest import Manifest

__all__ = [
    "Rebuilder",
    "RetireReport",
    "Session",
    "check_shared_output",
    "clear",
    "connect",
    "fleet",
    "iter_rebuild",
    "list_rollouts",
    "rebuild",
    "retire",
    "session",
    "sweep",
    "token_source",
]

logger = logging.getLogger(__name__)


class Session:
    """Placement and the node actors of one list of capture directories, kept.

    They are found on first use and again only when a node serving a directory is lost,
    or this process is connected to another Ray session (a restarted head, a new
    cluster, a new connection: see `raycap.cluster.connect.ray_session`): nothing found
    on one Ray is used on another. `last_executor` is the choice of the latest call (a report;
    a call's own `Run` carries its choice)."""

    def __init__(self, dirs: tuple[CaptureDir, ...], *, address: str | None = None) -> None:
        self.dirs = dirs
        self.address = address
        self.last_executor: ExecutorChoice | None = None
        self._fleet: Fleet | None = None
        self._job: Any = None
        self._cpus = 1
        self._placing = threading.Lock()
        self._warming: threading.Thread | None = None
        self._spares: SparePool | None = None
        self.keeps_spares = False

    # -- where the work runs ---------------------------------------------------------------

    def fleet(self) -> Fleet:
        """The placed directories and their actors, found on first use and kept."""
        connect(self.address)
        with self._placing:
            job = ray_session()
            if self._fleet is None or job != self._job:
                self._cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
                started = prewarm() if job != self._job else None
                try:
                    self._fleet, self._job = fleet(self.dirs), job
                except Exception:
                    if started is not None:
                        unwarm(started)
                    raise
            return self._fleet

    def forget_placement(self) -> None:
        """Find placement and actors again on the next call (after a node was lost)."""
        with self._placing:
            self._fleet = None

    def ray_state(self) -> RayState:
        """What `decide` needs to know of Ray here (alive nodes only when it matters)."""
        if not ray.is_initialized():
            return RayState(running=False)
        if (self._fleet is not None and self._job == ray_session()) or not first_use():
            return RayState(running=True, warm=True)
        return RayState(running=True, alive_nodes=len([n for n in ray.nodes() if n.get("Alive")]))

    def decide(self, rollout_ids: Sequence[str] | None, options: RebuildOptions, kind: Kind = "rows") -> ExecutorChoice:
        """`raycap.rows.executor.decide` for a request on this session."""
        ids = checked_rollout_ids(rollout_ids)
        return decide(Request(self.dirs, ids, options, kind, self.address), self.ray_state())

    def _warm_up_in_background(self) -> None:
        if self._warming is None:
            self._warming = threading.Thread(target=self._warm_up, name="raycap-warm-up", daemon=True)
            self._warming.start()

    def _warm_up(self) -> None:
        try:
            self.fleet()
        except Exception as exc:  # noqa: BLE001 - the next call places the directories itself and reports it
            logger.debug("warming up the rebuild session failed: %s", exc)

    # -- rebuilding ----------------------------------------------------------------------

    def run(
        self,
        rollout_ids: Sequence[str] | None,
        options: RebuildOptions,
        *,
        progress: Callable[[Progress], None] | None = None,
        shard_dir: str | None = None,
        choice: ExecutorChoice | None = None,
    ) -> Run:
        """Start a call: the executor is chosen now (`choice`, when the caller asked
        already), the work runs as the returned Run is iterated, in bounded memory,
        yielding Arrow tables (or, with `shard_dir`, the ShardInfo of each shard written
        there) whose rows, concatenated, are in the order of `rollout_ids` (sorted ids
        when listing)."""
        ids = checked_rollout_ids(rollout_ids)
        if choice is None:
            choice = self.decide(ids, options, "shards" if shard_dir is not None else "rows")
        self.last_executor = choice
        run = Run(choice, progress)
        return run.start(self._results(ids, options, choice, run.progress, shard_dir), keep=shard_dir is not None)

    def _results(
        self,
        ids: tuple[str, ...] | None,
        options: RebuildOptions,
        choice: ExecutorChoice,
        progress: Callable[[Progress], None],
        shard_dir: str | None,
    ) -> Iterator[Any]:
        if choice.cold:
            yield from run_cold(
                self.dirs, local_ids(self.dirs, ids, options.skip_retired), options, shard_dir=shard_dir,
                progress=progress, after=self._warm_up_in_background,
            )
            return
        if choice.executor == "local":
            spares = self._local_spares(ids) if shard_dir is None else None
            yield from iter_local(self.dirs, ids, options, shard_dir=shard_dir, progress=progress, spares=spares)
            return
        call = self._scheduler(ids, options, progress, shard_dir)
        try:
            yield from call.run()
        finally:
            if call.dead or call.actor_died:
                # The next call places the directories again and starts fresh actors.
                self.forget_placement()

    def _scheduler(
        self,
        ids: tuple[str, ...] | None,
        options: RebuildOptions,
        progress: Callable[[Progress], None] | None,
        shard_dir: str | None,
    ) -> BatchScheduler:
        placed = self.fleet()
        listed, holders = plan_ids(placed, ids, options.skip_retired)
        return BatchScheduler(
            placed, listed, holders, options, cpus=self._cpus, shard_dir=shard_dir, progress=progress,
            spares=self._spare_pool(placed) if ids is not None else None,
        )

    def _spare_pool(self, placed: Fleet) -> SparePool | None:
        """The spare files a `Rebuilder` keeps for a training step's freezes
        (`raycap.capture.spares`): for one directory on this process's node, which it can
        see. A cached session makes none: it makes no files its caller does not ask for."""
        if not self.keeps_spares or len(placed.dirs) != 1 or ray.util.client.ray.is_connected():
            return None
        if placed.nodes[0] != ray.get_runtime_context().get_node_id():
            return None
        return self._pool_for(local_path(placed.dirs[0].path))

    def _local_spares(self, ids: tuple[str, ...] | None) -> SparePool | None:
        """The spare files of a `Rebuilder`'s step on the local executor: explicit ids, at
        most MAX_SPARES of them, in one directory."""
        if not self.keeps_spares or ids is None or len(ids) > MAX_SPARES or len(self.dirs) != 1:
            return None
        return self._pool_for(self.dirs[0].path)

    def _pool_for(self, path: str) -> SparePool | None:
        if self._spares is None or self._spares.directory != path:
            if not os.path.isdir(path):
                return None
            self._spares = SparePool(path)
        return self._spares

    def settle(self, timeout: float | None = None) -> None:
        """Wait for what this session does in the background after a call: the spare
        files it makes for the next training step (`raycap.capture.spares`). A trainer
        need not call it; a benchmark does, so the next thing it times runs alone."""
        if self._spares is not None:
            self._spares.settle(timeout)

    def close(self) -> None:
        """Stop making spare files and remove the ones kept (see `Rebuilder`). The
        session stays usable; it makes spares again after its next step."""
        spares, self._spares = self._spares, None
        if spares is not None:
            spares.close()

    def refs(self, rollout_ids: Sequence[str] | None, options: RebuildOptions) -> list[Any]:
        """The ObjectRefs of the batches' Arrow tables, in row order (always on Ray).

        Every rollout's failure is a masked row as usual; a batch whose node is already
        known to be gone is a ref to masked rows. A batch lost while it runs raises
        when its ref is fetched: rebuild those ids again, which is safe."""
        ids = checked_rollout_ids(rollout_ids)
        self.last_executor = self.decide(ids, options, "refs")
        placed = self.fleet()
        if ids is not None and len(set(placed.nodes)) > 1:
            # Each node builds its own: one call per node (raycap.cluster.noderefs).
            built = node_refs(placed, list(ids), options, cpus=self._cpus)
            if built is not None:
                return built
            refs = self._scheduler(ids, options, None, None).refs()  # masks what a lost node held
            self.forget_placement()
            return refs
        return self._scheduler(ids, options, None, None).refs()

    # -- the other directory operations --------------------------------------------------

    def list_rollouts(self, *, skip_retired: bool = False, executor: str = "auto") -> list[str]:
        """The sorted rollout ids with capture files in any of the directories."""
        options = RebuildOptions(skip_retired=skip_retired, executor=executor)
        if self.decide(None, options, "list").executor == "local":
            return local_ids(self.dirs, None, skip_retired)
        ids, _ = plan_ids(self.fleet(), None, skip_retired)
        return ids

    def retire(
        self,
        output: str | os.PathLike,
        *,
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
        sha256 (`raycap.output.protocol.verify`). Holding the output's lock, it writes the `.retire.json` marker durably before the
        first drop, as the rebuild job does, so no later policy step deletes these rows,
        and records there how it ended. `manifest` is the output's manifest when the
        caller read it already; it is checked all the same. `lock` is the output's lock
        when the caller holds it (the lock is not re-entrant).

        `output` is a path, a URI or a `raycap.output.location.Location`. On an object store the
        commit's roll-forward is finished first (`raycap.output.backend.Backend.finish`): nothing
        is retired before every committed shard is in place."""
        return retire_output(
            output, self.dirs, on_shard=on_shard, manifest=manifest, lock=lock, fleet=self.fleet,
            here=lambda: self.decide(None, RebuildOptions(executor=executor), "retire").executor == "local",
        )

    def clear(self, rollout_ids: Iterable[str]) -> list[str]:
        """Delete the captures of these rollouts in every directory; returns error texts."""
        placed = self.fleet()
        ids = list(checked_rollout_ids(rollout_ids) or ())
        errors = []
        for d, ref in zip(placed.dirs, [h.delete_batch(ids) for h in placed.handles]):
            try:
                outcome = ray.get(ref)
            except ray.exceptions.RayError as exc:
                outcome = [cause_text(exc)] * len(ids)
            errors.extend(f"{rid} in {d.label}: {err}" for rid, err in zip(ids, outcome) if err)
        return errors

    def sweep(self, older_than_seconds: float) -> dict[str, int]:
        """Remove retired tombstones older than the cutoff; count per directory."""
        placed = self.fleet()
        counts = ray.get([h.sweep_retired(older_than_seconds=older_than_seconds) for h in placed.handles])
        return {d.label: n for d, n in zip(placed.dirs, counts)}


class Rebuilder(Session):
    """A rebuild session over one list of capture directories, with default options.

    Placement (which node serves each directory), the node actors and the cluster's CPU
    count are found on first use and kept, so every later call costs in proportion to
    its rollout ids: a training step with 64 ids is one actor round trip per directory
    and one builder task, whatever the directories' history.

    Options: see `raycap.rows.options.RebuildOptions` (checked here); they are the default of
    every call, and a call may change builder, model and delivery. `last_executor` says
    which executor ran, and why.

    Over one directory on this process's node, it keeps spare files there after each
    step, which the next step's freezes rename into place instead of creating files
    (`raycap.capture.spares`). `close()` (or leaving a `with` block) removes them, and so
    does the process's exit: close it before removing the directory. With spares=False
    it keeps none (its rollouts are frozen before it builds them, say)."""

    def __init__(
        self,
        capture_dirs: Iterable[Any],
        *,
        builder: str = "prefix_merging",
        model: str = "",
        delivery: str = "rollout",
        batch_size: int | None = None,
        max_in_flight: int | None = None,
        address: str | None = None,
        executor: str = "auto",
        verbose: bool = False,
        max_capture_bytes: int | None = MAX_CAPTURE_BYTES,
        version_key: str | None = None,
        spares: bool = True,
    ) -> None:
        self.options = RebuildOptions(
            builder=builder, model=model, delivery=delivery, batch_size=batch_size, max_in_flight=max_in_flight,
            executor=executor, verbose=verbose, max_capture_bytes=max_capture_bytes, version_key=version_key,
        )
        super().__init__(_parsed(capture_dirs), address=address)
        self.keeps_spares = spares

    def __enter__(self) -> Rebuilder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def executor(self) -> str:
        return self.options.executor

    def choose(
        self, rollout_ids: Sequence[str] | None = None, *, skip_retired: bool = False, writes_shards: bool = False
    ) -> ExecutorChoice:
        """Which executor a call with these ids would run on, and why."""
        return self.decide(rollout_ids, self.options.but(skip_retired=skip_retired), "shards" if writes_shards else "rows")

    def _call_options(
        self, skip_retired: bool, builder: str | None, model: str | None, delivery: str | None
    ) -> RebuildOptions:
        return self.options.but(builder=builder, model=model, delivery=delivery, skip_retired=skip_retired)

    def iter_rebuild(
        self,
        rollout_ids: Sequence[str] | None = None,
        *,
        skip_retired: bool = False,
        progress: Callable[[Progress], None] | None = None,
        shard_dir: str | None = None,
        builder: str | None = None,
        model: str | None = None,
        delivery: str | None = None,
    ) -> Iterator[Any]:
        """Rebuild in bounded memory, yielding Arrow tables (or, with `shard_dir`, the
        ShardInfo of each shard written there) whose rows, concatenated, are in the order
        of `rollout_ids` (sorted ids when listing)."""
        options = self._call_options(skip_retired, builder, model, delivery)
        yield from self.run(rollout_ids, options, progress=progress, shard_dir=shard_dir)

    def rebuild(
        self,
        rollout_ids: Sequence[str] | None = None,
        *,
        skip_retired: bool = False,
        progress: Callable[[Progress], None] | None = None,
        builder: str | None = None,
        model: str | None = None,
        delivery: str | None = None,
    ) -> pa.Table:
        """The rows of `rollout_ids` (every listed rollout when None) as one Arrow table."""
        options = self._call_options(skip_retired, builder, model, delivery)
        return _concat(self.run(rollout_ids, options, progress=progress), options)

    async def rebuild_async(
        self,
        rollout_ids: Sequence[str] | None = None,
        *,
        refs: bool = False,
        skip_retired: bool = False,
        progress: Callable[[Progress], None] | None = None,
        builder: str | None = None,
        model: str | None = None,
        delivery: str | None = None,
    ) -> pa.Table | list[Any]:
        """`rebuild` without blocking the event loop, so a trainer can overlap the next
        step's rebuild with training. With refs=True, the ObjectRefs of the batches'
        Arrow tables (in row order) instead, built with the same options: hand them to
        training workers, and the rows never pass through this process.

        The work runs in a worker thread, but Ray is never started there: an embedded
        Ray dies with the thread that started it (see `raycap.cluster.connect`), which
        would leave the refs unfetchable once the pool thread ends. A call that needs
        Ray connects first, in the caller's thread (blocking the event loop for that
        first connection only); off the main thread it refuses to start an embedded Ray."""
        options = self._call_options(skip_retired, builder, model, delivery)
        ids = checked_rollout_ids(rollout_ids)
        if refs:
            connect_here(self.address, caller="rebuild_async")
            return await asyncio.to_thread(Session.refs, self, ids, options)
        # Deciding may stat the captures: off the event loop, like the work.
        choice: ExecutorChoice | None = await asyncio.to_thread(self.decide, ids, options)
        if choice.executor != "local" and not ray.is_initialized():
            connect_here(self.address, caller="rebuild_async")
            choice = None  # decided again by run, with Ray up (the first call may build here alongside it)
        return await asyncio.to_thread(lambda: _concat(self.run(ids, options, progress=progress, choice=choice), options))

    def rebuild_refs(
        self,
        rollout_ids: Sequence[str] | None = None,
        *,
        skip_retired: bool = False,
        builder: str | None = None,
        model: str | None = None,
        delivery: str | None = None,
    ) -> list[Any]:
        """The ObjectRefs of the batches' Arrow tables, in row order (always on Ray); see `Session.refs`."""
        return self.refs(rollout_ids, self._call_options(skip_retired, builder, model, delivery))

    def list_rollouts(self, *, skip_retired: bool = False, executor: str | None = None) -> list[str]:
        """The sorted rollout ids with capture files in any of the directories."""
        return super().list_rollouts(skip_retired=skip_retired, executor=executor or self.executor)

    def retire(
        self,
        output: str | os.PathLike,
        *,
        on_shard: OnShard | None = None,
        executor: str | None = None,
        manifest: Manifest | None = None,
        lock: OutputLock | None = None,
    ) -> RetireReport:
        """Drop the exact snapshots of the committed output's successful, unmasked rows
        (see `Session.retire`)."""
        return super().retire(
            output, on_shard=on_shard, executor=executor or self.executor, manifest=manifest, lock=lock
        )


def _parsed(specs: Iterable[Any]) -> tuple[CaptureDir, ...]:
    return specs if isinstance(specs, tuple) and all(isinstance(d, CaptureDir) for d in specs) else capture_dirs(specs)


def _concat(results: Iterable[pa.Table], options: RebuildOptions) -> pa.Table:
    tables = list(results)
    return pa.concat_tables(tables) if tables else schema_of(options.delivery, options.version_key).empty_table()


# -- the module-level API: thin wrappers over one cached session per directory list --------

_SESSIONS: dict[tuple, Session] = {}
_SESSIONS_LOCK = threading.Lock()
MAX_SESSIONS = 16


def session(capture_dirs: Iterable[Any], *, address: str | None = None) -> Session:
    """The cached session of these directories (placement and actors reused across calls)."""
    dirs = _parsed(capture_dirs)
    key = (tuple(d.label for d in dirs), address)
    with _SESSIONS_LOCK:
        found = _SESSIONS.pop(key, None)
        if found is None:
            found = Session(dirs, address=address)
        _SESSIONS[key] = found  # most recently used last
        while len(_SESSIONS) > MAX_SESSIONS:
            del _SESSIONS[next(iter(_SESSIONS))]
    return found


def iter_rebuild(
    capture_dirs: Iterable[Any],
    rollout_ids: Sequence[str] | None,
    options: RebuildOptions,
    *,
    address: str | None = None,
    progress: Callable[[Progress], None] | None = None,
    shard_dir: str | None = None,
    choice: ExecutorChoice | None = None,
) -> Run:
    """`Session.run` on the cached session of these directories."""
    return session(capture_dirs, address=address).run(
        rollout_ids, options, progress=progress, shard_dir=shard_dir, choice=choice
    )


def rebuild(
    capture_dirs: Iterable[Any],
    rollout_ids: Sequence[str] | None,
    options: RebuildOptions,
    *,
    address: str | None = None,
    progress: Callable[[Progress], None] | None = None,
    choice: ExecutorChoice | None = None,
) -> pa.Table:
    """`iter_rebuild`'s tables as one table (see `raycap.rebuild` for the contract)."""
    run = iter_rebuild(capture_dirs, rollout_ids, options, address=address, progress=progress, choice=choice)
    return _concat(run, options)


def retire(
    capture_dirs: Iterable[Any] | str | os.PathLike,
    output: str | os.PathLike | Iterable[Any],
    *,
    address: str | None = None,
    on_shard: OnShard | None = None,
    executor: str = "auto",
) -> RetireReport:
    """Drop the exact snapshots of a committed output's successful, unmasked rows.

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
    return session(capture_dirs, address=address).retire(output, on_shard=on_shard, executor=executor)  # type: ignore[arg-type]


def list_rollouts(
    capture_dirs: Iterable[Any], *, skip_retired: bool = False, address: str | None = None, executor: str = "auto"
) -> list[str]:
    """The sorted rollout ids with capture files in any of the directories."""
    return session(capture_dirs, address=address).list_rollouts(skip_retired=skip_retired, executor=executor)


def clear(capture_dirs: Iterable[Any], rollout_ids: Iterable[str], *, address: str | None = None) -> list[str]:
    """Delete the captures of these rollouts in every directory (on Ray); returns error texts."""
    return session(capture_dirs, address=address).clear(rollout_ids)


def sweep(capture_dirs: Iterable[Any], older_than_seconds: float, *, address: str | None = None) -> dict[str, int]:
    """Remove retired tombstones older than the cutoff (on Ray); count per directory."""
    return session(capture_dirs, address=address).sweep(older_than_seconds)
