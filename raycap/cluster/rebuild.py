"""The distributed rebuild: capture directories in, Arrow rows (or dataset shards) out.

A `Rebuilder` is a session over a list of capture directories: placement and the node
actors are found on its first call and kept, so a call costs in proportion to its ids
(the training step's case), not to the directories' history. `rebuild`, `iter_rebuild`,
`retire`, `list_rollouts`, `clear` and `sweep` are thin wrappers over a cached session.

A call cuts its rollouts into windows, each built by one builder task:

- When every directory is served from one node (one machine, or shared storage), the
  task runs there and freezes its own window in place: no round trip before building,
  and the freezes of different windows overlap.
- Otherwise the driver asks each directory's actor to freeze a chunk of ids (those it
  holds, when listing; when not, each actor freezes only the ids it holds), cuts the
  chunk into windows by frozen bytes, and hands each task the frozen identities of
  every directory holding part of its window. The task reads the frozen bytes itself on
  the directory's node, or through the actor elsewhere.

Either way a task receives all parts of its rollouts and yields their rows in order, so
the rows over several directories equal the rows over their merged directory, in both
deliveries. A bounded number of windows is in flight, and rows come back as Arrow
tables, or, with `shard_dir`, are written as Parquet shards where they are built and
only their metadata comes back.

Nothing fails the whole rebuild because of one rollout: a bad rollout is a masked row
(see `raycap.batch`); a builder task whose worker dies is retried by Ray; an actor that
dies is restarted from its files (freeze is idempotent). A directory whose node is gone
fails its pending work at once, as masked rows naming the directory and saying that a
rebuild later is safe; so does an actor gone for good. The session then places its
directories again on the next call. Only two failures raise: a directory that cannot be
placed or started (before any work, see `fleet`), and one that cannot be listed.

`retire` drops the snapshots of a committed output's successful, unmasked rows, shard by
shard. Only committed rows can be retired from: dropping first could lose a capture
whose trajectory was never written.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import pyarrow as pa
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycap.arrow import RETIRE_COLUMNS, retirable
from raycap.batch import (
    DELIVERIES,
    Shipped,
    build_batch,
    build_in_runs,
    cut,
    failed_rows,
    freeze_in,
    read_in,
    schema_of,
)
from raycap.builders import BUILDERS
from raycap.cluster.actor import ActorTokenSource, CaptureNodeActor, DirectoryHandle, actor_name
from raycap.cluster.placement import (
    MARKER_PREFIX,
    CaptureDir,
    _ask,
    _remove_markers,
    _seen_markers,
    _write_marker,
    local_path,
    locate,
)
from raycap.consumer import error_text
from raycap.local import (
    EXECUTORS,
    LOCAL_BATCH_ROLLOUTS,
    LOCAL_MAX_BYTES,
    ExecutorChoice,
    FreezeAhead,
    Progress,
    build_local_window,
    capture_bytes,
    choose_without_ray,
    iter_local,
    listed_ids,
    plain_local_paths,
)
from raycap.store import FrozenCapture, TokenCaptureStore

logger = logging.getLogger(__name__)

ACTOR_START_TIMEOUT_S = 120.0
ACTOR_MAX_RESTARTS = 8
ACTOR_START_ATTEMPTS = 3
TASK_MAX_RETRIES = 3
EMBEDDED_OBJECT_STORE_BYTES = 1 << 30
FAULT_ENV = "RAYCAP_FAULT_EXIT_ONCE"  # test hook: path of a marker file; see _build_batch


REACH_TIMEOUT_S = 10.0


def _resolve_auto() -> str:
    """Where address="auto" points: RAY_ADDRESS, else the cluster last started here."""
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    current = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp/ray"), "ray_current_cluster")
    try:
        with open(current) as handle:
            return handle.read().strip()
    except OSError:
        raise ConnectionError(
            "address 'auto' found no running Ray cluster (RAY_ADDRESS is unset and no cluster was "
            "started on this machine); start one with `ray start --head`, or run embedded"
        ) from None


def _check_reachable(address: str) -> None:
    """Fail fast when nothing listens at the cluster's address: ray.init would wait forever."""
    target = _resolve_auto() if address == "auto" else address
    if "://" in target:
        return  # a Ray client or dashboard address: reached by its own protocol
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return  # let Ray report an address it cannot parse
    try:
        socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as exc:
        stale = " (the address 'auto' found is stale)" if address == "auto" else ""
        raise ConnectionError(
            f"no Ray cluster answers at {target}{stale}: {exc}; start the cluster, or fix the address"
        ) from None


def connect(address: str | None = None, *, num_cpus: int | None = None) -> None:
    """Connect to Ray once: to `address` ("auto" under `ray job submit`), to the cluster
    named by RAY_ADDRESS, or else start an embedded local instance."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address or os.environ.get("RAY_ADDRESS"):
        _check_reachable(address or os.environ["RAY_ADDRESS"])
        # A job's driver must not pass resources to init: the cluster already has them.
        ray.init(address=address or None, logging_level=logging.WARNING)
        return
    # "local" starts a private instance even when a `ray start` cluster runs on this
    # machine: connecting to it must be asked for (address="auto" or RAY_ADDRESS).
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        object_store_memory=EMBEDDED_OBJECT_STORE_BYTES,
        logging_level=logging.WARNING,
    )


@dataclass
class Fleet:
    """The directories to serve, in the order given, with their nodes and handles."""

    dirs: list[CaptureDir]
    nodes: list[str]
    handles: list[DirectoryHandle]

    def by_label(self) -> dict[str, DirectoryHandle]:
        return {d.label: h for d, h in zip(self.dirs, self.handles)}

    def labels_of_actor(self, name: str) -> list[str]:
        """The directories served by the actor of this name."""
        return [d.label for d, node in zip(self.dirs, self.nodes) if actor_name(node) == name]


def _start(node: str) -> Any:
    # get_if_exists reuses the live actor of this node, whichever driver started it, and
    # replaces one that died for good, so each call gets a serving actor (see _Kept for
    # what keeps it alive between calls).
    return CaptureNodeActor.options(
        name=actor_name(node),
        get_if_exists=True,
        num_cpus=0,
        max_restarts=ACTOR_MAX_RESTARTS,
        max_task_retries=ACTOR_MAX_RESTARTS,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote()


class _Kept:
    """The node actors this driver has used, held for as long as it runs.

    Ray destroys an actor once the handle its creation returned is gone (handles found
    by name do not count); without this reference every rebuild would start its nodes'
    actors again, and could be handed one that is being destroyed. The creation handle
    is kept until its actor is replaced; handles of an earlier Ray session are let go."""

    job: Any = None
    actors: dict[str, Any] = {}

    @classmethod
    def update(cls, actors: dict[str, Any]) -> None:
        job = ray.get_runtime_context().get_job_id()
        if job != cls.job:
            cls.job, cls.actors = job, {}
        for node, actor in actors.items():
            kept = cls.actors.get(node)
            if kept is None or kept._actor_id != actor._actor_id:
                cls.actors[node] = actor


def _node_actors(nodes: list[str]) -> dict[str, Any]:
    """A serving actor on each node, started when the node has none yet."""
    actors = {node: _start(node) for node in nodes}
    deadline = time.monotonic() + ACTOR_START_TIMEOUT_S
    for attempt in range(ACTOR_START_ATTEMPTS):
        pings = {node: actor.node_id.remote() for node, actor in actors.items()}
        ready, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=max(0.0, deadline - time.monotonic()))
        ready_set = set(ready)
        retry = []
        for node, ping in pings.items():
            if ping not in ready_set:
                for other, other_ping in pings.items():
                    if other_ping not in ready_set:
                        ray.kill(actors[other], no_restart=True)  # never leave an actor pending
                raise TimeoutError(
                    f"the raycap actor for node {node} did not start within "
                    f"{ACTOR_START_TIMEOUT_S:.0f} s; check that the node is alive and can start a worker"
                )
            try:
                ray.get(ping)
            except ray.exceptions.RayError as exc:
                dead = isinstance(exc, ray.exceptions.ActorDiedError) and not exc.actor_init_failed
                if dead and attempt + 1 < ACTOR_START_ATTEMPTS:
                    # A handle to an actor killed for good just before this call, whose
                    # name was not yet released: asking again starts a fresh actor.
                    retry.append(node)
                    continue
                raise RuntimeError(f"the raycap actor for node {node} could not start: {_cause_text(exc)}") from exc
        if not retry:
            break
        time.sleep(0.2 * (attempt + 1))
        for node in retry:
            actors[node] = _start(node)
    _Kept.update(actors)
    return actors


@ray.remote(num_cpus=1, max_retries=0)
def _warm() -> None:
    """Build a tiny in-memory rollout in both deliveries: loads this module into a worker
    and runs, once, what builder tasks would otherwise initialise on their first batch."""
    line = (
        b'{"generation_log_probs":[-0.5],"generation_token_ids":[2],"model_call_id":"c",'
        b'"prompt_token_ids":[1],"rollout_id":"warm-up"}\n'
    )
    frozen = FrozenCapture("warm-up", "", 0, False, line, len(line))
    for delivery in DELIVERIES:
        build_batch(["warm-up"], [[("", frozen)]], builder="prefix_merging", model="", delivery=delivery)
    # Held a moment, so that the warm-ups of one call land on distinct workers (an
    # idle warm worker would otherwise take them all, and the others start cold later).
    # Long enough for Ray to start the missing worker processes, short enough not to
    # keep a warm worker from the next call: 1 s held the call right after a first call
    # back by a quarter of a second.
    time.sleep(WARM_HOLD_S)


WARM_HOLD_S = 0.3
_WARMED: set[Any] = set()  # Ray jobs (driver sessions) whose builder workers have been used


def _first_use() -> bool:
    """Whether this driver has not built on this Ray yet (its workers would start cold)."""
    return ray.get_runtime_context().get_job_id() not in _WARMED


def _prewarm(cpus: int) -> None:
    """On a driver's first use of a Ray session, start the driver node's actor while
    placement is still being worked out. Nothing waits for it here."""
    job = ray.get_runtime_context().get_job_id()
    if job in _WARMED:
        return
    _WARMED.add(job)
    here = ray.get_runtime_context().get_node_id()
    _Kept.update({here: _start(here)})


def fleet(capture_dirs: Sequence[Any]) -> Fleet:
    """Locate the directories and start (or reuse) the actor of each of their nodes.

    Raises ValueError when a directory is on no alive node (see `placement`), RuntimeError
    when an actor cannot be created or a directory cannot be opened on its node,
    TimeoutError when an actor does not start in time; no actor is left pending."""
    placed = locate(capture_dirs)
    dirs = [d for d, _ in placed]
    nodes = [node for _, node in placed]
    actors = _node_actors(list(dict.fromkeys(nodes)))
    handles = [DirectoryHandle(actors[node], d.path) for d, node in placed]
    for d, opened in zip(dirs, [h.call("open") for h in handles]):
        try:
            ray.get(opened)
        except ray.exceptions.RayError as exc:
            raise RuntimeError(
                f"capture directory {d.label} cannot be served: {_cause_text(exc)}; "
                "check that the directory exists and is readable on its node"
            ) from exc
    return Fleet(dirs, nodes, handles)


def token_source(capture_dir: Any, *, address: str | None = None) -> ActorTokenSource:
    """The TokenSource of one capture directory, served by its pinned actor."""
    connect(address)
    return ActorTokenSource(fleet([capture_dir]).handles[0])


@dataclass(frozen=True)
class _Source:
    """Where a batch's frozen parts come from: a directory, its node and its actor."""

    label: str
    path: str
    node: str
    handle: DirectoryHandle


def _with_data(source: _Source, batch: list, here: str) -> list:
    """Fill in the bytes of freezes made with read=False: read locally when this task
    runs on the directory's node, else ask the directory's actor for them."""
    wanted = [i for i, part in enumerate(batch) if isinstance(part, FrozenCapture) and part.size > len(part.data)]
    if not wanted:
        return batch
    if source.node == here:
        return read_in(TokenCaptureStore(local_path(source.path), create=False), batch)
    batch = list(batch)
    for i, part in zip(wanted, ray.get(source.handle.call("read_batch", [batch[i] for i in wanted]))):
        batch[i] = part
    return batch


def _freeze_here(rollout_ids: list[str], sources: list[_Source], here: str) -> list[list]:
    """A window's freezes, made by its builder task (identities and sizes only): in
    place on the directories of this node (no round trip), through the actor elsewhere.
    With several sources each is asked for the ids it holds; an id no directory holds
    is frozen in the first one, like the single-rollout API."""
    only_held = len(sources) > 1

    def freeze(source: _Source, ids: list[str], held_only: bool) -> list:
        if source.node != here:
            return ray.get(source.handle.call("freeze_batch", ids, False, held_only))
        store = TokenCaptureStore(local_path(source.path), create=False)
        return freeze_in(store, ids, held_only=held_only, threads=FREEZE_THREADS)

    frozen = [freeze(source, rollout_ids, only_held) for source in sources]
    nowhere = [i for i in range(len(rollout_ids)) if all(batch[i] is None for batch in frozen)]
    if nowhere:
        for i, part in zip(nowhere, freeze(sources[0], [rollout_ids[i] for i in nowhere], False)):
            frozen[0][i] = part
    return frozen


def _build_parts(
    rollout_ids: list[str], sources: list[_Source], frozen: list[list], here: str, options: "_Options"
) -> pa.Table:
    """Read and build a window's frozen parts (see `raycap.batch.build_in_runs`)."""
    return build_in_runs(
        rollout_ids, [s.label for s in sources], frozen, lambda k, batch: _with_data(sources[k], batch, here),
        builder=options.builder, model=options.model, delivery=options.delivery, verbose=options.verbose,
        version_key=options.version_key,
    )


@ray.remote(num_cpus=1, max_retries=TASK_MAX_RETRIES)
def _build_window(
    window: int,
    rollout_ids: list[str],
    sources: list[_Source],
    frozen: list[list] | None,
    options: "_Options",
    shard_dir: str | None,
) -> Any:
    """Build one window: `frozen[k][i]` is source k's freeze of rollout i (None where
    that directory does not hold it); `frozen` None asks the task to freeze. Returns the Arrow rows, or with `shard_dir` the
    ShardInfo of the shard the rows were written to."""
    marker = os.environ.get(FAULT_ENV)
    if marker and not os.path.exists(marker):
        # Fault injection for tests: the first task to get here dies like a lost worker.
        open(marker, "w").close()
        os._exit(1)
    here = ray.get_runtime_context().get_node_id()
    if frozen is None:
        frozen = _freeze_here(rollout_ids, sources, here)
    table = _build_parts(rollout_ids, sources, frozen, here, options)
    if shard_dir is None:
        return Shipped(table)
    from raycap.output import write_shard

    return write_shard(local_path(shard_dir), window, table)


def _cause_text(exc: BaseException) -> str:
    """"<Type>: <reason>" of a Ray failure, with the original exception's type: Ray's
    wrappers put task names, tracebacks and actor details around the one line that
    says why."""
    name, text = type(exc).__name__, str(exc)
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(cause, BaseException):
        name = type(cause).__name__
        if str(cause).strip():
            text = str(cause)
        else:
            text = "\n".join(text.splitlines()[1:])  # the first line names the task and pid
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return name
    # An actor failure ends with the reason ("... killed by `ray.kill`", the creation
    # task's exception); anything else starts with it.
    reason = lines[-1] if isinstance(exc, ray.exceptions.RayActorError) else lines[0]
    return f"{name}: {reason}"


_SAFE_LATER = "nothing was dropped, so rebuilding these rollouts later is safe"

# Failures that mean a directory's actor or node is gone, whatever wrapper they come in.
_LOST = (
    ray.exceptions.RayActorError,
    ray.exceptions.ActorUnschedulableError,
    ray.exceptions.NodeDiedError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.WorkerCrashedError,
)


def _lost_node_error(labels: Sequence[str], nodes: Sequence[str]) -> str:
    where = ", ".join(labels)
    ids = ", ".join(f"{node[:12]}.." for node in dict.fromkeys(nodes))
    return f"NodeDiedError: the node ({ids}) serving capture directory {where} is gone; {_SAFE_LATER}"


def _is_lost(exc: BaseException) -> bool:
    cause = getattr(exc, "cause", None)
    return isinstance(exc, _LOST) or isinstance(cause, _LOST)


@dataclass(frozen=True)
class _Options:
    """What every builder task of a call needs besides its rollouts."""

    builder: str
    model: str
    delivery: str
    verbose: bool = False
    version_key: str | None = None


MAX_BATCH_ROLLOUTS = 64
MIN_BATCH_BYTES = 1 << 20
FREEZE_CHUNK = 1024
DIRECT_MIN_PER_TASK = 32
COLD_WINDOWS_PER_CPU = 8  # windows per CPU in a cold call: finer costs more per window than it balances
FREEZE_THREADS = 4
LIVENESS_CHECK_S = 0.5


@dataclass
class _Window:
    """A run of consecutive rollouts built by one task, and what it depends on."""

    index: int
    ids: list[str]
    sources: list[_Source]
    nodes: set[str]
    frozen: list[list] | None


class _Lost(Exception):
    """A directory's node is gone: its pending work fails at once."""

    def __init__(self, nodes: set[str]):
        super().__init__(nodes)
        self.nodes = nodes


def _dead(nodes: set[str]) -> set[str]:
    if not nodes:
        return set()
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    return {node for node in nodes if node not in alive}


def _cancel(ref: Any) -> None:
    try:
        ray.cancel(ref)
    except Exception:  # noqa: BLE001 - the result is abandoned either way
        pass


def _wait_all(refs: list, nodes: set[str]) -> None:
    """Wait for `refs`, checking every LIVENESS_CHECK_S that `nodes` are alive: a
    restart pinned to a dead node can never be scheduled, so waiting on it is pointless."""
    pending = list(refs)
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=LIVENESS_CHECK_S)
        if pending:
            dead = _dead(nodes)
            if dead:
                raise _Lost(dead)


class _Call:
    """One rebuild call on a fleet: freeze chunk by chunk, cut windows by bytes, keep a
    bounded number of builder tasks in flight, yield results in rollout order."""

    def __init__(
        self,
        flt: "Fleet",
        ids: list[str],
        holders: list[tuple[int, ...]] | None,
        options: _Options,
        *,
        cpus: int,
        batch_size: int | None,
        max_in_flight: int | None,
        shard_dir: str | None,
        progress: Callable[[Progress], None] | None,
    ):
        self.flt, self.ids, self.holders, self.options = flt, ids, holders, options
        self.cpus, self.batch_size, self.shard_dir, self.progress = cpus, batch_size, shard_dir, progress
        self.max_in_flight = max_in_flight or 2 * cpus + 2
        self.dead: set[str] = set()
        self.state = Progress(total=len(ids))
        self.windows: list[_Window] = []
        self.labels = [d.label for d in flt.dirs]
        self.actor_died = False
        self.target_bytes: int | None = None
        # Freezing runs ahead of building by chunks: small enough that the first tasks
        # start early, large enough that a step's ids are one round trip per directory.
        if batch_size is not None:
            self.chunk = batch_size * self.max_in_flight
        else:
            self.chunk = max(MAX_BATCH_ROLLOUTS, min(FREEZE_CHUNK, -(-len(ids) // 4)))

    # -- freezing ------------------------------------------------------------------------

    def _sources(self, dir_indices: Iterable[int]) -> list[_Source]:
        flt = self.flt
        return [_Source(flt.dirs[d].label, flt.dirs[d].path, flt.nodes[d], flt.handles[d]) for d in dir_indices]

    def _freeze_chunk(self, start: int, stop: int) -> None:
        """Freeze ids[start:stop] in the directories that hold them (all directories,
        asked to skip ids they do not hold, when the holders are not known) and cut the
        chunk into windows by frozen bytes."""
        ids = self.ids[start:stop]
        flt = self.flt
        n_dirs = len(flt.dirs)
        asked: dict[int, list[int]] = defaultdict(list)  # directory -> positions in chunk
        if self.holders is None:
            for d in range(n_dirs):
                asked[d] = list(range(len(ids)))
        else:
            for i, held in enumerate(self.holders[start:stop]):
                for d in held:
                    asked[d].append(i)
        only_held = self.holders is None and n_dirs > 1
        parts: list[dict[int, Any]] = [{} for _ in ids]
        self._freeze_into(parts, ids, asked, only_held)
        # An id no directory holds is frozen in the first directory, like the
        # single-rollout API: its row says "capture contains no token records".
        nowhere = [i for i, got in enumerate(parts) if not any(p is not None for p in got.values())]
        if nowhere:
            self._freeze_into(parts, ids, {0: nowhere}, False)
        sizes = [
            sum(p.size for p in got.values() if isinstance(p, FrozenCapture) and p.size > 0) for got in parts
        ]
        if self.batch_size is not None:
            runs = [list(range(i, min(i + self.batch_size, len(ids)))) for i in range(0, len(ids), self.batch_size)]
        else:
            if self.target_bytes is None:
                # About a sixteenth of each CPU's share of the whole call (estimated from
                # the first chunk): enough tasks to balance rollouts of very different
                # sizes, few enough that per-task overhead stays negligible.
                estimate = sum(sizes) * len(self.ids) // max(1, len(ids))
                self.target_bytes = max(estimate // (16 * self.cpus), MIN_BATCH_BYTES)
            runs = cut(sizes, self.target_bytes, MAX_BATCH_ROLLOUTS)
        for run in runs:
            holding = sorted({d for i in run for d, p in parts[i].items() if p is not None})
            sources = self._sources(holding)
            frozen = [[parts[i].get(d) for i in run] for d in holding]
            # The nodes the task needs: those with frozen bytes still to read.
            nodes = {s.node for s, batch in zip(sources, frozen) if any(isinstance(p, FrozenCapture) for p in batch)}
            window = _Window(len(self.windows), [ids[i] for i in run], sources, nodes, frozen)
            self.windows.append(window)

    def _freeze_into(self, parts: list[dict[int, Any]], ids: list[str], asked: dict[int, list[int]], only_held: bool) -> None:
        flt = self.flt
        live = {d: positions for d, positions in asked.items() if flt.nodes[d] not in self.dead}
        for d, positions in asked.items():
            if d not in live:
                for i in positions:
                    parts[i][d] = self._lost_text_for([d])
        refs = {
            d: flt.handles[d].call("freeze_batch", [ids[i] for i in positions], False, only_held)
            for d, positions in live.items()
        }
        try:
            _wait_all(list(refs.values()), {flt.nodes[d] for d in live})
        except _Lost as lost:
            self._mark_dead(lost.nodes)
        for d, ref in refs.items():
            positions = live[d]
            if flt.nodes[d] in self.dead:
                _cancel(ref)
                text = self._lost_text_for([d])
                outcome = [text] * len(positions)
            else:
                try:
                    outcome = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - the directory's rollouts become masked rows
                    outcome = [self._error_for(exc, [d])] * len(positions)
            for i, part in zip(positions, outcome):
                parts[i][d] = part

    # -- failures ------------------------------------------------------------------------

    def _mark_dead(self, nodes: set[str]) -> None:
        if nodes - self.dead:
            labels = [label for label, node in zip(self.labels, self.flt.nodes) if node in nodes]
            logger.warning("node(s) %s serving %s are gone; their pending rollouts are masked", sorted(nodes), labels)
        self.dead |= nodes

    def _lost_text_for(self, dir_indices: Sequence[int]) -> str:
        return _lost_node_error([self.labels[d] for d in dir_indices], [self.flt.nodes[d] for d in dir_indices])

    def _lost_text(self, window: _Window) -> str:
        lost = [s for s in window.sources if s.node in self.dead and s.node in window.nodes]
        return _lost_node_error([s.label for s in lost], [s.node for s in lost])

    def _error_for(self, exc: BaseException, dir_indices: Sequence[int]) -> str:
        """The error of rows whose freeze or batch failed as a whole."""
        nodes = {self.flt.nodes[d] for d in dir_indices}
        if _is_lost(exc):
            dead = _dead(nodes)
            if dead:
                self._mark_dead(dead)
                return self._lost_text_for([d for d in dir_indices if self.flt.nodes[d] in dead])
            if isinstance(exc, ray.exceptions.RayActorError) or isinstance(getattr(exc, "cause", None), ray.exceptions.RayActorError):
                self.actor_died = True
                kind, _, reason = _cause_text(exc).partition(": ")
                where = ", ".join(self.labels[d] for d in dir_indices)
                return f"{kind}: the actor serving capture directory {where} died and was not restarted ({reason}); {_SAFE_LATER}"
            return f"{_cause_text(exc)} (the builder task of this batch failed {TASK_MAX_RETRIES + 1} times); {_SAFE_LATER}"
        if isinstance(exc, ray.exceptions.RayTaskError):
            return f"{_cause_text(exc)} (raised by the builder task of this batch)"
        return f"{_cause_text(exc)} (the builder task of this batch failed {TASK_MAX_RETRIES + 1} times)"

    def _window_error(self, exc: BaseException, window: _Window) -> str:
        indices = [self.labels.index(s.label) for s in window.sources]
        return self._error_for(exc, indices)

    def _failed_result(self, window: _Window, error: str) -> Any:
        logger.warning(
            "batch of %d rollouts (%s..) failed, masking them: %s", len(window.ids), window.ids[0] if window.ids else "", error
        )
        dirs = [[s.label for s in window.sources]] * len(window.ids)
        table = failed_rows(window.ids, dirs, self.options.builder, self.options.model, error, self.options.delivery)
        if self.shard_dir is None:
            return table
        from raycap.output import write_shard

        return write_shard(self.shard_dir, window.index, table)

    # -- the loop ------------------------------------------------------------------------

    def _submit(self, window: _Window) -> Any:
        options = {}
        if len(window.nodes) == 1:
            # The builder prefers the node that holds the captures and then reads them
            # from disk itself; anywhere else it gets the bytes through the actor.
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(next(iter(window.nodes)), soft=True)
        task = _build_window.options(**options) if options else _build_window
        return task.remote(window.index, window.ids, window.sources, window.frozen, self.options, self.shard_dir)

    def _direct_windows(self) -> bool:
        """When every directory is served from one node, builder tasks freeze their own
        windows there: no round trip before building, and the freezes of different
        windows run in parallel. A window is cut by count (sizes are not known before
        freezing; the task then builds in runs bounded by bytes)."""
        nodes = set(self.flt.nodes)
        if len(nodes) != 1 or nodes & self.dead or not self.ids:
            return False
        sources = self._sources(range(len(self.flt.dirs)))
        n = len(self.ids)
        if self.batch_size is not None:
            parts = -(-n // self.batch_size)
        else:
            # A few windows per CPU for balance, none smaller than DIRECT_MIN_PER_TASK
            # rollouts (a 64-id step is one window per CPU) or larger than MAX_BATCH_ROLLOUTS.
            parts = max(1, min(4 * self.cpus, n // DIRECT_MIN_PER_TASK))
            parts = max(-(-n // MAX_BATCH_ROLLOUTS), self.cpus * -(-parts // self.cpus))
            parts = min(parts, n)
        step = -(-n // parts)
        for start in range(0, n, step):
            self.windows.append(_Window(len(self.windows), self.ids[start : start + step], sources, set(nodes), None))
        return True

    def run(self) -> Iterator[Any]:
        if self.progress:
            self.progress(self.state)
        pending: dict[Any, _Window] = {}
        results: dict[int, Any] = {}
        frozen_upto = len(self.ids) if self._direct_windows() else 0
        next_out = submitted = 0
        while frozen_upto < len(self.ids) or next_out < len(self.windows):
            # Freeze ahead while the queue of windows to submit is short.
            while frozen_upto < len(self.ids) and len(self.windows) - submitted < self.max_in_flight:
                stop = min(frozen_upto + self.chunk, len(self.ids))
                self._freeze_chunk(frozen_upto, stop)
                frozen_upto = stop
            while submitted < len(self.windows) and len(pending) < self.max_in_flight and submitted - next_out < 4 * self.max_in_flight:
                window = self.windows[submitted]
                submitted += 1
                if window.nodes & self.dead:
                    # Its captures' node is gone: fail it now instead of waiting on restarts
                    # that can never be scheduled.
                    results[window.index] = self._failed_result(window, self._lost_text(window))
                    self._advance(window)
                else:
                    pending[self._submit(window)] = window
            if pending:
                done, _ = ray.wait(list(pending), num_returns=1, timeout=LIVENESS_CHECK_S)
                if not done:
                    self._check_pending(pending, results)
                for ref in done:
                    window = pending.pop(ref)
                    try:
                        results[window.index] = ray.get(ref)
                    except Exception as exc:  # noqa: BLE001 - a lost batch becomes masked rows
                        results[window.index] = self._failed_result(window, self._window_error(exc, window))
                    del ref
                    self._advance(window)
            while next_out in results:
                yield results.pop(next_out)
                self.windows[next_out].frozen = []
                next_out += 1

    def refs(self) -> list[Any]:
        """Freeze everything and submit every window; the ObjectRefs of their results,
        in row order (a window lost up front is a ref to its masked rows)."""
        if not self._direct_windows():
            for start in range(0, len(self.ids), self.chunk):
                self._freeze_chunk(start, min(start + self.chunk, len(self.ids)))
        out = []
        for window in self.windows:
            if window.nodes & self.dead:
                out.append(ray.put(self._failed_result(window, self._lost_text(window))))
            else:
                out.append(self._submit(window))
        return out

    def _check_pending(self, pending: dict[Any, _Window], results: dict[int, Any]) -> None:
        """Fail at once the pending windows whose directories' nodes are gone."""
        dead = _dead({node for window in pending.values() for node in window.nodes})
        if not dead:
            return
        self._mark_dead(dead)
        for ref, window in list(pending.items()):
            if window.nodes & self.dead:
                del pending[ref]
                _cancel(ref)
                results[window.index] = self._failed_result(window, self._lost_text(window))
                self._advance(window)

    def _advance(self, window: _Window) -> None:
        self.state.done += len(window.ids)
        if self.progress:
            self.progress(self.state)


_BUILD_HERE = object()  # a cold task's window that the driver builds itself


class _ColdPlan:
    """The windows of a cold call, shared by the driver (front) and a feeder thread
    that keeps builder tasks busy from the back; results are handed over in order."""

    def __init__(self, windows: list[list[str]], dirs: Sequence[Any], options: _Options, shard_dir: str | None, *, limit: int):
        self.windows = windows
        self.options = options
        self.shard_dir = shard_dir
        self.limit = limit
        self.here = ray.get_runtime_context().get_node_id()
        self.sources = [_Source(d.label, d.path, self.here, None) for d in dirs]
        self.front, self.back = 0, len(windows)
        self.results: dict[int, Any] = {}
        self.running: dict[Any, int] = {}  # refs of the tasks in flight, to their windows
        self.stopped = False
        self.changed = threading.Condition()
        self.task = _build_window.options(scheduling_strategy=NodeAffinitySchedulingStrategy(self.here, soft=True))

    def take_front(self) -> int | None:
        with self.changed:
            if self.front >= self.back:
                return None
            self.front += 1
            return self.front - 1

    def _take_back(self) -> int | None:
        with self.changed:
            if self.front >= self.back or self.stopped:
                return None
            self.back -= 1
            return self.back

    def settle(self, index: int, result: Any) -> None:
        with self.changed:
            self.results[index] = result
            self.changed.notify_all()

    def ready_from(self, index: int, *, wait: bool) -> list[Any]:
        """The results from `index` on that are in, in order; with wait, at least one."""
        with self.changed:
            if wait:
                self.changed.wait_for(lambda: index in self.results)
            out = []
            while index in self.results:
                out.append(self.results.pop(index))
                index += 1
            return out

    def stop(self) -> None:
        with self.changed:
            self.stopped = True

    def submit(self) -> None:
        """Send tasks for windows from the back until `limit` run. A window whose task
        cannot be sent is the driver's."""
        while len(self.running) < self.limit and (index := self._take_back()) is not None:
            try:
                ref = self.task.remote(index, self.windows[index], self.sources, None, self.options, self.shard_dir)
            except BaseException:
                self.settle(index, _BUILD_HERE)
                raise
            self.running[ref] = index

    def feed(self) -> None:
        """The feeder thread: a task per window from the back while any are left."""
        try:
            while True:
                self.submit()
                if not self.running:
                    return
                done, _ = ray.wait(list(self.running), num_returns=1)
                for ref in done:
                    try:
                        result = ray.get(ref)
                    except Exception as exc:  # noqa: BLE001 - the driver builds it instead: nothing is lost
                        logger.debug("cold builder task for window %d failed (%s); building it here", self.running[ref], exc)
                        result = _BUILD_HERE
                    self.settle(self.running.pop(ref), result)
        except BaseException as exc:  # noqa: BLE001 - whatever this thread took, the driver builds
            self.build_here(exc)

    def build_here(self, exc: BaseException) -> None:
        """Tasks cannot be sent: the driver builds what they took, and the rest."""
        logger.debug("cold builder tasks stopped (%s); this process builds their windows", exc)
        self.stop()
        while self.running:
            self.settle(self.running.popitem()[1], _BUILD_HERE)


class Rebuilder:
    """A rebuild session over one list of capture directories.

    Placement (which node serves each directory), the node actors and the cluster's CPU
    count are found on first use and kept, so every later call costs in proportion to
    its rollout ids: a training step with 64 ids is one actor round trip per directory
    and one builder task, whatever the directories' history. They are found again only
    when a node serving a directory is lost, or Ray was restarted.

    `executor` picks where the work runs: "ray" (the cluster, or an embedded Ray started
    on first use), "local" (this process, one core, the same core code, identical rows;
    plain local paths only) or "auto" (default): local when no Ray is running or asked
    for and the input is small enough that building it here ends before an embedded Ray
    would have started, else Ray. `last_executor` says which ran, and why."""

    def __init__(
        self,
        capture_dirs: Sequence[Any],
        *,
        builder: str = "prefix_merging",
        model: str = "",
        delivery: str = "rollout",
        batch_size: int | None = None,
        max_in_flight: int | None = None,
        address: str | None = None,
        executor: str = "auto",
        verbose: bool = False,
        version_key: str | None = None,
    ) -> None:
        if executor not in EXECUTORS:
            raise ValueError(f"unknown executor {executor!r}; use one of: {', '.join(EXECUTORS)}")
        self.dirs = [CaptureDir.parse(d) for d in capture_dirs]
        if not self.dirs:
            raise ValueError("no capture directories given")
        self.defaults = self._options(builder, model, delivery, verbose, version_key)
        self.batch_size, self.max_in_flight = batch_size, max_in_flight
        self.address, self.executor = address, executor
        self.last_executor: ExecutorChoice | None = None
        self._fleet: Fleet | None = None
        self._job: Any = None
        self._cpus = 1
        self._placing = threading.Lock()
        self._warming: threading.Thread | None = None

    @staticmethod
    def _options(builder: str, model: str, delivery: str, verbose: bool, version_key: str | None = None) -> _Options:
        if delivery not in DELIVERIES:
            raise ValueError(f"unknown delivery {delivery!r}; use one of: {', '.join(DELIVERIES)}")
        if builder not in BUILDERS:
            raise ValueError(f"unknown builder {builder!r}; known builders: {', '.join(BUILDERS)}")
        return _Options(builder, model, delivery, verbose, version_key)

    # -- where the work runs ---------------------------------------------------------------

    def fleet(self) -> Fleet:
        """The placed directories and their actors, found on first use and kept."""
        connect(self.address)
        with self._placing:
            job = ray.get_runtime_context().get_job_id()
            if self._fleet is None or job != self._job:
                self._cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
                if job != self._job:
                    _prewarm(self._cpus)
                self._fleet, self._job = fleet(self.dirs), job
            return self._fleet

    def forget_placement(self) -> None:
        """Find placement and actors again on the next call (after a node was lost)."""
        with self._placing:
            self._fleet = None

    def choose(
        self, rollout_ids: Sequence[str] | None = None, *, skip_retired: bool = False, writes_shards: bool = False
    ) -> ExecutorChoice:
        """Which executor a call with these ids runs on, and why.

        A call that writes a dataset (`writes_shards`) or runs on a cluster reached by
        address never builds in this process on Ray's behalf: there the driver only
        commits, so that one driver can feed the whole cluster."""
        if self.executor == "ray":
            return ExecutorChoice("ray", "executor: ray was asked for")
        local = plain_local_paths(self.dirs)
        if self.executor == "local":
            if isinstance(local, str):
                raise ValueError(f"executor local reads capture directories in this process, but {local}; use executor ray")
            return ExecutorChoice("local", "executor: local was asked for")
        if not ray.is_initialized():
            choice = choose_without_ray(self.dirs, rollout_ids, skip_retired, self.address)
            if choice is not None:
                return choice
            return ExecutorChoice(
                "ray", local if isinstance(local, str) else "a Ray cluster address is given, or the input is large"
            )
        if self._fleet is not None or not _first_use():
            return ExecutorChoice("ray", "Ray is running and this driver's workers are up")
        if writes_shards or self.address or os.environ.get("RAY_ADDRESS"):
            return ExecutorChoice("ray", "Ray is running: builder tasks write the rows")
        if isinstance(local, str):
            return ExecutorChoice("ray", local)
        if len([n for n in ray.nodes() if n.get("Alive")]) > 1:
            # Other nodes may hold directories of their own under these paths.
            return ExecutorChoice("ray", "Ray is running with several nodes")
        ids = listed_ids(local, skip_retired) if rollout_ids is None else list(rollout_ids)
        total = capture_bytes(local, ids, LOCAL_MAX_BYTES)
        if total > LOCAL_MAX_BYTES:
            return ExecutorChoice("ray", f"more than {LOCAL_MAX_BYTES >> 20} MB of captures: Ray's cores pay")
        # The first call on this Ray: its workers would start now. This process builds
        # alongside them; the actors start after it, for the next call.
        return ExecutorChoice(
            "ray",
            f"first call on this Ray: this process built alongside Ray's builder tasks while their "
            f"workers started ({total / 1e6:.1f} MB of captures); the actors start after it",
            cold=True,
        )

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
        d = self.defaults
        options = self._options(
            d.builder if builder is None else builder,
            d.model if model is None else model,
            d.delivery if delivery is None else delivery,
            d.verbose,
            d.version_key,
        )
        choice = self.choose(rollout_ids, skip_retired=skip_retired, writes_shards=shard_dir is not None)
        self.last_executor = choice
        if choice.cold:
            yield from self._cold(rollout_ids, options, skip_retired, progress, shard_dir)
            return
        if choice.executor == "local":
            yield from self._local(rollout_ids, options, skip_retired, progress, shard_dir)
            return
        call = self._call(rollout_ids, options, skip_retired, progress, shard_dir)
        try:
            yield from call.run()
        finally:
            if call.dead or call.actor_died:
                # The next call places the directories again and starts fresh actors.
                self.forget_placement()

    def _call(self, rollout_ids, options, skip_retired, progress, shard_dir) -> _Call:
        flt = self.fleet()
        ids, holders = _plan(flt, rollout_ids, skip_retired)
        return _Call(
            flt, ids, holders, options, cpus=self._cpus, batch_size=self.batch_size,
            max_in_flight=self.max_in_flight, shard_dir=shard_dir, progress=progress,
        )

    def rebuild(self, rollout_ids: Sequence[str] | None = None, **kwargs: Any) -> pa.Table:
        """The rows of `rollout_ids` (every listed rollout when None) as one Arrow table."""
        tables = list(self.iter_rebuild(rollout_ids, **kwargs))
        if not tables:
            delivery = kwargs.get("delivery") or self.defaults.delivery
            return schema_of(delivery).empty_table()
        return pa.concat_tables(tables)

    async def rebuild_async(
        self, rollout_ids: Sequence[str] | None = None, *, refs: bool = False, **kwargs: Any
    ) -> pa.Table | list[Any]:
        """`rebuild` without blocking the event loop, so a trainer can overlap the next
        step's rebuild with training. With refs=True, the ObjectRefs of the batches'
        Arrow tables (in row order) instead: hand them to training workers, and the rows
        never pass through this process."""
        if refs:
            return await asyncio.to_thread(self.rebuild_refs, rollout_ids, skip_retired=kwargs.get("skip_retired", False))
        return await asyncio.to_thread(self.rebuild, rollout_ids, **kwargs)

    def rebuild_refs(self, rollout_ids: Sequence[str] | None = None, *, skip_retired: bool = False) -> list[Any]:
        """The ObjectRefs of the batches' Arrow tables, in row order (always on Ray).

        Every rollout's failure is a masked row as usual; a batch whose node is already
        known to be gone is a ref to masked rows. A batch lost while it runs raises
        when its ref is fetched: rebuild those ids again, which is safe."""
        self.last_executor = ExecutorChoice("ray", "object refs were asked for")
        return self._call(rollout_ids, self.defaults, skip_retired, None, None).refs()

    def _local_ids(self, rollout_ids: Sequence[str] | None, skip_retired: bool) -> list[str]:
        return listed_ids([d.path for d in self.dirs], skip_retired) if rollout_ids is None else list(rollout_ids)

    def _local_window(
        self, index: int, ids: list[str], options: _Options, shard_dir: str | None, frozen: list[list] | None = None
    ) -> Any:
        """One window built in this process, exactly as a builder task builds it."""
        return build_local_window(
            [d.path for d in self.dirs], [d.label for d in self.dirs], index, ids, builder=options.builder,
            model=options.model, delivery=options.delivery, verbose=options.verbose, shard_dir=shard_dir,
            frozen=frozen, version_key=options.version_key,
        )

    def _local(self, rollout_ids, options: _Options, skip_retired: bool, progress, shard_dir) -> Iterator[Any]:
        """The local executor (`raycap.local`)."""
        return iter_local(
            [d.path for d in self.dirs], [d.label for d in self.dirs], rollout_ids, builder=options.builder,
            model=options.model, delivery=options.delivery, batch_size=self.batch_size, skip_retired=skip_retired,
            shard_dir=shard_dir, progress=progress, verbose=options.verbose, version_key=options.version_key,
        )

    def _cold(self, rollout_ids, options: _Options, skip_retired: bool, progress, shard_dir) -> Iterator[Any]:
        """A session's first call on a running single-node Ray: this process builds
        windows from the front while builder tasks take them from the back, as soon as
        workers are up; neither waits for the other, and no actor is needed (the tasks
        freeze on this node themselves). A feeder thread hands the tasks their next
        window the moment one returns, so a worker never waits for this process."""
        ids = self._local_ids(rollout_ids, skip_retired)
        state = Progress(total=len(ids))
        if progress:
            progress(state)
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        step = self.batch_size or max(1, min(LOCAL_BATCH_ROLLOUTS, -(-len(ids) // (COLD_WINDOWS_PER_CPU * cpus))))
        windows = [ids[start : start + step] for start in range(0, len(ids), step)]
        plan = _ColdPlan(windows, self.dirs, options, shard_dir, limit=max(1, cpus - 1))
        # The first task is sent from here, before this process starts building: its
        # worker's start is the longest wait of the call.
        try:
            plan.submit()
        except Exception as exc:  # noqa: BLE001 - this process builds everything instead
            plan.build_here(exc)
        feeder = threading.Thread(target=plan.feed, name="raycap-cold-feeder", daemon=True)
        feeder.start()
        ahead = FreezeAhead([d.path for d in self.dirs])
        try:
            next_out = 0
            while next_out < len(windows):
                index = plan.take_front()
                if index is not None:
                    frozen = ahead.take(index, windows[index])
                    if plan.front < plan.back:
                        ahead.start(index + 1, windows[index + 1])
                    plan.settle(index, self._local_window(index, windows[index], options, shard_dir, frozen))
                for result in plan.ready_from(next_out, wait=index is None):
                    if result is _BUILD_HERE:
                        # The task's window failed (its worker died, say): built here instead.
                        result = self._local_window(next_out, windows[next_out], options, shard_dir)
                    state.done += len(windows[next_out])
                    next_out += 1
                    if progress:
                        progress(state)
                    yield result
        finally:
            plan.stop()
            ahead.close()
        # Now the actors, and the workers this call did not use, for the next call:
        # started earlier, they would have competed with this one for the cores.
        self._warm_up_in_background()
        for _ in range(cpus):
            _warm.remote()

    # -- the other directory operations --------------------------------------------------

    def list_rollouts(self, *, skip_retired: bool = False) -> list[str]:
        """The sorted rollout ids with capture files in any of the directories."""
        local = plain_local_paths(self.dirs)
        if self.choose(None, skip_retired=skip_retired).executor == "local" and not isinstance(local, str):
            return listed_ids(local, skip_retired)
        ids, _ = _plan(self.fleet(), None, skip_retired)
        return ids

    def retire(
        self, output: str | os.PathLike, *, on_shard: Callable[[str, "RetireReport"], None] | None = None
    ) -> "RetireReport":
        """Drop the exact snapshots of the committed output's successful, unmasked rows,
        shard by shard (in parallel on Ray). Only a committed output can be retired
        from: its rows are durable. `on_shard(shard, report so far)` runs after each
        shard's drops have finished."""
        from raycap.output import shard_paths

        shards = [str(p) for p in shard_paths(output)]
        local = plain_local_paths(self.dirs)
        in_process = self.executor == "local" or (
            self.executor == "auto" and not ray.is_initialized() and not (self.address or os.environ.get("RAY_ADDRESS"))
        )
        if in_process and not isinstance(local, str):
            stores = {d.label: TokenCaptureStore(d.path, create=False) for d in self.dirs}
            report = RetireReport()
            for shard in shards:
                report.merge(_retire_locally(shard, stores))
                if on_shard:
                    on_shard(shard, report)
            return report
        flt = self.fleet()
        handles = flt.by_label()
        report = RetireReport()
        refs = [_retire_shard.remote(shard, handles) for shard in shards]
        for shard, ref in zip(shards, refs):
            try:
                report.merge(ray.get(ref))
            except Exception as exc:  # noqa: BLE001 - retiring again later finishes the job
                report.errors.append(f"shard {shard}: {_cause_text(exc)}; nothing of it is known to be dropped, rerun to finish")
            if on_shard:
                on_shard(shard, report)
        return report

    def clear(self, rollout_ids: Iterable[str]) -> list[str]:
        """Delete the captures of these rollouts in every directory; returns error texts."""
        flt = self.fleet()
        ids = list(rollout_ids)
        errors = []
        for d, ref in zip(flt.dirs, [h.call("delete_batch", ids) for h in flt.handles]):
            try:
                outcome = ray.get(ref)
            except ray.exceptions.RayError as exc:
                outcome = [_cause_text(exc)] * len(ids)
            errors.extend(f"{rid} in {d.label}: {err}" for rid, err in zip(ids, outcome) if err)
        return errors

    def sweep(self, older_than_seconds: float) -> dict[str, int]:
        """Remove retired tombstones older than the cutoff; count per directory."""
        flt = self.fleet()
        counts = ray.get([h.call("sweep_retired", older_than_seconds) for h in flt.handles])
        return {d.label: n for d, n in zip(flt.dirs, counts)}


def _plan(flt: Fleet, rollout_ids: Sequence[str] | None, skip_retired: bool) -> tuple[list[str], list[tuple[int, ...]] | None]:
    """The ids to build and, when listing, the directories holding each (by index).

    Explicit ids are not looked up: each directory is asked to freeze the ones it holds,
    so a call costs in proportion to its ids, not to the directories' history."""
    if rollout_ids is not None:
        return list(rollout_ids), None
    refs = [h.call("rollout_ids", skip_retired) for h in flt.handles]
    holders: dict[str, list[int]] = defaultdict(list)
    for index, (d, ref) in enumerate(zip(flt.dirs, refs)):
        try:
            listing = ray.get(ref)
        except ray.exceptions.RayError as exc:
            # Without a listing the rollouts of this directory are unknown: no row can be
            # right, so this is the one failure that stops a rebuild.
            raise RuntimeError(f"listing capture directory {d.label} failed: {_cause_text(exc)}") from exc
        for rid in listing:
            holders[rid].append(index)
    ids = sorted(holders)
    return ids, [tuple(holders[rid]) for rid in ids]


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


def _retirable_by_dir(shard: str) -> dict[str, list[tuple[str, str, int]]]:
    import pyarrow.parquet as pq

    per_dir: dict[str, list[tuple[str, str, int]]] = defaultdict(list)
    for label, rid, sid, version in retirable(pq.read_table(local_path(shard), columns=list(RETIRE_COLUMNS))):
        per_dir[label].append((rid, sid, version))
    return per_dir


def _tally(report: RetireReport, label: str, items: list[tuple[str, str, int]], outcomes: Sequence[Any]) -> None:
    for (rid, _, _), outcome in zip(items, outcomes):
        if outcome is True:
            report.dropped += 1
        elif outcome is False:
            report.changed.append(rid)
            logger.warning("rollout %s in %s changed since it was built; its capture is kept", rid, label)
        else:
            report.errors.append(f"{rid}: {outcome}")


def _retire_locally(shard: str, stores: dict[str, TokenCaptureStore]) -> RetireReport:
    report = RetireReport()
    for label, items in _retirable_by_dir(shard).items():
        store = stores.get(label)
        if store is None:
            report.errors.extend(f"{rid}: capture directory {label} is not among {sorted(stores)}" for rid, _, _ in items)
            continue
        outcomes = []
        for rid, sid, version in items:
            try:
                outcomes.append(store.drop(rid, snapshot_id=sid, version=version))
            except Exception as exc:  # noqa: BLE001 - reported per rollout
                outcomes.append(error_text(exc))
        _tally(report, label, items, outcomes)
    return report


@ray.remote(num_cpus=0, max_retries=TASK_MAX_RETRIES)
def _retire_shard(shard: str, handles: dict[str, DirectoryHandle]) -> RetireReport:
    """Retire one committed shard through the directories' actors (dropping is idempotent,
    so a retried task is harmless)."""
    report = RetireReport()
    per_dir = _retirable_by_dir(shard)
    refs = {}
    for label, items in per_dir.items():
        if label not in handles:
            report.errors.extend(f"{rid}: capture directory {label} is not among {sorted(handles)}" for rid, _, _ in items)
            continue
        refs[label] = handles[label].call("drop_batch", items)
    for label, ref in refs.items():
        try:
            outcomes = ray.get(ref)
        except ray.exceptions.RayError as exc:
            # Nothing of this directory is known to be dropped; dropping is idempotent,
            # so retiring the same output again later finishes the job.
            reason = _cause_text(exc)
            report.errors.extend(f"{rid}: capture directory {label}: {reason}" for rid, _, _ in per_dir[label])
            continue
        _tally(report, label, per_dir[label], outcomes)
    return report


def check_shared_output(staging_dir: str) -> None:
    """Raise OutputError unless every node that can run builder tasks sees `staging_dir`
    as the driver does: shards are written where they are built, and the commit must
    find them all. Each node writes a marker (as placement does), then every node and
    the driver look for all of them; each writer removes its own."""
    from raycap.output import OutputError  # (builder workers never need the output module)

    here = ray.get_runtime_context().get_node_id()
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and (n.get("Resources") or {}).get("CPU", 0) > 0]
    if not nodes or nodes == [here]:
        return  # one node: the driver's own file system
    names = [f"{MARKER_PREFIX}{uuid.uuid4().hex}" for _ in nodes]
    wrote = _ask([(node, _write_marker, (staging_dir, name)) for node, name in zip(nodes, names)])
    try:
        for node, answer in zip(nodes, wrote):
            if answer is not None:
                why = answer if isinstance(answer, str) else "it did not answer"
                raise OutputError(
                    f"node {node[:12]}.. cannot write into the output's staging directory {staging_dir} ({why}); "
                    "put the output on a file system every node mounts, writable by the Ray workers"
                )
        seen = _ask([(node, _seen_markers, (staging_dir, names)) for node in nodes])
        seen.append([os.path.lexists(os.path.join(local_path(staging_dir), name)) for name in names])
        for viewer, row in zip([*nodes, None], seen):
            missing = [node for node, ok in zip(nodes, row if isinstance(row, list) else [False] * len(nodes)) if not ok]
            if missing:
                who = "the driver" if viewer is None else f"node {viewer[:12]}.."
                raise OutputError(
                    f"the output {os.path.dirname(staging_dir) or '.'} is not on storage every node shares: {who} "
                    f"cannot see what node {missing[0][:12]}.. wrote into {staging_dir}; put the output on a shared "
                    "file system (e.g. NFS) mounted at the same path on every node"
                )
    finally:
        _ask([(node, _remove_markers, (staging_dir, [name])) for node, name in zip(nodes, names)])


# -- the module-level API: thin wrappers over one cached session per directory list --------

_SESSIONS: dict[tuple, Rebuilder] = {}
MAX_SESSIONS = 16


def session(capture_dirs: Sequence[Any], *, address: str | None = None, executor: str = "auto") -> Rebuilder:
    """The cached Rebuilder of these directories (placement and actors reused across calls)."""
    key = (tuple(CaptureDir.parse(d).label for d in capture_dirs), address, executor)
    found = _SESSIONS.pop(key, None)
    if found is None:
        found = Rebuilder(capture_dirs, address=address, executor=executor)
    _SESSIONS[key] = found  # most recently used last
    while len(_SESSIONS) > MAX_SESSIONS:
        del _SESSIONS[next(iter(_SESSIONS))]
    return found


def iter_rebuild(
    capture_dirs: Sequence[Any],
    rollout_ids: Sequence[str] | None = None,
    *,
    builder: str = "prefix_merging",
    model: str = "",
    delivery: str = "rollout",
    batch_size: int | None = None,
    max_in_flight: int | None = None,
    progress: Callable[[Progress], None] | None = None,
    address: str | None = None,
    skip_retired: bool = False,
    shard_dir: str | None = None,
    executor: str = "auto",
    verbose: bool = False,
) -> Iterator[Any]:
    """`Rebuilder.iter_rebuild` on the cached session of these directories."""
    rebuilder = session(capture_dirs, address=address, executor=executor)
    rebuilder.batch_size, rebuilder.max_in_flight = batch_size, max_in_flight
    rebuilder.defaults = Rebuilder._options(builder, model, delivery, verbose)
    return rebuilder.iter_rebuild(rollout_ids, skip_retired=skip_retired, progress=progress, shard_dir=shard_dir)


def rebuild(capture_dirs: Sequence[Any], rollout_ids: Sequence[str] | None = None, **options: Any) -> pa.Table:
    """`raycap.rebuild` once it is known to need this module (see `raycap.local.rebuild`
    for the contract and the options): `iter_rebuild`'s tables as one table."""
    tables = list(iter_rebuild(capture_dirs, rollout_ids, **options))
    if not tables:
        return schema_of(options.get("delivery", "rollout")).empty_table()
    return pa.concat_tables(tables)


def retire(
    output: str | os.PathLike,
    capture_dirs: Sequence[Any],
    *,
    address: str | None = None,
    on_shard: Callable[[str, RetireReport], None] | None = None,
) -> RetireReport:
    """Drop the exact snapshots of a committed output's successful, unmasked rows."""
    return session(capture_dirs, address=address, executor="auto").retire(output, on_shard=on_shard)


def list_rollouts(capture_dirs: Sequence[Any], *, skip_retired: bool = False, address: str | None = None) -> list[str]:
    """The sorted rollout ids with capture files in any of the directories."""
    return session(capture_dirs, address=address).list_rollouts(skip_retired=skip_retired)


def clear(rollout_ids: Iterable[str], capture_dirs: Sequence[Any], *, address: str | None = None) -> list[str]:
    """Delete the captures of these rollouts in every directory; returns error texts."""
    return session(capture_dirs, address=address, executor="ray").clear(rollout_ids)


def sweep(capture_dirs: Sequence[Any], older_than_seconds: float, *, address: str | None = None) -> dict[str, int]:
    """Remove retired tombstones older than the cutoff; count per directory."""
    return session(capture_dirs, address=address, executor="ray").sweep(older_than_seconds)
