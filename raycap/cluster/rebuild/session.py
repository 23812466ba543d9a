"""The rebuild session on Ray: capture directories in, Arrow rows (or shards) out.

A `Session` holds what is worth keeping between calls on one list of capture
directories, and nothing else: placement, the node actors and the cluster's CPU count,
found on first use, so a call costs in proportion to its ids (the training step's case),
not to the directories' history. It never holds a caller's options: every call brings
its own `RebuildOptions`, so two calls on one session with different options each build
with theirs. `session` caches one per directory list; `raycap.runs.rebuilder.Rebuilder`
is a session that users make.

Which executor a call gets is decided once, by `raycap.runs.dispatch`; a session given a
call runs it with the local executor (`raycap.rows.local`), the cold first-call plan
(`cold`) or the scheduler (`scheduler`, builder tasks in `task`). Nothing fails the
whole rebuild because of one rollout (see `raycap.rows.batch` and `scheduler`); only a
directory that cannot be placed or started (before any work, see `fleet`), and one that
cannot be listed, raise.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Iterable, Iterator, Sequence

import pyarrow as pa
import ray

from raycap.capture.directory import CaptureDir, capture_dirs
from raycap.capture.spares import MAX_SPARES, SparePool
from raycap.cluster.nodes.fleet import Fleet, first_use, fleet, prewarm, token_source, unwarm
from raycap.cluster.plumbing.connect import connect, ray_session
from raycap.cluster.plumbing.failures import cause_text
from raycap.cluster.plumbing.placement import local_path
from raycap.cluster.rebuild.cold import run_cold
from raycap.cluster.rebuild.driver_refs import node_refs
from raycap.cluster.rebuild.scheduler import BatchScheduler, plan_ids
from raycap.cluster.rebuild.shared_output import check_shared_output
from raycap.cluster.rebuild.step_split import StepSplit
from raycap.output.shards import shard_writer
from raycap.rows.arrow import retirable  # noqa: F401 - part of this module's API for tests
from raycap.rows.batch import schema_of
from raycap.rows.executor import ExecutorChoice, Kind, RayState, Request, decide
from raycap.rows.local import Progress, iter_local, local_ids
from raycap.rows.options import RebuildOptions, checked_rollout_ids
from raycap.rows.run import Run

__all__ = [
    "Session",
    "check_shared_output",
    "connect",
    "fleet",
    "iter_rebuild",
    "rebuild",
    "session",
    "token_source",
]

logger = logging.getLogger(__name__)


class Session:
    """Placement and the node actors of one list of capture directories, kept.

    They are found on first use and again only when a node serving a directory is lost,
    or this process is connected to another Ray session (a restarted head, a new
    cluster, a new connection: see `raycap.cluster.plumbing.connect.ray_session`): nothing found
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
        self._split = StepSplit()  # how a step's ids are cut between this process and tasks
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
            yield from iter_local(self.dirs, ids, options, write=shard_writer(shard_dir), progress=progress, spares=spares)
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
            spares=self._spare_pool(placed) if ids is not None else None, split=self._split,
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
            # Each node builds its own: one call per node (raycap.cluster.rebuild.driver_refs).
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
