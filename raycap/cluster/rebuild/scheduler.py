"""The scheduler: batches in, results out in rollout order, a bounded number in flight.

A call on a fleet freezes its ids ahead of building, `freeze_step` ids at a time,
through the directories' actors (or, when every directory is served from one node, lets
each builder task freeze its own batch there), cuts the frozen ids into batches by
frozen bytes, keeps at most `max_in_flight` builder tasks running and yields their
results in the order of the ids. In a call of at most one batch per CPU on this
process's own node (a training step), this process builds the first batch itself while
the tasks build the others, or builds it all, whichever the steps before timed faster
(`StepSplit`); it then builds any task's batch that its task has not claimed yet
(`raycap.rows.claims`) instead of waiting for a worker without a core; a `Rebuilder`'s such call
hands every batch the directory's spare files to freeze with (`raycap.capture.spares`)
and has more made once it is done. A batch whose directory's node is gone is failed at
once, as masked rows naming the directory and saying that a rebuild later is safe,
instead of waiting on restarts that can never be scheduled; the call records what it
lost (`dead`, `actor_died`) so the session places its directories again on the next
call.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycap.capture.outcomes import FreezeFailed, Part
from raycap.capture.spares import SparePool, Spares
from raycap.capture.store import FrozenCapture
from raycap.cluster.nodes.fleet import Fleet
from raycap.cluster.plumbing import task as _task
from raycap.cluster.plumbing.failures import SAFE_LATER, cause_text, is_lost, lost_node_error, output_fault
from raycap.cluster.plumbing.placement import LIVENESS_CHECK_S, dead_nodes
from raycap.cluster.plumbing.task import TASK_MAX_RETRIES, SharedRows, Source
from raycap.cluster.rebuild.step_split import StepSplit
from raycap.errors import NodesLost  # noqa: F401 - raised here, declared with the others
from raycap.rows.batch import cut, failed_rows
from raycap.rows.claims import Claim, new_claim
from raycap.rows.local import Progress
from raycap.rows.options import RebuildOptions

logger = logging.getLogger(__name__)

MAX_BATCH_ROLLOUTS = 64
MIN_BATCH_BYTES = 1 << 20
FREEZE_AHEAD = 1024  # the most ids frozen ahead at a time when batch_size is None (see freeze_step)
DIRECT_MIN_PER_TASK = 32
# How long builder tasks may wait with none finishing before a cluster with no free CPU
# is named as the reason (once per call): they start only when a CPU is freed.
STALL_WARN_S = 30.0


def plan_ids(fleet: Fleet, rollout_ids: Sequence[str] | None, skip_retired: bool) -> tuple[list[str], list[tuple[int, ...]] | None]:
    """The ids to build and, when listing, the directories holding each (by index).

    Explicit ids are not looked up: each directory is asked to freeze the ones it holds,
    so a call costs in proportion to its ids, not to the directories' history."""
    if rollout_ids is not None:
        return list(rollout_ids), None
    refs = [h.rollout_ids(skip_retired=skip_retired) for h in fleet.handles]
    holders: dict[str, list[int]] = defaultdict(list)
    for index, (d, ref) in enumerate(zip(fleet.dirs, refs)):
        try:
            listing = ray.get(ref)
        except ray.exceptions.RayError as exc:
            # Without a listing the rollouts of this directory are unknown: no row can be
            # right, so this is the one failure that stops a rebuild.
            raise RuntimeError(f"listing capture directory {d.label} failed: {cause_text(exc)}") from exc
        for rid in listing:
            holders[rid].append(index)
    ids = sorted(holders)
    return ids, [tuple(holders[rid]) for rid in ids]


@dataclass
class Batch:
    """The consecutive rollouts one builder task builds, and what it depends on."""

    index: int
    ids: list[str]
    sources: list[Source]
    nodes: set[str]
    frozen: list[list] | None
    spares: Spares | None = None  # spare files its task freezes with (raycap.capture.spares)
    claim: Claim | None = None  # when this process may build it instead (raycap.rows.claims)


def _cancel(ref: Any) -> None:
    try:
        ray.cancel(ref)
    except Exception:  # noqa: BLE001 - the result is abandoned either way
        pass


def wait_all(refs: list, nodes: set[str]) -> None:
    """Wait for `refs`, checking every LIVENESS_CHECK_S that `nodes` are alive: a
    restart pinned to a dead node can never be scheduled, so waiting on it is pointless."""
    pending = list(refs)
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=LIVENESS_CHECK_S)
        if pending:
            dead = dead_nodes(nodes)
            if dead:
                raise NodesLost(dead)


class BatchScheduler:
    """One rebuild call on a fleet: freeze ahead of building, cut batches by bytes, keep
    a bounded number of builder tasks in flight, yield results in rollout order."""

    def __init__(
        self,
        fleet: Fleet,
        ids: list[str],
        holders: list[tuple[int, ...]] | None,
        options: RebuildOptions,
        *,
        cpus: int,
        shard_dir: str | None,
        progress: Callable[[Progress], None] | None,
        spares: SparePool | None = None,
        split: StepSplit | None = None,
    ):
        self.fleet, self.ids, self.holders, self.options = fleet, ids, holders, options
        self.spares = spares  # the directory's spare files, for a training step's batches
        self.split = split or StepSplit()  # a step's cut, learned by the session across steps
        self.started = 0.0  # when this process began its own batch of a step (time.time())
        self.here_s: tuple[int, float] | None = None  # that batch: ids, seconds
        self.weighed = False  # whether the session's split cut this call (a step)
        self.cpus, self.batch_size, self.shard_dir, self.progress = cpus, options.batch_size, shard_dir, progress
        self.max_in_flight = options.max_in_flight or 2 * cpus + 2
        self.dead: set[str] = set()
        self.state = Progress(total=len(ids))
        self.batches: list[Batch] = []
        self.labels = [d.label for d in fleet.dirs]
        self.actor_died = False
        self.target_bytes: int | None = None
        self.stalled_since: float | None = None  # since when no pending task has finished
        self.stall_told = False
        # Freezing runs ahead of building, `freeze_step` ids at a time: small enough that
        # the first tasks start early, large enough that a step's ids are one round trip
        # per directory.
        if self.batch_size is not None:
            self.freeze_step = self.batch_size * self.max_in_flight
        else:
            self.freeze_step = max(MAX_BATCH_ROLLOUTS, min(FREEZE_AHEAD, -(-len(ids) // 4)))

    # -- freezing ------------------------------------------------------------------------

    def _sources(self, dir_indices: Iterable[int]) -> list[Source]:
        fleet = self.fleet
        return [Source(fleet.dirs[d].label, fleet.dirs[d].path, fleet.nodes[d], fleet.handles[d]) for d in dir_indices]

    def _freeze_ahead(self, start: int, stop: int) -> None:
        """Freeze ids[start:stop] in the directories that hold them (all directories,
        asked to skip ids they do not hold, when the holders are not known) and cut them
        into batches by frozen bytes."""
        ids = self.ids[start:stop]
        fleet = self.fleet
        n_dirs = len(fleet.dirs)
        asked: dict[int, list[int]] = defaultdict(list)  # directory -> positions in ids
        if self.holders is None:
            for d in range(n_dirs):
                asked[d] = list(range(len(ids)))
        else:
            for i, held in enumerate(self.holders[start:stop]):
                for d in held:
                    asked[d].append(i)
        only_held = self.holders is None and n_dirs > 1
        parts: list[dict[int, Part]] = [{} for _ in ids]
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
            batches = [list(range(i, min(i + self.batch_size, len(ids)))) for i in range(0, len(ids), self.batch_size)]
        else:
            if self.target_bytes is None:
                # About a sixteenth of each CPU's share of the whole call (estimated from
                # the first ids frozen): enough tasks to balance rollouts of very
                # different sizes, few enough that per-task overhead stays negligible.
                estimate = sum(sizes) * len(self.ids) // max(1, len(ids))
                self.target_bytes = max(estimate // (16 * self.cpus), MIN_BATCH_BYTES)
            batches = cut(sizes, self.target_bytes, MAX_BATCH_ROLLOUTS)
        for positions in batches:
            holding = sorted({d for i in positions for d, p in parts[i].items() if p is not None})
            sources = self._sources(holding)
            frozen = [[parts[i].get(d) for i in positions] for d in holding]
            # The nodes the task needs: those with frozen bytes still to read.
            nodes = {s.node for s, held in zip(sources, frozen) if any(isinstance(p, FrozenCapture) for p in held)}
            self.batches.append(Batch(len(self.batches), [ids[i] for i in positions], sources, nodes, frozen))

    def _freeze_into(self, parts: list[dict[int, Part]], ids: list[str], asked: dict[int, list[int]], only_held: bool) -> None:
        fleet = self.fleet
        live = {d: positions for d, positions in asked.items() if fleet.nodes[d] not in self.dead}
        for d, positions in asked.items():
            if d not in live:
                for i in positions:
                    parts[i][d] = FreezeFailed(self._lost_text_for([d]))
        refs = {
            d: fleet.handles[d].freeze_batch(
                [ids[i] for i in positions], read=False, held_only=only_held, max_bytes=self.options.max_capture_bytes
            )
            for d, positions in live.items()
        }
        try:
            wait_all(list(refs.values()), {fleet.nodes[d] for d in live})
        except NodesLost as lost:
            self._markdead_nodes(lost.nodes)
        for d, ref in refs.items():
            positions = live[d]
            if fleet.nodes[d] in self.dead:
                _cancel(ref)
                outcome = [FreezeFailed(self._lost_text_for([d]))] * len(positions)
            else:
                try:
                    outcome = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - the directory's rollouts become masked rows
                    outcome = [FreezeFailed(self._error_for(exc, [d]))] * len(positions)
            for i, part in zip(positions, outcome):
                parts[i][d] = part

    # -- failures ------------------------------------------------------------------------

    def _markdead_nodes(self, nodes: set[str]) -> None:
        if nodes - self.dead:
            labels = [label for label, node in zip(self.labels, self.fleet.nodes) if node in nodes]
            logger.warning("node(s) %s serving %s are gone; their pending rollouts are masked", sorted(nodes), labels)
        self.dead |= nodes

    def _lost_text_for(self, dir_indices: Sequence[int]) -> str:
        return lost_node_error([self.labels[d] for d in dir_indices], [self.fleet.nodes[d] for d in dir_indices])

    def _lost_text(self, batch: Batch) -> str:
        lost = [s for s in batch.sources if s.node in self.dead and s.node in batch.nodes]
        return lost_node_error([s.label for s in lost], [s.node for s in lost])

    def _error_for(self, exc: BaseException, dir_indices: Sequence[int]) -> str:
        """The error of rows whose freeze or batch failed as a whole."""
        nodes = {self.fleet.nodes[d] for d in dir_indices}
        if is_lost(exc):
            dead = dead_nodes(nodes)
            if dead:
                self._markdead_nodes(dead)
                return self._lost_text_for([d for d in dir_indices if self.fleet.nodes[d] in dead])
            if isinstance(exc, ray.exceptions.RayActorError) or isinstance(getattr(exc, "cause", None), ray.exceptions.RayActorError):
                self.actor_died = True
                kind, _, reason = cause_text(exc).partition(": ")
                where = ", ".join(self.labels[d] for d in dir_indices)
                return f"{kind}: the actor serving capture directory {where} died and was not restarted ({reason}); {SAFE_LATER}"
            return f"{cause_text(exc)} (the builder task of this batch failed {TASK_MAX_RETRIES + 1} times); {SAFE_LATER}"
        if isinstance(exc, ray.exceptions.RayTaskError):
            return f"{cause_text(exc)} (raised by the builder task of this batch)"
        return f"{cause_text(exc)} (the builder task of this batch failed {TASK_MAX_RETRIES + 1} times)"

    def _batch_error(self, exc: BaseException, batch: Batch) -> str:
        indices = [self.labels.index(s.label) for s in batch.sources]
        return self._error_for(exc, indices)

    def _failed_result(self, batch: Batch, error: str) -> Any:
        logger.warning(
            "batch of %d rollouts (%s..) failed, masking them: %s", len(batch.ids), batch.ids[0] if batch.ids else "", error
        )
        dirs = [[s.label for s in batch.sources]] * len(batch.ids)
        table = failed_rows(batch.ids, dirs, self.options.builder, self.options.model, error, self.options.delivery)
        if self.shard_dir is None:
            return table
        from raycap.output.shards import write_shard

        return write_shard(self.shard_dir, batch.index, table)

    # -- the loop ------------------------------------------------------------------------

    def _submit(self, batch: Batch) -> Any:
        task = _task.build_batch_task
        if len(batch.nodes) == 1:
            # The builder prefers the node that holds the captures and then reads them
            # from disk itself; anywhere else it gets the bytes through the actor.
            task = task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(next(iter(batch.nodes)), soft=True))
        if batch.claim is not None:
            return task.remote(
                batch.index, batch.ids, batch.sources, batch.frozen, self.options, self.shard_dir, batch.spares, batch.claim
            )
        return task.remote(batch.index, batch.ids, batch.sources, batch.frozen, self.options, self.shard_dir, batch.spares)

    def _direct_batches(self) -> bool:
        """When every directory is served from one node, builder tasks freeze their own
        batches there: no round trip before building, and the freezes of different
        batches run in parallel. A batch is cut by count (sizes are not known before
        freezing; the task then reads at most `raycap.rows.batch.READ_BYTES` of captures at a
        time)."""
        nodes = set(self.fleet.nodes)
        if len(nodes) != 1 or nodes & self.dead or not self.ids:
            return False
        sources = self._sources(range(len(self.fleet.dirs)))
        n = len(self.ids)
        if self.batch_size is not None:
            parts = -(-n // self.batch_size)
        else:
            # A few batches per CPU for balance, none smaller than DIRECT_MIN_PER_TASK
            # rollouts (a 64-id step is one batch per CPU) or larger than MAX_BATCH_ROLLOUTS.
            parts = max(1, min(4 * self.cpus, n // DIRECT_MIN_PER_TASK))
            parts = max(-(-n // MAX_BATCH_ROLLOUTS), self.cpus * -(-parts // self.cpus))
            parts = min(parts, n)
        step = -(-n // parts)
        for start in range(0, n, step):
            self.batches.append(Batch(len(self.batches), self.ids[start : start + step], sources, set(nodes), None))
        return True

    def _batch_here(self) -> Batch | None:
        """The batch this process builds itself while builder tasks build the others: the
        first (cut again by `_weigh_here`), in a call of at most one batch per CPU (a
        training step's ids) whose directories are all on this process's node and whose
        rows come back here. Such a
        call lasts as long as its slowest batch, and a task's batch also waits for Ray to
        start it and to ship its rows back (about ten milliseconds in all), where this
        process, which would only wait, has the directories at hand. A larger call, and
        one writing shards, is left to the tasks, so this process's cost stays flat; so is
        a directory this process cannot see where the node's workers do (another mount)."""
        if self.shard_dir is not None or len(self.batches) > self.cpus or ray.util.client.ray.is_connected():
            return None
        if set(self.fleet.nodes) != {ray.get_runtime_context().get_node_id()}:
            return None
        if not all(os.path.isdir(_task.local_path(source.path)) for source in self.batches[0].sources):
            return None
        return self._weigh_here()

    def _weigh_here(self) -> Batch:
        """The batches cut again so that the first, the one this process builds, holds
        what the session's `StepSplit` leaves it. This process starts at once; a task's
        batch first waits for Ray to start it, runs in a worker Ray starts at a lower
        priority, and has its rows shipped back: cut in halves, a 64-id step on two CPUs
        waited a third of its time for the task after its own batch was built (see
        docs/performance.md). A call whose batch size was asked for keeps it."""
        n, tasks = len(self.ids), len(self.batches) - 1
        if self.batch_size is not None or tasks < 1:
            return self.batches[0]
        per_task = self.split.task_ids(n, tasks)
        self.weighed = True
        template = self.batches[0]
        if per_task < 1:
            # Built alone, as the split chose (see StepSplit).
            self.batches = [Batch(0, list(self.ids), template.sources, set(template.nodes), None)]
            return self.batches[0]
        first = n - per_task * tasks
        bounds = [0, *range(first, n + 1, per_task)]
        self.batches = [
            Batch(k, self.ids[start:stop], template.sources, set(template.nodes), None)
            for k, (start, stop) in enumerate(zip(bounds, bounds[1:]))
        ]
        return self.batches[0]

    def _share(self, here: Batch) -> None:
        """Give the builder tasks' batches of a step claims (`raycap.rows.claims`), so that
        this process, its own batch built, builds those whose tasks have not started
        instead of waiting for them. A batch of several directories is not shared."""
        for batch in self.batches:
            if batch is not here and batch.frozen is None and len(batch.sources) == 1:
                batch.claim = new_claim()

    def _steal(self, pending: dict[Any, Batch], results: dict[int, Any]) -> None:
        """Build here the shared batches whose tasks have not claimed them yet (the last
        first); their tasks are cancelled."""
        for ref, batch in sorted(pending.items(), key=lambda item: -item[1].index):
            if batch.claim is not None and batch.claim.take():
                del pending[ref]
                _cancel(ref)
                self._measure(batch, None)
                results[batch.index] = self._build_here(batch)
                self._advance(batch)

    def _shared_rows(self, batch: Batch, got: SharedRows) -> Any:
        """A shared batch's rows from its task's answer: built here now when the task lost
        the claim while this process did not take it (a task attempt that died after
        claiming it, or one that ran where the claim is not visible)."""
        if got.rows is None:
            return self._build_here(batch)
        self._measure(batch, got.built_at - self.started)
        return got.rows

    def _measure(self, batch: Batch, seconds: float | None) -> None:
        """Tell the session's split how a shared batch's task kept up (see `StepSplit`):
        its rows were built `seconds` after this process began its own batch; None when
        this process built that batch instead."""
        if self.here_s is not None:
            self.split.measured(*self.here_s, len(batch.ids), seconds)

    def _build_here(self, batch: Batch) -> Any:
        """`batch` frozen and built in this process, as its builder task would (each
        rollout's failure is its own masked row); a batch that fails as a whole is masked."""
        try:
            built = _task.build_one_batch(
                batch.index, batch.ids, batch.sources, batch.frozen, self.options, None, batch.spares
            )
            return built.table
        except Exception as exc:  # noqa: BLE001 - the batch's rows are masked, as a failed task's are
            return self._failed_result(batch, f"{cause_text(exc)} (raised while this process built the batch)")

    def run(self) -> Iterator[Any]:
        if self.progress:
            self.progress(self.state)
        frozen_upto = len(self.ids) if self._direct_batches() else 0
        here = self._batch_here() if frozen_upto else None
        spares = self.spares if here is not None else None
        if spares is not None:
            for batch in self.batches:
                batch.spares = spares.take(len(batch.ids))
        if here is not None:
            self._share(here)
        started = time.perf_counter()
        try:
            yield from self._run(frozen_upto, here)
            if self.weighed:
                self.split.stepped(len(self.ids), time.perf_counter() - started)
        finally:
            for batch in self.batches:
                if batch.claim is not None:
                    batch.claim.drop()  # a task that starts after the call builds nothing
            if spares is not None:
                spares.refill(len(self.ids))  # once the step's tasks are done with theirs

    def _run(self, frozen_upto: int, here: Batch | None) -> Iterator[Any]:
        pending: dict[Any, Batch] = {}
        results: dict[int, Any] = {}
        next_out = submitted = 0
        while frozen_upto < len(self.ids) or next_out < len(self.batches):
            # Freeze ahead while the queue of batches to submit is short.
            while frozen_upto < len(self.ids) and len(self.batches) - submitted < self.max_in_flight:
                stop = min(frozen_upto + self.freeze_step, len(self.ids))
                self._freeze_ahead(frozen_upto, stop)
                frozen_upto = stop
            while submitted < len(self.batches) and len(pending) < self.max_in_flight and submitted - next_out < 4 * self.max_in_flight:
                batch = self.batches[submitted]
                submitted += 1
                if batch is here:
                    continue
                if batch.nodes & self.dead:
                    # Its captures' node is gone: fail it now instead of waiting on restarts
                    # that can never be scheduled.
                    results[batch.index] = self._failed_result(batch, self._lost_text(batch))
                    self._advance(batch)
                else:
                    pending[self._submit(batch)] = batch
            if here is not None:
                # The builder tasks of the other batches are submitted: build this one
                # meanwhile, then what the tasks have not started of theirs.
                self.started = time.time()  # the clock a task's `built_at` is on (this node's)
                results[here.index] = self._build_here(here)
                self.here_s = (len(here.ids), time.time() - self.started)
                self._advance(here)
                here = None
                self._steal(pending, results)
            if pending:
                done, _ = ray.wait(list(pending), num_returns=1, timeout=LIVENESS_CHECK_S)
                if not done:
                    self._check_pending(pending, results)
                    self._check_stalled(len(pending))
                else:
                    self.stalled_since = None
                for ref in done:
                    batch = pending.pop(ref)
                    try:
                        got = ray.get(ref)
                        results[batch.index] = got if batch.claim is None else self._shared_rows(batch, got)
                    except Exception as exc:  # noqa: BLE001 - a lost batch becomes masked rows
                        fault = output_fault(exc)
                        if fault is not None:
                            # The output's file system failed: the run fails, and nothing
                            # of it may be committed as masked rows that a rerun would reuse.
                            for other in pending:
                                _cancel(other)
                            raise fault from None
                        results[batch.index] = self._failed_result(batch, self._batch_error(exc, batch))
                    del ref
                    self._advance(batch)
            while next_out in results:
                yield results.pop(next_out)
                self.batches[next_out].frozen = []
                next_out += 1

    def refs(self) -> list[Any]:
        """Freeze everything and submit every batch; the ObjectRefs of their results,
        in row order (a batch lost up front is a ref to its masked rows)."""
        if not self._direct_batches():
            for start in range(0, len(self.ids), self.freeze_step):
                self._freeze_ahead(start, min(start + self.freeze_step, len(self.ids)))
        out = []
        for batch in self.batches:
            if batch.nodes & self.dead:
                out.append(ray.put(self._failed_result(batch, self._lost_text(batch))))
            else:
                out.append(self._submit(batch))
        return out

    def _check_pending(self, pending: dict[Any, Batch], results: dict[int, Any]) -> None:
        """Fail at once the pending batches whose directories' nodes are gone."""
        dead = dead_nodes({node for batch in pending.values() for node in batch.nodes})
        if not dead:
            return
        self._markdead_nodes(dead)
        for ref, batch in list(pending.items()):
            if batch.nodes & self.dead:
                del pending[ref]
                _cancel(ref)
                results[batch.index] = self._failed_result(batch, self._lost_text(batch))
                self._advance(batch)

    def _check_stalled(self, pending: int) -> None:
        """Say once why builder tasks that have waited STALL_WARN_S have not finished,
        when the reason is that the cluster has no free CPU to start them on."""
        now = time.monotonic()
        if self.stalled_since is None:
            self.stalled_since = now
        if self.stall_told or now - self.stalled_since < STALL_WARN_S:
            return
        self.stall_told = True
        try:
            free = ray.available_resources().get("CPU", 0.0)
        except Exception:  # noqa: BLE001 - a hint only
            return
        if free < 1:
            logger.warning(
                "%d batches of rollouts have waited %.0f s for a CPU: every CPU of the cluster is held (by other "
                "actors or tasks), and they start only when one is freed; free a CPU, or rebuild with "
                "executor='local'", pending, now - self.stalled_since,
            )

    def _advance(self, batch: Batch) -> None:
        self.state.done += len(batch.ids)
        if self.progress:
            self.progress(self.state)
