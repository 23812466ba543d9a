"""The cold first-call plan: this process builds alongside Ray's first builder tasks.

On a session's first call on a running single-node Ray, the builder workers would start
now, and starting them is the longest wait of the call. So this process builds batches
from the front (as the local executor does) while builder tasks take batches from the
back as soon as their workers are up; results are handed over in order. A task whose
batch fails, or that cannot be sent at all, leaves its batch to this process: nothing
is lost and the rows are the same. `raycap.rows.executor.decide` says when a call is cold.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterator, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycap.capture.directory import CaptureDir
from raycap.cluster.plumbing import task as _task
from raycap.cluster.plumbing.task import Source
from raycap.output.shards import shard_writer
from raycap.rows.local import LOCAL_BATCH_ROLLOUTS, FreezeAhead, Progress, build_local_batch
from raycap.rows.options import RebuildOptions

logger = logging.getLogger(__name__)

COLD_BATCHES_PER_CPU = 8  # batches per CPU in a cold call: finer costs more per batch than it balances


BUILD_HERE = object()  # a cold task's batch that the driver builds itself


class ColdPlan:
    """The batches of a cold call, shared by the driver (front) and a feeder thread
    that keeps builder tasks busy from the back; results are handed over in order."""

    def __init__(
        self, batches: list[list[str]], dirs: Sequence[CaptureDir], options: RebuildOptions, shard_dir: str | None, *, limit: int
    ):
        self.batches = batches
        self.options = options
        self.shard_dir = shard_dir
        self.limit = limit
        self.here = ray.get_runtime_context().get_node_id()
        self.sources = [Source(d.label, d.path, self.here, None) for d in dirs]
        self.front, self.back = 0, len(batches)
        self.results: dict[int, Any] = {}
        self.running: dict[Any, int] = {}  # refs of the tasks in flight, to their batches
        self.stopped = False
        self.changed = threading.Condition()
        self.task = _task.build_batch_task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(self.here, soft=True))

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
        """Send tasks for batches from the back until `limit` run. A batch whose task
        cannot be sent is the driver's."""
        while len(self.running) < self.limit and (index := self._take_back()) is not None:
            try:
                ref = self.task.remote(index, self.batches[index], self.sources, None, self.options, self.shard_dir)
            except BaseException:
                self.settle(index, BUILD_HERE)
                raise
            self.running[ref] = index

    def feed(self) -> None:
        """The feeder thread: a task per batch from the back while any are left."""
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
                        logger.debug("cold builder task for batch %d failed (%s); building it here", self.running[ref], exc)
                        result = BUILD_HERE
                    self.settle(self.running.pop(ref), result)
        except BaseException as exc:  # noqa: BLE001 - whatever this thread took, the driver builds
            self.build_here(exc)

    def build_here(self, exc: BaseException) -> None:
        """Tasks cannot be sent: the driver builds what they took, and the rest."""
        logger.debug("cold builder tasks stopped (%s); this process builds their batches", exc)
        self.stop()
        while self.running:
            self.settle(self.running.popitem()[1], BUILD_HERE)


def run_cold(
    dirs: Sequence[CaptureDir],
    ids: list[str],
    options: RebuildOptions,
    *,
    shard_dir: str | None,
    progress: Callable[[Progress], None] | None,
    after: Callable[[], None],
) -> Iterator[Any]:
    """A session's first call on a running single-node Ray: this process builds
    batches from the front while builder tasks take them from the back, as soon as
    workers are up; neither waits for the other, and no actor is needed (the tasks
    freeze on this node themselves). A feeder thread hands the tasks their next
    batch the moment one returns, so a worker never waits for this process.
    `after` runs once every batch is out (the session starts its actors there)."""
    state = Progress(total=len(ids))
    if progress:
        progress(state)
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    step = options.batch_size or max(1, min(LOCAL_BATCH_ROLLOUTS, -(-len(ids) // (COLD_BATCHES_PER_CPU * cpus))))
    batches = [ids[start : start + step] for start in range(0, len(ids), step)]
    plan = ColdPlan(batches, dirs, options, shard_dir, limit=max(1, cpus - 1))
    # The first task is sent from here, before this process starts building: its
    # worker's start is the longest wait of the call.
    try:
        plan.submit()
    except Exception as exc:  # noqa: BLE001 - this process builds everything instead
        plan.build_here(exc)
    feeder = threading.Thread(target=plan.feed, name="raycap-cold-feeder", daemon=True)
    feeder.start()
    ahead = FreezeAhead([d.path for d in dirs], options.max_capture_bytes)
    write = shard_writer(shard_dir)
    try:
        next_out = 0
        while next_out < len(batches):
            index = plan.take_front()
            if index is not None:
                frozen = ahead.take(index, batches[index])
                if plan.front < plan.back:
                    ahead.start(index + 1, batches[index + 1])
                plan.settle(index, build_local_batch(dirs, index, batches[index], options, write=write, frozen=frozen))
            for result in plan.ready_from(next_out, wait=index is None):
                if result is BUILD_HERE:
                    # The task's batch failed (its worker died, say): built here instead.
                    result = build_local_batch(dirs, next_out, batches[next_out], options, write=write)
                state.done += len(batches[next_out])
                next_out += 1
                if progress:
                    progress(state)
                yield result
    finally:
        plan.stop()
        ahead.close()
    # Now the actors, and the workers this call did not use, for the next call:
    # started earlier, they would have competed with this one for the cores.
    after()
    for _ in range(cpus):
        _task.warm_task.remote()
