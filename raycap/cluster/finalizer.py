"""Finalizing a results file on Ray: batches of its lines out to tasks, their reports back in order.

The driver reads the results file batch by batch (`raycap.finalize.results.ResultsScan.read`:
consecutive lines by byte range, never parsed here) and ships each batch's bytes to a
finalize task through the object store, so a task on a node that cannot see the file
still gets its records. At most `max_in_flight` tasks run at once (twice the cluster's
CPUs plus two by default), so the driver and the object store hold a bounded number of
batches whatever the file's size; a batch's bytes are released as soon as its task is
submitted. Each task (`raycap.cluster.plumbing.task.finalize_one_batch`) freezes its rollouts
next to their captures, builds them, and writes its records part and shard into the
staging directory where it runs; only its report (`FinalizedBatch`) comes back, and
reports are yielded in batch order. On a Ray of one node, the one this process is on,
local directories are read in place and no directory actor is started (`_sources_here`):
this process finalizes batches beside a runner per further CPU, forks of it where that
is safe and actors otherwise, each writing a batch while it computes the next
(`_finalize_beside_tasks`); elsewhere the session places the directories and starts
their actors.

A batch is the user's records, not rows that can be masked: a task that fails for good
(after Ray's retries), or a line that is not JSON, fails the run, nothing is committed,
and a rerun starts afresh (freezing is idempotent). A fault of the output's file system
raises OutputWriteError, as in a rebuild.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycap.capture.directory import CaptureDir
from raycap.cluster.plumbing import task as _task
from raycap.cluster.plumbing.connect import connect
from raycap.cluster.plumbing.failures import cause_text, output_fault
from raycap.cluster.plumbing.task import Source
from raycap.finalize.batch import FinalizedBatch
from raycap.finalize.pool import (
    LocalRunner,
    Outcome,
    Runner,
    _RunnerLost,
    finalize_pooled,
    here_context,
    local_finalizer,
)
from raycap.finalize.results import ResultsBatch, ResultsError, ResultsScan
from raycap.finalize.worker import MAX_WORKERS, can_fork, worker_processes
from raycap.finalize.worker import workers as pool_workers
from raycap.rows.options import RebuildOptions


def _cancel(ref: Any) -> None:
    try:
        ray.cancel(ref)
    except Exception:  # noqa: BLE001 - the result is abandoned either way
        pass


def _failure(exc: BaseException, batch: ResultsBatch, label: str) -> BaseException:
    """What a failed finalize task fails the run with."""
    fault = output_fault(exc)
    if fault is not None:
        return fault
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ResultsError):
        return ResultsError(str(cause))
    last = batch.first_index + batch.records - 1
    return RuntimeError(
        f"finalizing records {batch.first_index}..{last} of {label} failed ({cause_text(exc)}); nothing was "
        "committed or retired: rerun (freezing is idempotent)"
    )


def _sources_here(dirs: Sequence[CaptureDir]) -> list[Source] | None:
    """On a Ray of one node that this process is on, the local directories it sees are
    that node's: its tasks freeze and read them in place, and no directory actor is
    needed (starting one is most of a small run's wait). None otherwise: the session
    places the directories and starts their actors."""
    if any(d.node is not None or not os.path.isdir(d.path) for d in dirs):
        return None
    if ray.util.client.ray.is_connected():
        return None  # a client's paths are its own machine's
    if len([node for node in ray.nodes() if node.get("Alive")]) != 1:
        return None
    here = ray.get_runtime_context().get_node_id()
    return [Source(d.label, d.path, here, None) for d in dirs]


def finalize_on_ray(
    scan: ResultsScan,
    dirs: Sequence[CaptureDir],
    options: RebuildOptions,
    fields: tuple[tuple[str, str], ...],
    staging: str,
    *,
    address: str | None = None,
    forks: bool = False,
    keep_lines: bool = False,
) -> Iterator[FinalizedBatch]:
    """Each batch of `scan`, finalized by a task on Ray, reported in batch order; on a Ray
    of one node, this one, beside this process (`forks`: see `_finalize_beside_tasks`;
    `keep_lines`: the reports of batches this process finalized keep their lines, for a
    records file drafted here)."""
    connect(address)
    sources = _sources_here(dirs)
    if sources is not None:
        yield from _finalize_beside_tasks(scan, sources, options, fields, staging, forks, keep_lines)
        return
    if sources is None:
        # Directories on other nodes: the session places them and starts their actors.
        from raycap.cluster.rebuild.session import session

        placed = session(dirs, address=address).fleet()
        sources = [Source(d.label, d.path, node, handle) for d, node, handle in zip(placed.dirs, placed.nodes, placed.handles)]
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    max_in_flight = options.max_in_flight or 2 * cpus + 2
    task = _task.finalize_batch_task
    nodes = {source.node for source in sources}
    if len(nodes) == 1:
        # The captures are all on one node: tasks there freeze and read them in place.
        task = task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(next(iter(nodes)), soft=True))
    pending: dict[Any, ResultsBatch] = {}
    done: dict[int, FinalizedBatch] = {}
    next_out = 0

    def collect(block: bool) -> bool:
        """Take one finished task's report (waiting for one when `block`); whether one was."""
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=None if block else 0)
        for ref in ready:
            batch = pending.pop(ref)
            try:
                done[batch.index] = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the run fails; the others are abandoned
                for other in pending:
                    _cancel(other)
                raise _failure(exc, batch, scan.label) from None
        return bool(ready)

    try:
        for batch, data in scan.read():
            while len(pending) >= max_in_flight:
                collect(block=True)
            payload = ray.put(data)
            del data
            pending[task.remote(payload, batch, scan.label, sources, options, fields, staging)] = batch
            del payload
            while pending and collect(block=False):
                pass
            while next_out in done:
                yield done.pop(next_out)
                next_out += 1
        while pending or next_out in done:
            if next_out not in done:
                collect(block=True)
            while next_out in done:
                yield done.pop(next_out)
                next_out += 1
    finally:
        # A run that stops early (a failure, a crash of its caller) leaves no task
        # writing into a staging directory about to be removed.
        for ref in pending:
            _cancel(ref)


# This process's way of finalizing (`raycap.finalize.pool.LocalRunner`), in an actor on this
# node: batches computed there, each written while the next is computed.
_FinalizerActor = ray.remote(num_cpus=1, max_restarts=0)(LocalRunner)
# How long stopping waits for an actor's batch in hand and write in flight before it is killed.
STOP_WAIT_S = 120.0


class _ActorSlot:
    """A `_FinalizerActor` on this node, as a `raycap.finalize.pool.Runner`: an actor
    that dies leaves the batches it had not finished (written) to this process."""

    def __init__(self, context: tuple, label: str, node: str) -> None:
        strategy = NodeAffinitySchedulingStrategy(node, soft=True)
        self.actor = _FinalizerActor.options(scheduling_strategy=strategy).remote(context)
        self.label = label
        self.unfinished: dict[int, tuple[ResultsBatch, bytes]] = {}

    def ready(self) -> None:
        """Once the actor runs: on a cluster whose CPUs are all held, never (until stopped)."""
        try:
            ray.get(self.actor.ready.remote())
        except Exception as exc:  # noqa: BLE001 - it never started: this process finalizes every batch
            raise _RunnerLost(f"the actor to finalize batches of {self.label} did not start ({cause_text(exc)})", []) from None

    def hand(self, batch: ResultsBatch, data: bytes) -> list[Outcome]:
        self.unfinished[batch.index] = (batch, data)
        return self._outcomes(self.actor.hand.remote(batch, data))

    def finish(self) -> list[Outcome]:
        return self._outcomes(self.actor.finish.remote()) if self.unfinished else []

    def _outcomes(self, ref: Any) -> list[Outcome]:
        try:
            outcomes = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - the actor is gone: its batches are finalized here
            batches = sorted(self.unfinished.values(), key=lambda item: item[0].index)
            self.unfinished.clear()
            raise _RunnerLost(f"the actor finalizing batches of {self.label} was lost ({cause_text(exc)})", batches) from None
        for index, _, _ in outcomes:
            self.unfinished.pop(index, None)
        return outcomes

    def stop(self) -> None:
        # Its batch in hand and its write in flight end before the staging directory goes;
        # an actor holding none (one that never started among them) is killed at once.
        if self.unfinished:
            try:
                ray.get(self.actor.stop.remote(), timeout=STOP_WAIT_S)
            except Exception:  # noqa: BLE001 - gone or stuck: killed either way
                pass
        ray.kill(self.actor)


def _finalize_beside_tasks(
    scan: ResultsScan, sources: list[Source], options: RebuildOptions, fields: tuple[tuple[str, str], ...], staging: str,
    forks: bool, keep_lines: bool = False,
) -> Iterator[FinalizedBatch]:
    """On a Ray of one node, this one: this process finalizes batches too, beside a runner
    per further CPU (`raycap.finalize.pool`), so no batch waits for a worker to start and
    no core is left idle by a driver that only waits. Each writes a batch while it
    computes the next.

    The runners are forks of this process where that is safe (`forks`: the output's
    staging may be written by forks; `raycap.finalize.worker.can_fork`), as many as the
    local executor would start and Ray has CPUs free: a fork starts at once with
    everything imported, where an actor (`_ActorSlot`) waits for Ray to start a worker,
    which then imports raycap and builds Ray's serialization context, most of a second of
    a core on a session's first call. Otherwise they are actors, one per CPU but one."""
    context = here_context(sources, scan.label, options, fields, staging)
    if forks and can_fork():
        count = min(pool_workers(scan, forks), _free_cpus(), options.max_in_flight or MAX_WORKERS)
        start = worker_processes(count, context, scan.label, forks, hand_lines=keep_lines) if count > 0 else list
    else:
        here = ray.get_runtime_context().get_node_id()
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        slots = max(1, min(cpus - 1, options.max_in_flight or cpus))

        def start() -> list[Runner]:
            return [_ActorSlot(context, scan.label, here) for _ in range(slots)]

    yield from finalize_pooled(scan, start, local_finalizer(context, keep_lines))


def _free_cpus() -> int:
    """The CPUs no Ray task or actor holds now: a collection's actors often hold them all."""
    try:
        return max(0, int(ray.available_resources().get("CPU", 0)))
    except Exception:  # noqa: BLE001 - a cluster that cannot say lends none
        return 0
