"""The local executor on several cores: batches finalized by this process and by other runners at once.

Finalizing a batch is Python work that holds the interpreter, so one process uses one
core. `finalize_pooled` serves runners (worker processes, `raycap.finalize.worker`, on
this machine or beside a one-node Ray's driver; Ray actors there where forking is not
safe, `raycap.cluster.finalizer`) and this process: batches are taken in order from one
iterator by whichever is free, this process or a thread per runner that hands it the
next batch and waits for the reply (the thread only waits). The driver holds
only the batches in flight and the reports not yet yielded, which come out in batch order.

A runner writes behind: `LocalRunner`, how this process and each worker process finalize,
computes a batch's records and rows in the calling thread and writes them (records part
and shard, each fsynced, `raycap.finalize.batch.write_batch`) on a thread of its own while
the next batch is computed, one write at a time, so a core does not wait on the disk. A
batch counts as finalized only once its writes are durable: `hand` returns the outcomes of
the batches whose writes ended, `finish` the last one's.

A batch that fails raises the exception it raised where it ran (a line that is not JSON
is the same `ResultsError`); a runner that is lost (a worker that dies, cannot start, or
makes no progress for `worker_stall_s` and is killed) leaves the batches it had not
finished to this process (`_RunnerLost`, one warning). When
the run stops, for whatever reason, the runners are stopped and waited for, writes in
flight included, before the staging directory goes.

This module does not import Ray.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Protocol, Sequence

from raycap.finalize.batch import FinalizedBatch, prepare_batch, write_batch
from raycap.finalize.heap import roomy_heap
from raycap.finalize.results import ResultsBatch, ResultsScan

logger = logging.getLogger(__name__)

# What a runner reports of a batch: its index, whether it was finalized, and its report
# (a FinalizedBatch) or the exception it raised.
Outcome = tuple[int, bool, Any]


class Runner(Protocol):
    """Finalizes batches, one computed at a time: `ready` returns once it has started and
    can take a batch at once; `hand` gives it a batch and returns once it can take
    another, with the outcomes of the batches it finished meanwhile; `finish` returns the
    rest once written; `stop` ends whatever it still runs, a runner that never started
    included. A runner that is lost raises `_RunnerLost` with the batches it had not
    finished."""

    def ready(self) -> None: ...

    def hand(self, batch: ResultsBatch, data: bytes) -> list[Outcome]: ...

    def finish(self) -> list[Outcome]: ...

    def stop(self) -> None: ...


class _RunnerLost(RuntimeError):
    """A runner that died or stopped answering (not a batch's fault): `batches` (with
    their bytes) were not finalized, and this process finalizes them instead."""

    def __init__(self, message: str, batches: Sequence[tuple[ResultsBatch, bytes]]):
        super().__init__(message)
        self.batches = list(batches)


class LocalRunner:
    """Finalizes batches in this process, reading the capture directories in place
    (`context`: see `here_context`), as the local executor does; each batch is written
    behind the next (see the module docstring). Called with a batch, it finalizes that
    batch alone, stops, and returns its report. With `keep_lines`, each report keeps the
    lines its records part was written from (`FinalizedBatch.lines`), for a records file
    drafted in this process."""

    def __init__(self, context: tuple, keep_lines: bool = False) -> None:
        from raycap.capture.store import TokenCaptureStore
        from raycap.rows.batch import read_in
        from raycap.rows.local import freeze_local_batch

        paths, labels, label, options, fields, self.staging = context
        stores = [TokenCaptureStore(path, create=False) for path in paths]

        def prepare(batch: ResultsBatch, data: bytes) -> Any:
            return prepare_batch(
                data, batch, label=label, labels=labels,
                freeze=lambda ids: freeze_local_batch(paths, ids, options.max_capture_bytes),
                read=lambda k, parts: read_in(stores[k], parts), options=options, fields=fields,
            )

        self.prepare = prepare
        self.keep_lines = keep_lines
        self.writer: ThreadPoolExecutor | None = None
        self.writing: tuple[int, Future] | None = None
        self.heap = roomy_heap()  # until stop (raycap.finalize.heap)

    def ready(self) -> None:
        """Started (constructed, with everything imported): it takes a batch at once."""

    def hand(self, batch: ResultsBatch, data: bytes) -> list[Outcome]:
        try:
            prepared = self.prepare(batch, data)
        except Exception as exc:  # noqa: BLE001 - the batch's outcome; the run decides
            return [*self.finish(), (batch.index, False, exc)]  # an earlier batch's failure comes first
        done = self.finish()
        if self.writer is None:
            self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raycap-finalize-write")
        self.writing = (batch.index, self.writer.submit(write_batch, prepared, self.staging, self.keep_lines))
        return done

    def finish(self) -> list[Outcome]:
        if self.writing is None:
            return []
        (index, writing), self.writing = self.writing, None
        try:
            return [(index, True, writing.result())]
        except Exception as exc:  # noqa: BLE001 - the batch's outcome; the run decides
            return [(index, False, exc)]

    def stop(self) -> None:
        # A write in flight ends before the caller removes the staging directory.
        try:
            if self.writer is not None:
                self.writer.shutdown(wait=True)
        finally:
            self.heap.release()

    def __call__(self, batch: ResultsBatch, data: bytes) -> FinalizedBatch:
        """Finalize `batch` alone, then stop (the heap's padding goes with it): its report."""
        try:
            return only_report(batch, [*self.hand(batch, data), *self.finish()])
        finally:
            self.stop()


def reports(outcomes: list[Outcome]) -> list[FinalizedBatch]:
    """The reports among `outcomes`, raising the first failure among them."""
    for _, ok, value in outcomes:
        if not ok:
            raise value
    return [value for _, _, value in outcomes]


def only_report(batch: ResultsBatch, outcomes: list[Outcome]) -> FinalizedBatch:
    """The report of `batch` among `outcomes`, raising the first failure among them."""
    return next(report for report in reports(outcomes) if report.index == batch.index)


def local_finalizer(context: tuple, keep_lines: bool = False) -> LocalRunner:
    """This process's runner (see `LocalRunner`)."""
    return LocalRunner(context, keep_lines)


def finalize_pooled(
    scan: ResultsScan,
    start: Callable[[], list[Runner]],
    here: Runner,
) -> Iterator[FinalizedBatch]:
    """Each batch of `scan` finalized by this process (`here`) or by one of the
    runners `start` gives (worker processes, Ray tasks), whichever is free, reported in
    batch order. A failure raises the exception of the first batch that failed, once
    that batch's turn comes or as soon as this process would wait. A runner that cannot
    be started, or is lost, leaves its batches to this process: nothing is lost and the
    output is the same."""
    source = scan.read()
    taking = threading.Lock()
    results: dict[int, tuple[bool, Any]] = {}
    ready = threading.Condition()
    stopping = threading.Event()
    runners: list[Runner] = []
    threads: list[threading.Thread] = []
    returned: deque[tuple[ResultsBatch, bytes]] = deque()  # batches of lost runners

    def settle(outcomes: list[Outcome]) -> None:
        with ready:
            for index, ok, value in outcomes:
                results[index] = (ok, value)
                if not ok:
                    stopping.set()
            ready.notify_all()

    def take() -> tuple[ResultsBatch, bytes] | None:
        with taking:
            if stopping.is_set():
                return None
            try:
                return next(source)
            except StopIteration:
                return None
            except BaseException as exc:  # noqa: BLE001 - the file changed: the driver raises it
                settle([(-1, False, exc)])
                return None

    def feed(runner: Runner) -> None:
        try:
            # A batch goes to a runner only once it has started: one still starting (a
            # worker importing raycap, an actor waiting for a CPU the cluster may never
            # free) holds no batch this process could finalize meanwhile.
            runner.ready()
            while not stopping.is_set():
                item = take()
                if item is None:
                    break
                settle(runner.hand(*item))
            settle(runner.finish())
        except _RunnerLost as exc:
            if stopping.is_set():
                return  # stopped by the run's end or failure: its batches are no longer wanted
            logger.warning("%s; this process finalizes its batches instead", exc)
            with ready:
                returned.extend(exc.batches)
                ready.notify_all()
        except BaseException as exc:  # noqa: BLE001 - the driver raises it
            settle([(-1, False, exc)])

    def take_here() -> tuple[ResultsBatch, bytes] | None:
        with ready:
            if returned:
                return returned.popleft()
        return take()

    def waiting_on_others() -> bool:
        return (
            next_out not in results and -1 not in results and not returned
            and all(ok for ok, _ in results.values()) and any(t.is_alive() for t in threads)
        )

    next_out, total = 0, len(scan.batches)
    try:
        try:
            runners.extend(start())
        except Exception as exc:  # noqa: BLE001 - this process finalizes every batch instead
            logger.warning("could not start workers to finalize %s (%s); finalizing in this process", scan.label, exc)
        for runner in runners:
            thread = threading.Thread(target=feed, args=(runner,), name="raycap-finalize-feed", daemon=True)
            thread.start()
            threads.append(thread)
        while next_out < total:
            with ready:
                _raise_failure(results)
                reply = results.pop(next_out, None)
            if reply is not None:
                yield reply[1]
                next_out += 1
                continue
            item = take_here()
            if item is not None:
                settle(here.hand(*item))
                continue
            settle(here.finish())  # nothing left to take: this process's last write
            with ready:
                while waiting_on_others():
                    ready.wait(0.5)
                _raise_failure(results)
                if next_out not in results and -1 not in results and not returned:
                    raise RuntimeError(f"finalizing {scan.label} stopped before batch {next_out} was finalized; rerun")
        # Every batch was read: the iterator's end checks the file's digest (here, or
        # in the thread that took past the last batch, which reports what it found).
        with taking:
            for _ in source:
                pass
        with ready:
            _raise_failure(results)
    finally:
        stopping.set()
        for runner in runners:
            _stop(runner, scan.label)
        for thread in threads:
            thread.join()
        here.stop()
        source.close()


def _stop(runner: Runner, label: str) -> None:
    """Stop a runner; one that fails to stop cleanly is logged, never raised: the run's
    own outcome (its failure, if any) is what the caller hears of."""
    try:
        runner.stop()
    except Exception as exc:  # noqa: BLE001 - logged; the run's outcome stands
        logger.warning("stopping a worker that finalized batches of %s failed: %s: %s", label, type(exc).__name__, exc)


def _raise_failure(results: dict[int, tuple[bool, Any]]) -> None:
    """Raise the first failure reported so far: the results file's, else the batch's
    that comes first."""
    failed = sorted(index for index, (ok, _) in results.items() if not ok)
    if failed:
        raise results[failed[0]][1]


def here_context(
    dirs: Sequence[Any], label: str, options: Any, fields: tuple, staging: Any
) -> tuple:
    """What a runner needs to finalize batches as this process does."""
    return ([d.path for d in dirs], [d.label for d in dirs], label, options, fields, staging)


def context_options(context: tuple) -> Any:
    """The run's `RebuildOptions` in a `here_context`."""
    return context[3]
