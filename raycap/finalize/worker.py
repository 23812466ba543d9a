"""Worker processes of the local executor: batches finalized on further cores.

- Started only when the work pays for a process (`workers`: `POOL_MIN_BYTES`, or
  `FORK_MIN_BYTES` when a fork is safe, and more than one usable CPU), one per further
  CPU up to `MAX_WORKERS`; `raycap.finalize.pool.finalize_pooled` serves them.
- A worker is a fork when that is safe (`can_fork`), else a fresh interpreter
  (`python -c`, never multiprocessing's spawn). A fork points every inherited
  descriptor but its own at /dev/null, writes through its own streams
  (`_own_streams`) and leaves by `os._exit`.
- Requests and replies are pickled over two pipes of its own. Each batch is finalized
  by a `raycap.finalize.pool.LocalRunner` and written into the staging exactly as a Ray
  task writes it, so the output is the same byte for byte, whichever process ran it.
- For a records file drafted during the run, a fork hands each part's lines back in a
  shared slot (`raycap.finalize.shelf`) rather than the driver reading the part back.
- Replies: `ready`, `taken`, `done` or `raised`, `flushed`. A worker that dies, or sends
  or takes nothing for `worker_stall_s`, is killed and `_RunnerLost` with every batch it
  had not finished.

The long form: docs/internals.md ("Local finalize workers"). This module does not import Ray.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from raycap.capture.freezebatch import is_fsync_thread
from raycap.finalize.batch import FinalizedBatch
from raycap.finalize.pool import LocalRunner, Outcome, Runner, _RunnerLost, context_options, only_report
from raycap.finalize.results import ResultsBatch, ResultsScan
from raycap.finalize.shelf import Shelf
from raycap.rows.options import RebuildOptions

logger = logging.getLogger(__name__)

# Below this much capture, starting a fresh interpreter (its imports take most of a
# second of a core) costs more than the core it adds; a fork costs milliseconds.
POOL_MIN_BYTES = 64 << 20
FORK_MIN_BYTES = 16 << 20
MAX_WORKERS = 8
# Set to a number of processes (1: this one alone) to override the choice.
PROCESSES_ENV = "RAYCAP_LOCAL_PROCESSES"

_HEADER = struct.Struct("<Q")
# How long a worker may go without a byte to the driver (a batch computed or written, a
# reply) by default, before it counts as stopped or hung (`RebuildOptions.worker_stall_s`).
WORKER_STALL_S = RebuildOptions.worker_stall_s
_CHUNK = 1 << 20


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def workers(scan: ResultsScan, forks: bool = True) -> int:
    """How many worker processes finalize `scan` beside this process (0: this one alone);
    `forks`: whether the output's staging may be written by forks (see `can_fork`)."""
    wanted = os.environ.get(PROCESSES_ENV, "").strip()
    if wanted:
        try:
            processes = int(wanted)
        except ValueError:
            raise ValueError(f"{PROCESSES_ENV}={wanted!r} is not a number of processes; set it to 1 or more, or unset it") from None
        return max(0, min(processes - 1, len(scan.batches) - 1))
    if scan.capture_bytes < (FORK_MIN_BYTES if forks and can_fork() else POOL_MIN_BYTES):
        return 0
    return max(0, min(usable_cpus() - 1, MAX_WORKERS, len(scan.batches) - 1))


# The Python threads Ray keeps in a driver once it is started: its printer of the workers'
# logs, its listener for their errors, and its collector's trigger. None of them holds a
# lock a worker needs, but for the standard streams' when it prints, which a fork replaces
# (`_own_streams`).
RAY_DRIVER_THREADS = frozenset({"ray_print_logs", "ray_listen_error_messages", "PythonGCThread"})


def can_fork() -> bool:
    """Whether a worker can be a fork of this process (see the module docstring). Its
    output's backend says too: an object store's client keeps native threads and
    descriptors of its own, which a fork has not, so its first write there would crash
    (`staging_written_by_forks`)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    ray = sys.modules.get("ray")
    try:
        started = ray is not None and ray.is_initialized()
        client = started and ray.util.client.ray.is_connected()
    except Exception:  # noqa: BLE001 - a Ray that cannot say is taken as unsafe
        return False
    # Another thread of this process could hold a lock the fork would keep for ever; of a
    # started Ray's driver threads only the streams' matter, and the fork has its own. The
    # freezes' fsync threads, kept once a freeze started them, hold none.
    allowed = RAY_DRIVER_THREADS if started and not client else frozenset()
    others = [t for t in threading.enumerate() if t is not threading.current_thread()]
    return all((t.daemon and t.name in allowed) or is_fsync_thread(t) for t in others)


def _handlers() -> list[logging.Handler]:
    """Every handler of this process's loggers."""
    loggers = [logging.root, *list(logging.Logger.manager.loggerDict.values())]
    return [handler for logger in loggers for handler in getattr(logger, "handlers", ())]


def _logged_to() -> set[int]:
    """The descriptors this process's logging handlers write to: a fork keeps them, so
    what it logs (a torn line it dropped, say) reaches the driver's log files too."""
    found = set()
    for handler in _handlers():
        try:
            found.add(handler.stream.fileno())  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - no stream, or one without a descriptor
            pass
    return found


def _own_streams() -> None:
    """In a fork: standard output and error of its own, on the same descriptors.

    The driver's stream objects come with their locks as they were at the fork, and a
    lock one of the driver's threads held then (Ray's log printer, printing a worker's
    line) would stay held in the fork for ever: its first warning would hang it. Logging
    handlers that wrote to the driver's streams write to the new ones."""
    replaced: dict[int, Any] = {}
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        try:
            new = open(  # noqa: SIM115 - the fork's stream for the rest of its life
                fd, "w", buffering=1, encoding=getattr(old, "encoding", None) or "utf-8",
                errors=getattr(old, "errors", None) or "backslashreplace", closefd=False,
            )
        except (OSError, ValueError):
            continue  # no such descriptor: nothing is written there
        setattr(sys, name, new)
        for driver_stream in (old, getattr(sys, f"__{name}__", None)):
            if driver_stream is not None:
                replaced[id(driver_stream)] = new
    for handler in _handlers():
        if isinstance(handler, logging.StreamHandler) and id(handler.stream) in replaced:
            handler.stream = replaced[id(handler.stream)]  # not setStream: it flushes the old one


# --- the wire: length-prefixed pickles ---------------------------------------------------------


def _framed(value: Any) -> bytes:
    """One message on a pipe: its pickle's length, then the pickle."""
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def _send(stream: Any, value: Any) -> None:
    stream.write(_framed(value))
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


class _Stalled(Exception):
    """The other side took no byte, or gave none, within the stall bound."""


def _wait_for(fd: int, events: int, stall_s: float) -> None:
    poller = select.poll()  # not select(): a driver may hold descriptors past FD_SETSIZE
    poller.register(fd, events)
    if not poller.poll(max(1, int(stall_s * 1000))):
        raise _Stalled


def _send_within(fd: int, value: Any, stall_s: float) -> None:
    """`_send` on the driver's non-blocking request pipe: _Stalled when the worker takes
    no byte for `stall_s` (a stopped worker leaves the pipe full), OSError when it is gone."""
    view = memoryview(_framed(value))
    while view:
        try:
            view = view[os.write(fd, view[:_CHUNK]) :]
        except BlockingIOError:
            _wait_for(fd, select.POLLOUT, stall_s)


def _read_within(fd: int, size: int, stall_s: float) -> bytes:
    chunks, left = [], size
    while left:
        _wait_for(fd, select.POLLIN, stall_s)
        chunk = os.read(fd, min(left, _CHUNK))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _receive_within(fd: int, stall_s: float) -> Any:
    """`_receive` on the driver's reply pipe: _Stalled when no byte comes for `stall_s`."""
    (size,) = _HEADER.unpack(_read_within(fd, _HEADER.size, stall_s))
    return pickle.loads(_read_within(fd, size, stall_s))


# --- the worker's side ----------------------------------------------------------------------------


def _reply(index: int, ok: bool, value: Any) -> tuple:
    """An outcome as it can cross the pipe: an exception as itself when it pickles and
    unpickles, else as its type's name and its text."""
    if ok:
        return ("done", index, value)
    try:
        data = pickle.dumps(value)
        pickle.loads(data)
        return ("raised", index, data)
    except Exception:  # noqa: BLE001 - sent as text instead
        return ("failed", index, f"{type(value).__name__}: {value}")


def serve(requests_fd: int, replies_fd: int, shelf: Shelf | None = None) -> None:
    """A worker's loop: the run's context first, then batches (None: write what is left)
    until its input closes. With a `shelf` (a fork's, for a records file drafted by the
    driver), each part's lines are handed back in it where a slot is free."""
    with os.fdopen(requests_fd, "rb") as requests, os.fdopen(replies_fd, "wb") as replies:
        try:
            runner = LocalRunner(_receive(requests), keep_lines=shelf is not None)
        except EOFError:
            return
        _send(replies, ("ready", -1, None))
        try:
            while True:
                try:
                    request = _receive(requests)
                except EOFError:
                    return
                if request is None:
                    outcomes, end = runner.finish(), ("flushed", -1, None)
                else:
                    outcomes, end = runner.hand(*request), ("taken", request[0].index, None)
                for outcome in outcomes:
                    _send(replies, _reply(*_shelved(outcome, shelf)))
                _send(replies, end)
        finally:
            runner.stop()


def _shelved(outcome: Outcome, shelf: Shelf | None) -> Outcome:
    """A finished batch's outcome with its lines put on `shelf` (its report then names
    the slot), or let go where none is free: the driver reads that part back."""
    index, ok, report = outcome
    if not ok or shelf is None or report.lines is None:
        return outcome
    return index, ok, replace(report, lines=None, handed=shelf.put(report.lines))


_WORKER = "import sys; from raycap.finalize.worker import serve; serve(int(sys.argv[1]), int(sys.argv[2]))"


class _Forked:
    """A forked worker's pid, with the part of `subprocess.Popen` a worker uses. Its
    feeding thread and the driver's stop may wait for it at once: the pid is reaped by
    one of them, under a lock, and both read the same exit code."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._reaping = threading.Lock()

    def _reap(self, flags: int) -> int | None:
        with self._reaping:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, flags)
                except ChildProcessError:
                    # Reaped already by the system: the caller ignores SIGCHLD. Its code is
                    # lost; 0, as subprocess says then.
                    self.returncode = 0
                    return 0
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            return self._reap(0)  # type: ignore[return-value]
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _fork(requests_read: int, replies_write: int, shelf: Shelf | None = None) -> _Forked:
    """A fork of this process that serves batches on the two pipe ends (see the module docstring)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # what this process printed is not printed again by the fork
        except Exception:  # noqa: BLE001 - a closed or odd stream: nothing to repeat
            pass
    gc.freeze()  # the fork's collector leaves this process's objects alone (no finalizer of theirs runs there)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the native threads left are fork-safe
            pid = os.fork()
    except BaseException:
        gc.unfreeze()
        raise
    if pid:
        gc.unfreeze()
        return _Forked(pid)
    code = 1
    try:
        # Every descriptor inherited, but the pipes, the standard output and error and
        # the logging handlers' files, is pointed at /dev/null: the file behind it is let
        # go (the output's lock and Ray's sockets among them), and its number stays taken.
        # This process's objects that wrote there are still in the fork: through a number
        # the fork's own files could get again, their bytes would land in a records part
        # or a state file.
        keep = {1, 2, requests_read, replies_write, *_logged_to()}
        null = os.open(os.devnull, os.O_RDWR)
        for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
            if fd not in keep and fd != null:
                try:
                    os.dup2(null, fd, inheritable=False)
                except OSError:
                    pass  # the listing's own descriptor, closed since
        os.dup2(null, 0)
        os.close(null)
        _own_streams()
        # The driver's own handlers are its code, never the fork's; a signal the driver
        # ignores (a job started in the background ignores SIGINT) the fork ignores too.
        for number, default in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler)):
            if signal.getsignal(number) is not signal.SIG_IGN:
                signal.signal(number, default)
        serve(requests_read, replies_write, shelf)
        code = 0
    except BaseException:  # noqa: BLE001 - the driver sees the pipe close and finalizes the batches itself
        pass
    finally:
        os._exit(code)


# --- the driver's side ---------------------------------------------------------------------------


def _shelf() -> Shelf | None:
    """A shelf for a fork, or None where the memory for one is refused (strict
    overcommit): its parts are then read back, as a fresh interpreter's are."""
    try:
        return Shelf()
    except (OSError, ValueError) as exc:
        logger.info("no shared memory to hand records parts back in (%s); the records file reads them back", exc)
        return None


class WorkerProcess:
    """A worker process (see the module docstring) and the pipes to it: a `Runner`.
    Called with `run`, it finalizes one batch and returns its report. With
    `hand_lines`, a fork hands each part's lines back on a shelf of its own."""

    def __init__(self, context: tuple, label: str, forks: bool = True, hand_lines: bool = False) -> None:
        self.label = label
        self.stall_s = float(context_options(context).worker_stall_s)
        self.unfinished: dict[int, tuple[ResultsBatch, bytes]] = {}
        requests_read, requests_write = os.pipe()
        replies_read, replies_write = os.pipe()
        self.shelf: Shelf | None = None
        try:
            self.process: subprocess.Popen | _Forked
            if forks and can_fork():
                self.shelf = _shelf() if hand_lines else None
                self.process = _fork(requests_read, replies_write, self.shelf)
            else:
                package_root = str(Path(__file__).resolve().parents[2])
                env = dict(os.environ)
                env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
                env.pop(PROCESSES_ENV, None)
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
        # Unbuffered, and the requests' end non-blocking: every wait on the worker is
        # bounded by `stall_s` (`_send_within`, `_receive_within`).
        os.set_blocking(requests_write, False)
        self.requests = os.fdopen(requests_write, "wb", buffering=0)
        self.replies = os.fdopen(replies_read, "rb", buffering=0)
        self._request(context)

    def ready(self) -> None:
        self._replies_until("ready", -1)

    def hand(self, batch: ResultsBatch, data: bytes) -> list[Outcome]:
        self.unfinished[batch.index] = (batch, data)
        self._request((batch, data))
        return self._replies_until("taken", batch.index)

    def finish(self) -> list[Outcome]:
        if not self.unfinished:
            return []
        self._request(None)
        return self._replies_until("flushed", -1)

    def run(self, batch: ResultsBatch, data: bytes) -> FinalizedBatch:
        return only_report(batch, [*self.hand(batch, data), *self.finish()])

    def _request(self, request: Any) -> None:
        try:
            _send_within(self.requests.fileno(), request, self.stall_s)
        except OSError:
            raise self._lost() from None
        except _Stalled:
            raise self._stalled() from None

    def _replies_until(self, kind: str, index: int) -> list[Outcome]:
        """The outcomes the worker reports up to its reply `kind` for `index` (a batch
        that fails to compute ends `taken` too)."""
        outcomes: list[Outcome] = []
        while True:
            try:
                what, at, value = _receive_within(self.replies.fileno(), self.stall_s)
            except (EOFError, OSError, pickle.UnpicklingError):
                raise self._lost() from None
            except _Stalled:
                raise self._stalled() from None
            if what == kind and at == index:
                return outcomes
            if what == "ready":
                continue  # it started (asked for by `ready`; a caller that hands at once skips it)
            batch, _ = self.unfinished.pop(at)
            outcomes.append((at, *self._outcome(what, batch, value)))

    def _outcome(self, what: str, batch: ResultsBatch, value: Any) -> tuple[bool, Any]:
        if what == "done":
            if value.handed is not None and self.shelf is not None:
                value = replace(value, lines=self.shelf.taken(*value.handed), handed=None)
            return True, value
        if what == "raised":
            return False, pickle.loads(value)
        return False, RuntimeError(
            f"finalizing records {batch.first_index}..{batch.first_index + batch.records - 1} of {self.label} failed "
            f"in a worker process ({value}); nothing was committed or retired: rerun"
        )

    def _lost(self) -> _RunnerLost:
        try:
            code = self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        how = "stopped answering" if code is None else f"exited with code {code}"
        batches, records = self._unfinished()
        return _RunnerLost(
            f"the worker process finalizing{records} {self.label} {how}; nothing was committed or retired: rerun "
            f"(freezing is idempotent), or set {PROCESSES_ENV}=1 to finalize in one process",
            batches,
        )

    def _stalled(self) -> _RunnerLost:
        """A worker that sent nothing for `stall_s` (stopped, or hung on a read): killed,
        so it cannot write into the staging once its batches are finalized again."""
        self.process.kill()
        self.process.wait()
        batches, records = self._unfinished()
        return _RunnerLost(
            f"the worker process {self.process.pid} finalizing{records} {self.label} made no progress for "
            f"{self.stall_s:g} s (stopped, or hung) and was killed (worker_stall_s bounds the wait)",
            batches,
        )

    def _unfinished(self) -> tuple[list[tuple[ResultsBatch, bytes]], str]:
        """The batches the worker had not finished, taken from it, and their records as words."""
        batches = sorted(self.unfinished.values(), key=lambda item: item[0].index)
        self.unfinished.clear()
        records = ""
        if batches:
            first, last = batches[0][0], batches[-1][0]
            records = f" records {first.first_index}..{last.first_index + last.records - 1} of"
        return batches, records

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        for stream in (self.requests, self.replies):
            try:
                stream.close()
            except OSError:
                pass
        self.process.wait()


def worker_processes(
    count: int, context: tuple, label: str, forks: bool = True, hand_lines: bool = False
) -> Callable[[], list[Runner]]:
    """Starts `count` worker processes (`context`: what `serve` needs; `forks`: whether
    they may be forks, as for `workers`; `hand_lines`: forks hand back each part's
    lines, for a records file drafted by this process)."""

    def start() -> list[Runner]:
        started: list[Runner] = []
        try:
            for _ in range(count):
                started.append(WorkerProcess(context, label, forks, hand_lines))
        except BaseException:
            for worker in started:
                worker.stop()
            raise
        return started

    return start
