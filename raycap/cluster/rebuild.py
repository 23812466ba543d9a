"""The distributed rebuild: capture directories in, one Arrow row per rollout out.

The driver lists rollouts (with their capture sizes) through the node actors, cuts them
into batches by bytes, asks each directory's actor to freeze a batch, and hands the
frozen identities by reference to a builder task that prefers the directory's node.
There the task reads the frozen JSONL prefixes itself, under the shared lock; a task
placed on another node gets the bytes through the actor instead, as numpy buffers in the
object store. Parsing and building run in the tasks, in parallel. Only Arrow tables come back,
and a bounded window of batches is in flight, so driver and object-store memory stay
flat however many rollouts there are.

A rollout held by several directories (its calls were captured on several nodes) is
frozen in each and assembled from all parts: entries united, incomplete if any part is,
and every part's snapshot identity kept in the row, so retirement drops every part.

Nothing fails the whole rebuild because of one rollout: a bad rollout is a masked row;
a builder task whose worker dies is retried by Ray; a batch that still fails becomes
masked rows carrying the error; an actor that dies is restarted from its files and its
calls are retried (freeze is idempotent, so a retried freeze returns the same snapshot).
An actor that is gone for good (killed with `no_restart`, its restarts used up, its
node lost) does not stop the rebuild either: the rollouts it had still to freeze become
masked rows whose error names the directory and says the actor died. Nothing of them
was dropped, and the next call starts a fresh actor for the node, so rebuilding
those rollouts again later is safe. Only two failures raise: a directory that cannot be
placed or started (before any work, see `fleet`), and a directory that cannot be listed
(its rollouts would be unknown).

`retire` drops the snapshots of successful, unmasked rows. Call it only after the rows
are durable (see `raycap.output`): dropping first could lose a capture whose trajectory
was never written.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import socket
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import pyarrow as pa
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycap.arrow import CHAIN_SCHEMA, ROLLOUT_SCHEMA, builds_to_table, chains_to_table, retirable
from raycap.builders import BUILDERS
from raycap.chains import ChainsBuild, build_frozen_chains, failed_chains
from raycap.cluster.actor import ActorTokenSource, CaptureNodeActor, DirectoryHandle, actor_name
from raycap.cluster.placement import CaptureDir, locate
from raycap.consumer import RolloutBuild, build_frozen, failed_build
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


DELIVERIES = ("rollout", "chains")


def _to_table(builds: list[RolloutBuild | ChainsBuild], labels: Sequence[str], delivery: str) -> pa.Table:
    dirs = [labels] * len(builds)
    return chains_to_table(builds, dirs) if delivery == "chains" else builds_to_table(builds, dirs)


def _failed(rollout_id: str, builder: str, model: str, error: str, delivery: str) -> RolloutBuild | ChainsBuild:
    if delivery == "chains":
        return failed_chains(rollout_id, builder, model, error)
    return failed_build(rollout_id, builder, model, error)


def _failed_rows(
    rollout_ids: Sequence[str], labels: Sequence[str], builder: str, model: str, error: str, delivery: str
) -> pa.Table:
    return _to_table([_failed(rid, builder, model, error, delivery) for rid in rollout_ids], labels, delivery)


@dataclass(frozen=True)
class _Source:
    """Where a batch's frozen parts come from: a directory, its node and its actor."""

    label: str
    path: str
    node: str
    handle: DirectoryHandle


def _with_data(sources: Sequence[_Source], frozen: Sequence[list]) -> list[list]:
    """Fill in the bytes of freezes made with read=False: read locally when this task
    runs on the directory's node, else ask the directory's actor for them."""
    here = ray.get_runtime_context().get_node_id()
    out = []
    for source, batch in zip(sources, frozen):
        wanted = [i for i, part in enumerate(batch) if isinstance(part, FrozenCapture) and part.size > len(part.data)]
        if not wanted:
            out.append(batch)
            continue
        batch = list(batch)
        if source.node == here:
            store = TokenCaptureStore(source.path, create=False)
            for i in wanted:
                try:
                    batch[i] = dataclasses.replace(batch[i], data=store.read_frozen(batch[i]))
                except Exception as exc:  # noqa: BLE001 - reported per rollout
                    batch[i] = f"{type(exc).__name__}: {exc}"
        else:
            for i, part in zip(wanted, ray.get(source.handle.call("read_batch", [batch[i] for i in wanted]))):
                batch[i] = part
        out.append(batch)
    return out


@ray.remote(num_cpus=1, max_retries=TASK_MAX_RETRIES)
def _build_batch(
    rollout_ids: list[str], sources: list[_Source], builder: str, model: str, delivery: str, *frozen: list
) -> pa.Table:
    marker = os.environ.get(FAULT_ENV)
    if marker and not os.path.exists(marker):
        # Fault injection for tests: the first task to get here dies like a lost worker.
        open(marker, "w").close()
        os._exit(1)
    labels = [source.label for source in sources]
    frozen = _with_data(sources, frozen)
    build_one = build_frozen_chains if delivery == "chains" else build_frozen
    # Parsed records are acyclic but hold millions of list slots; the cyclic collector
    # would walk them all on every full pass. Nothing here needs it until the batch ends.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _to_table(_build_all(rollout_ids, labels, builder, model, delivery, frozen, build_one), labels, delivery)
    finally:
        if collecting:
            gc.enable()


def _build_all(rollout_ids, labels, builder, model, delivery, frozen, build_one) -> list:
    builds = []
    for i, rollout_id in enumerate(rollout_ids):
        parts = [(label, batch[i]) for label, batch in zip(labels, frozen)]
        failed = next((p for _, p in parts if isinstance(p, str)), None)
        try:
            if failed is not None:
                logging.getLogger("raycap.consumer").warning("rollout %s: freeze failed, masking it: %s", rollout_id, failed)
                build = _failed(rollout_id, builder, model, failed, delivery)
            else:
                build = build_one(rollout_id, parts, builder=builder, model=model)
        except Exception as exc:  # noqa: BLE001 - one rollout never sinks its batch
            build = _failed(rollout_id, builder, model, f"{type(exc).__name__}: {exc}", delivery)
        builds.append(build)
    return builds


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


def _batch_error(exc: BaseException, flt: Fleet, labels: Sequence[str]) -> str:
    """The error of rows whose batch was lost; an actor failure names its directory."""
    text = _cause_text(exc)
    if isinstance(exc, ray.exceptions.RayTaskError) and not isinstance(exc, ray.exceptions.RayActorError):
        return f"{text} (raised by the builder task of this batch)"
    if not isinstance(exc, ray.exceptions.RayActorError):
        # System failures (a lost worker or node) were already retried by Ray.
        return f"{text} (the builder task of this batch failed {TASK_MAX_RETRIES + 1} times)"
    name = next(
        (line.strip()[len("name: "):] for line in str(exc).splitlines() if line.strip().startswith("name: ")),
        None,
    )
    dead = [label for label in flt.labels_of_actor(name) if label in labels] if name else []
    kind, _, reason = text.partition(": ")
    return (
        f"{kind}: the actor serving capture directory {', '.join(dead or labels)} died and was not "
        f"restarted ({reason}); nothing was dropped, so rebuilding these rollouts later is safe"
    )


@dataclass
class Progress:
    """Rollouts done of the total, passed to the `progress` callback after each batch."""

    total: int
    done: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def rate(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.done / elapsed if elapsed > 0 else 0.0


def _plan(
    flt: Fleet, rollout_ids: Sequence[str] | None, skip_retired: bool = False
) -> tuple[list[str], list[tuple[int, ...]], list[int]]:
    """The rollout ids to build and, for each, the directories holding it (by index) and
    its capture bytes."""
    listings = []
    for d, ref in zip(flt.dirs, [h.call("rollout_sizes", skip_retired) for h in flt.handles]):
        try:
            listings.append(ray.get(ref))
        except ray.exceptions.RayError as exc:
            # Without a listing the rollouts of this directory are unknown: no row can be
            # right, so this is the one failure that stops a rebuild.
            raise RuntimeError(f"listing capture directory {d.label} failed: {_cause_text(exc)}") from exc
    holders: dict[str, list[int]] = defaultdict(list)
    sizes: dict[str, int] = defaultdict(int)
    for index, listing in enumerate(listings):
        for rid, size in listing.items():
            holders[rid].append(index)
            sizes[rid] += size
    ids = sorted(holders) if rollout_ids is None else list(rollout_ids)
    # An id no directory holds is frozen in the first directory, like the single-rollout
    # API: the row says "capture contains no token records" instead of vanishing.
    return ids, [tuple(holders.get(rid, (0,))) for rid in ids], [sizes.get(rid, 0) for rid in ids]


MAX_BATCH_ROLLOUTS = 64
MIN_BATCH_BYTES = 1 << 20


def _windows(sizes: Sequence[int], cpus: int, batch_size: int | None) -> list[list[int]]:
    """Consecutive runs of positions, one builder task each (more when a run spans
    several directory sets).

    Without a fixed batch_size, runs are cut by capture bytes, about a sixteenth of each
    CPU's share: enough tasks to balance rollouts of very different sizes across the
    CPUs, few enough that per-task overhead stays negligible."""
    if batch_size is not None:
        return [list(range(i, min(i + batch_size, len(sizes)))) for i in range(0, len(sizes), batch_size)]
    target = max(sum(sizes) // (16 * cpus), MIN_BATCH_BYTES)
    windows: list[list[int]] = [[]]
    filled = 0
    for position, size in enumerate(sizes):
        if windows[-1] and (filled + size > target or len(windows[-1]) >= MAX_BATCH_ROLLOUTS):
            windows.append([])
            filled = 0
        windows[-1].append(position)
        filled += size
    return windows if windows[0] else []


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
) -> Iterator[pa.Table]:
    """Rebuild in bounded memory, yielding Arrow tables whose rows, concatenated, are in
    the order of `rollout_ids` (sorted ids when listing)."""
    if delivery not in DELIVERIES:
        raise ValueError(f"unknown delivery {delivery!r}; use one of: {', '.join(DELIVERIES)}")
    if builder not in BUILDERS:
        raise ValueError(f"unknown builder {builder!r}; known builders: {', '.join(BUILDERS)}")
    connect(address)
    flt = fleet(capture_dirs)
    ids, holders, sizes = _plan(flt, rollout_ids, skip_retired)
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    if max_in_flight is None:
        max_in_flight = 2 * cpus + 2
    # A window is a run of consecutive ids; inside it, one batch per set of holding
    # directories (almost always one). Windows are yielded in order, so the rows come
    # out in id order without holding more than the in-flight windows.
    windows = _windows(sizes, cpus, batch_size)
    labels_of = [d.label for d in flt.dirs]
    state = Progress(total=len(ids))
    if progress:
        progress(state)

    pending: dict[Any, tuple[int, list[int]]] = {}
    parts: dict[int, list[tuple[list[int], pa.Table]]] = defaultdict(list)
    expected: dict[int, int] = {}
    next_out = 0
    submitted = 0

    def submit(w: int) -> None:
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for position in windows[w]:
            groups[holders[position]].append(position)
        expected[w] = len(groups)
        for dirs, positions in groups.items():
            batch_ids = [ids[p] for p in positions]
            sources = [_Source(labels_of[d], flt.dirs[d].path, flt.nodes[d], flt.handles[d]) for d in dirs]
            nodes = {source.node for source in sources}
            # The builder prefers the node that holds the captures and then reads them
            # from disk itself; anywhere else it gets the bytes through the actor.
            frozen = [flt.handles[d].call("freeze_batch", batch_ids, len(nodes) > 1) for d in dirs]
            task = _build_batch
            if len(nodes) == 1:
                task = _build_batch.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nodes.pop(), soft=True))
            ref = task.remote(batch_ids, sources, builder, model, delivery, *frozen)
            pending[ref] = (w, positions)

    while next_out < len(windows):
        while submitted < len(windows) and len(pending) < max_in_flight and submitted - next_out < 4 * max_in_flight:
            submit(submitted)
            submitted += 1
        done, _ = ray.wait(list(pending), num_returns=1)
        ref = done[0]
        w, positions = pending.pop(ref)
        batch_ids = [ids[p] for p in positions]
        labels = [labels_of[d] for d in holders[positions[0]]]
        try:
            table = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - a lost batch becomes masked rows
            error = _batch_error(exc, flt, labels)
            logger.warning("batch of %d rollouts (%s..) failed, masking them: %s", len(batch_ids), batch_ids[0], error)
            table = _failed_rows(batch_ids, labels, builder, model, error, delivery)
        del ref
        parts[w].append((positions, table))
        state.done += len(batch_ids)
        if progress:
            progress(state)
        while next_out < len(windows) and len(parts.get(next_out, ())) == expected.get(next_out, -1):
            yield _in_position_order(parts.pop(next_out))
            next_out += 1


def _in_position_order(parts: list[tuple[list[int], pa.Table]]) -> pa.Table:
    if len(parts) == 1:
        return parts[0][1]
    positions = [p for ps, _ in parts for p in ps]
    table = pa.concat_tables([t for _, t in parts])
    order = sorted(range(len(positions)), key=positions.__getitem__)
    return table.take(pa.array(order, type=pa.int64()))


def rebuild(
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
) -> pa.Table:
    """Rebuild rollouts from capture directories on Ray.

    `delivery="rollout"` (the default) gives one row per rollout in ROLLOUT_SCHEMA, the
    single-response results of the spec; `delivery="chains"` gives one row per chain in
    CHAIN_SCHEMA (see raycap.chains). Rows come in the order of `rollout_ids`, or of the
    sorted ids found in any directory when it is None (retired tombstones included, each
    a masked "retired" row, unless `skip_retired`). Starts an embedded local Ray when
    none is running."""
    tables = list(
        iter_rebuild(
            capture_dirs,
            rollout_ids,
            builder=builder,
            model=model,
            delivery=delivery,
            batch_size=batch_size,
            max_in_flight=max_in_flight,
            progress=progress,
            address=address,
            skip_retired=skip_retired,
        )
    )
    if not tables:
        return (CHAIN_SCHEMA if delivery == "chains" else ROLLOUT_SCHEMA).empty_table()
    return pa.concat_tables(tables)


@dataclass
class RetireReport:
    """What `retire` did: parts dropped, rollouts changed since their build, errors."""

    dropped: int = 0
    changed: list[str] = field(default_factory=list)  # snapshot changed since the build: kept
    errors: list[str] = field(default_factory=list)


def retire(table: pa.Table, capture_dirs: Sequence[Any], *, address: str | None = None) -> RetireReport:
    """Drop the exact snapshots of successful, unmasked rows. Only after the rows are durable."""
    connect(address)
    flt = fleet(capture_dirs)
    handles = flt.by_label()
    per_dir: dict[str, list[tuple[str, str, int]]] = defaultdict(list)
    report = RetireReport()
    for label, rid, sid, version in retirable(table):
        if label not in handles:
            report.errors.append(f"{rid}: capture directory {label} is not among {sorted(handles)}")
            continue
        per_dir[label].append((rid, sid, version))
    refs = {label: handles[label].call("drop_batch", items) for label, items in per_dir.items()}
    for label, ref in refs.items():
        try:
            outcomes = ray.get(ref)
        except ray.exceptions.RayError as exc:
            # Nothing of this directory is known to be dropped; dropping is idempotent,
            # so retiring the same table again later finishes the job.
            reason = _cause_text(exc)
            report.errors.extend(f"{rid}: capture directory {label}: {reason}" for rid, _, _ in per_dir[label])
            continue
        for (rid, _, _), outcome in zip(per_dir[label], outcomes):
            if outcome is True:
                report.dropped += 1
            elif outcome is False:
                report.changed.append(rid)
                logger.warning("rollout %s in %s changed since it was built; its capture is kept", rid, label)
            else:
                report.errors.append(f"{rid}: {outcome}")
    return report


def list_rollouts(capture_dirs: Sequence[Any], *, skip_retired: bool = False, address: str | None = None) -> list[str]:
    """The sorted rollout ids with capture files in any of the directories."""
    connect(address)
    ids, _, _ = _plan(fleet(capture_dirs), None, skip_retired)
    return ids


def clear(rollout_ids: Iterable[str], capture_dirs: Sequence[Any], *, address: str | None = None) -> list[str]:
    """Delete the captures of these rollouts in every directory; returns error texts."""
    connect(address)
    flt = fleet(capture_dirs)
    ids = list(rollout_ids)
    errors = []
    for d, ref in zip(flt.dirs, [h.call("delete_batch", ids) for h in flt.handles]):
        try:
            outcome = ray.get(ref)
        except ray.exceptions.RayError as exc:
            outcome = [_cause_text(exc)] * len(ids)
        errors.extend(f"{rid} in {d.label}: {err}" for rid, err in zip(ids, outcome) if err)
    return errors


def sweep(capture_dirs: Sequence[Any], older_than_seconds: float, *, address: str | None = None) -> dict[str, int]:
    """Remove retired tombstones older than the cutoff; count per directory."""
    connect(address)
    flt = fleet(capture_dirs)
    counts = ray.get([h.call("sweep_retired", older_than_seconds) for h in flt.handles])
    return {d.label: n for d, n in zip(flt.dirs, counts)}
