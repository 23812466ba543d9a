"""The local executor on several cores: batches finalized by this process and by worker processes.

Finalizing a batch is Python work that holds the interpreter, so one process uses one
core. When the work is large enough to pay for starting a process (`workers`: its
captures weigh `POOL_MIN_BYTES` or more, and more than one CPU is usable), the local
executor starts a worker process per further usable CPU (at most `MAX_WORKERS`) and
finalizes the batches in them and in this process at once.

A worker is a fresh interpreter (`python -c`, never a fork of this process, which may
hold threads, and never multiprocessing's spawn, which would run the caller's script
again) that serves batches over two pipes of its own: pickled requests in, pickled
replies out, while its stdout and stderr are this process's. Each batch is finalized by
`local_finalizer`, as in this process, and writes its records part and shard into the
staging directory exactly as a Ray task does; only its `FinalizedBatch` comes back. So
the output is the same, byte for byte, whichever process finalized a batch.

`finalize_pooled` serves any such runners (worker processes here; Ray tasks on a
one-node Ray, `raycap.cluster.finalizer`): batches are taken in order from one iterator
by whichever is free, this process or a thread per runner that hands it the next batch
and waits for the reply (the thread only waits). The driver holds only the batches in
flight and the reports not yet yielded, which come out in batch order. A batch that
fails in a worker raises the exception it raised there (a line that is not JSON is the
same `ResultsError`); a worker that dies, or cannot start, leaves its batches to this
process (`_WorkerLost`, a warning). When the run stops, for whatever reason, the workers
are stopped and waited for before the staging directory goes.

This module does not import Ray.
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

from raycap.finalize.batch import FinalizedBatch
from raycap.finalize.results import ResultsBatch, ResultsScan

# Below this much capture, starting a worker (an interpreter and its imports, some
# tenths of a second) costs more than the core it adds.
POOL_MIN_BYTES = 64 << 20
MAX_WORKERS = 8
# Set to a number of processes (1: this one alone) to override the choice.
PROCESSES_ENV = "RAYCAP_LOCAL_PROCESSES"

_HEADER = struct.Struct("<Q")

logger = logging.getLogger(__name__)


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def workers(scan: ResultsScan) -> int:
    """How many worker processes finalize `scan` beside this process (0: this one alone)."""
    wanted = os.environ.get(PROCESSES_ENV, "").strip()
    if wanted:
        try:
            processes = int(wanted)
        except ValueError:
            raise ValueError(f"{PROCESSES_ENV}={wanted!r} is not a number of processes; set it to 1 or more, or unset it") from None
        return max(0, min(processes - 1, len(scan.batches) - 1))
    if scan.capture_bytes < POOL_MIN_BYTES:
        return 0
    return max(0, min(usable_cpus() - 1, MAX_WORKERS, len(scan.batches) - 1))


# --- the wire: length-prefixed pickles ---------------------------------------------------------


def _send(stream: Any, value: Any) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _receive(stream: Any) -> Any:
    """The next value, or EOFError when the other side is gone."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


# --- the worker ---------------------------------------------------------------------------------


def _reply_error(exc: BaseException) -> tuple:
    """An exception as it can cross the pipe: itself when it pickles and unpickles,
    else its type's name and its text."""
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
        return ("raised", data)
    except Exception:  # noqa: BLE001 - sent as text instead
        return ("failed", f"{type(exc).__name__}: {exc}")


def local_finalizer(context: tuple) -> Callable[[ResultsBatch, bytes], FinalizedBatch]:
    """Finalizes a batch in this process, reading the capture directories in place
    (`context`: see `here_context`), as the local executor does."""
    from raycap.capture.store import TokenCaptureStore
    from raycap.finalize.batch import finalize_batch
    from raycap.rows.batch import read_in
    from raycap.rows.local import freeze_local_batch

    paths, labels, label, options, fields, staging = context
    stores = [TokenCaptureStore(path, create=False) for path in paths]

    def here(batch: ResultsBatch, data: bytes) -> FinalizedBatch:
        return finalize_batch(
            data, batch, label=label, labels=labels,
            freeze=lambda ids: freeze_local_batch(paths, ids, options.max_capture_bytes),
            read=lambda k, parts: read_in(stores[k], parts),
            options=options, fields=fields, staging=staging,
        )

    return here


def serve(requests_fd: int, replies_fd: int) -> None:
    """A worker's loop: the run's context first, then batches until its input closes."""
    with os.fdopen(requests_fd, "rb") as requests, os.fdopen(replies_fd, "wb") as replies:
        try:
            here = local_finalizer(_receive(requests))
        except EOFError:
            return
        while True:
            try:
                batch, data = _receive(requests)
            except EOFError:
                return
            try:
                reply: tuple = ("done", here(batch, data))
            except BaseException as exc:  # noqa: BLE001 - the driver raises it
                reply = _reply_error(exc)
            _send(replies, reply)


_WORKER = "import sys; from raycap.finalize.pool import serve; serve(int(sys.argv[1]), int(sys.argv[2]))"


class Runner(Protocol):
    """Finalizes batches somewhere else, one at a time: `run` returns the batch's report
    or raises what finalizing it raised; `stop` ends whatever it still runs."""

    def run(self, batch: ResultsBatch, data: bytes) -> FinalizedBatch: ...

    def stop(self) -> None: ...


class WorkerProcess:
    """A worker process (see the module docstring) and the pipes to it."""

    def __init__(self, context: tuple, label: str) -> None:
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
        env.pop(PROCESSES_ENV, None)
        self.label = label
        requests_read, requests_write = os.pipe()
        replies_read, replies_write = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _WORKER, str(requests_read), str(replies_write)],
                pass_fds=(requests_read, replies_write), env=env, stdin=subprocess.DEVNULL,
            )
        except BaseException:
            for fd in (requests_write, replies_read):
                os.close(fd)
            raise
        finally:
            os.close(requests_read)
            os.close(replies_write)
        self.requests = os.fdopen(requests_write, "wb")
        self.replies = os.fdopen(replies_read, "rb")
        _send(self.requests, context)

    def run(self, batch: ResultsBatch, data: bytes) -> FinalizedBatch:
        try:
            _send(self.requests, (batch, data))
            kind, value = _receive(self.replies)
        except (EOFError, OSError, pickle.UnpicklingError):
            raise self._lost(batch) from None
        if kind == "done":
            return value
        if kind == "raised":
            raise pickle.loads(value)
        raise RuntimeError(
            f"finalizing records {batch.first_index}..{batch.first_index + batch.records - 1} of {self.label} failed "
            f"in a worker process ({value}); nothing was committed or retired: rerun"
        )

    def _lost(self, batch: ResultsBatch) -> _WorkerLost:
        try:
            code = self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        how = "stopped answering" if code is None else f"exited with code {code}"
        last = batch.first_index + batch.records - 1
        return _WorkerLost(
            f"the worker process finalizing records {batch.first_index}..{last} of {self.label} {how}; nothing was "
            f"committed or retired: rerun (freezing is idempotent), or set {PROCESSES_ENV}=1 to finalize in one process"
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        for stream in (self.requests, self.replies):
            try:
                stream.close()
            except OSError:
                pass
        self.process.wait()


class _WorkerLost(RuntimeError):
    """A worker process that died or stopped answering (not a batch's fault): its batch
    is finalized by this process instead."""


def finalize_pooled(
    scan: ResultsScan,
    start: Callable[[], list[Runner]],
    here: Callable[[ResultsBatch, bytes], FinalizedBatch],
) -> Iterator[FinalizedBatch]:
    """Each batch of `scan` finalized by this process (`here`) or by one of the
    runners `start` gives (worker processes, Ray tasks), whichever is free, reported in
    batch order. A failure raises the exception of the first batch that failed, once
    that batch's turn comes or as soon as this process would wait. A runner that cannot
    be started, or a worker lost, leaves its batches to this process: nothing is lost
    and the output is the same."""
    source = scan.read()
    taking = threading.Lock()
    results: dict[int, tuple[bool, Any]] = {}
    ready = threading.Condition()
    stopping = threading.Event()
    runners: list[Runner] = []
    threads: list[threading.Thread] = []
    returned: deque[tuple[ResultsBatch, bytes]] = deque()  # batches of lost workers

    def settle(index: int, ok: bool, value: Any) -> None:
        with ready:
            results[index] = (ok, value)
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
                stopping.set()
                settle(-1, False, exc)
                return None

    def feed(runner: Runner) -> None:
        while not stopping.is_set():
            item = take()
            if item is None:
                return
            batch, data = item
            try:
                settle(batch.index, True, runner.run(batch, data))
            except _WorkerLost as exc:
                logger.warning("%s; this process finalizes its batches instead", exc)
                with ready:
                    returned.append((batch, data))
                    ready.notify_all()
                return
            except BaseException as exc:  # noqa: BLE001 - the driver raises it
                stopping.set()
                settle(batch.index, False, exc)
                return

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
                batch, data = item
                try:
                    done = here(batch, data)
                except BaseException:
                    stopping.set()
                    raise
                settle(batch.index, True, done)
                continue
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
            runner.stop()
        for thread in threads:
            thread.join()
        source.close()


def _raise_failure(results: dict[int, tuple[bool, Any]]) -> None:
    """Raise the first failure reported so far: the results file's, else the batch's
    that comes first."""
    failed = sorted(index for index, (ok, _) in results.items() if not ok)
    if failed:
        raise results[failed[0]][1]


def worker_processes(count: int, context: tuple, label: str) -> Callable[[], list[Runner]]:
    """Starts `count` worker processes (`context`: what `serve` needs)."""

    def start() -> list[Runner]:
        started: list[Runner] = []
        try:
            for _ in range(count):
                started.append(WorkerProcess(context, label))
        except BaseException:
            for worker in started:
                worker.stop()
            raise
        return started

    return start


def here_context(
    dirs: Sequence[Any], label: str, options: Any, fields: tuple, staging: Any
) -> tuple:
    """What a worker needs to finalize batches as this process does."""
    return ([d.path for d in dirs], [d.label for d in dirs], label, options, fields, staging)
