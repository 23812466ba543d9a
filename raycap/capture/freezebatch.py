"""Freezing many rollouts of one capture directory at once, each as durable as alone.

A freeze replaces the rollout's state file (temp file, fsync, rename, directory fsync:
SPEC section 2). A batch does these steps a chunk at a time, overlapping the waits on
the disk with the caller's work on the frozen bytes: each rollout is frozen under its
lock into a temp file, fsync threads fsync and rename them, the directory is fsynced
once, and only then are the locks released and the freezes handed out.

- Every freeze handed out is durable; a crash leaves each state file old or new, whole.
- A rollout whose lock is busy is never waited for while the chunk's locks are held: it
  is frozen on its own afterwards.
- A failure of one rollout is "<Type>: <message>" in its slot; a failed directory fsync
  raises.

The long form: docs/internals.md ("Freezing in batches"). This module does not import Ray.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from raycap.capture.files import fill_temp, fsync_dir, temp_beside
from raycap.capture.rolloutfiles import FrozenCapture
from raycap.capture.spares import Spares

# The most rollouts whose locks and temp files one chunk holds open at a time.
CHUNK_ROLLOUTS = 64
# fsyncs only wait on the disk, so more of them than cores overlap usefully. The threads
# are kept for the life of the process: a step's batch is too short to start them anew.
FSYNC_THREADS = 16
# Their names' prefix (see `is_fsync_thread`).
FSYNC_THREAD_PREFIX = "raycap-fsync"

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def is_fsync_thread(thread: threading.Thread) -> bool:
    """Whether `thread` is one of the process's fsync threads. They hold no lock a fork
    would need (an fsync, a rename, an unlink at most), and a fork makes its own
    (`_syncer`), so they do not keep a process from forking workers."""
    return thread.name.startswith(f"{FSYNC_THREAD_PREFIX}_")


def _syncer() -> ThreadPoolExecutor:
    """The process's fsync threads (made again in a forked child, which has none)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool, _pool_pid = ThreadPoolExecutor(FSYNC_THREADS, thread_name_prefix=FSYNC_THREAD_PREFIX), os.getpid()
        return _pool


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _commit(fd: int, temp: str, target: Path) -> BaseException | None:
    """fsync a staged state file, then rename it into place; on failure remove it."""
    try:
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, target)
    except BaseException as exc:  # noqa: BLE001 - the rollout's failure, reported in its slot
        Path(temp).unlink(missing_ok=True)
        return exc
    return None


def _commit_all(staged: list[tuple[int, str, Path]]) -> list[BaseException | None]:
    """`_commit` of each staged file in turn: what one fsync thread does."""
    return [_commit(fd, temp, target) for fd, temp, target in staged]


def _committing(staged: list[tuple[int, str, Path]]) -> Future:
    """`_commit_all` on a fsync thread; in this thread when no thread can start any more
    (the interpreter is shutting down)."""
    try:
        return _syncer().submit(_commit_all, staged)
    except RuntimeError:
        done: Future = Future()
        done.set_result(_commit_all(staged))
        return done


class Freezing:
    """The freezes of a batch, made under their locks and becoming durable.

    `frozen` holds each rollout's freeze as made under its lock (its bytes too, when
    read), a failure text, or None for a rollout whose lock was busy (frozen only by
    `finish`). None of it may leave the process before `finish` returns: that waits until
    every freeze is durable, releases the locks, and returns the final list, where a
    freeze whose state file could not be made durable is its failure text."""

    def __init__(
        self, store: Any, rollout_ids: list[str], *, read: bool, read_below: int, max_bytes: int | None,
        spares: Spares | None = None,
    ) -> None:
        self._store, self._ids, self._spares = store, rollout_ids, spares
        self._options = {"read": read, "read_below": read_below, "max_bytes": max_bytes}
        self.frozen: list[FrozenCapture | str | None] = [None] * len(rollout_ids)
        self._busy: list[int] = []
        self._locks: list[int] = []
        self._commits: list[tuple[list[int], Future]] = []
        self._finished: list[FrozenCapture | str] | None = None
        try:
            self._stage(range(len(rollout_ids)))
        except BaseException:
            # Interrupted: what was renamed is made durable, as far as it goes, before
            # the locks let anyone see it; nothing is handed out.
            try:
                self._durable()
            except BaseException:  # noqa: BLE001 - the interruption is what the caller hears of
                pass
            finally:
                self._release()
            raise

    def _stage(self, positions: range) -> None:
        store, ids, spares = self._store, self._ids, self._spares
        staged: list[tuple[int, int, str, Path]] = []
        try:
            for i in positions:
                rollout_id = ids[i]
                try:
                    paths = store.paths(rollout_id)
                    if spares is not None:
                        spares.place_lock(paths.lock)
                    lock = store._lock(paths, wait=False)
                    if lock is None:
                        self._busy.append(i)
                        continue
                    self._locks.append(lock)
                    with store._jsonl(rollout_id, paths, limit=self._options["max_bytes"]) as jsonl:
                        frozen, state = store._freeze_locked(
                            rollout_id, paths, jsonl, read=self._options["read"], read_below=self._options["read_below"]
                        )
                    if state is not None:
                        fd, temp = _temp_file(paths.state, state.to_json(), spares)
                        staged.append((i, fd, temp, paths.state))
                except Exception as exc:  # noqa: BLE001 - reported per rollout, never for the batch
                    self.frozen[i] = _text(exc)
                    continue
                self.frozen[i] = frozen
        finally:
            # The fsyncs and renames start once the chunk's files are all made (also when
            # staging was interrupted): made while earlier ones were being fsynced and
            # renamed, every new file waited on the directory and on the inode blocks
            # those fsyncs were writing (a batch of 64: 50 to 39 ms, see docs/performance.md).
            # One job per fsync thread, not per file: as many fsyncs wait on the disk at
            # once, and a fast disk's batch does not pay for a job's hand-off per file.
            for k in range(min(FSYNC_THREADS, len(staged))):
                share = staged[k::FSYNC_THREADS]
                self._commits.append(([item[0] for item in share], _committing([item[1:] for item in share])))

    def _durable(self) -> None:
        """Wait for the state files, then fsync the directory (the chunk's locks held)."""
        for positions, commit in self._commits:
            for i, failure in zip(positions, commit.result()):
                if failure is not None:
                    self.frozen[i] = _text(failure)
        self._commits = []
        if self._ids:
            # Also when no state changed: a state another freeze renamed is durable too
            # before it is handed out again. And when every freeze failed: a directory
            # that is gone fails the batch as a whole, as one freeze at a time did.
            fsync_dir(self._store.directory)

    def _release(self) -> None:
        for _, commit in self._commits:
            commit.result()  # its file is renamed or removed before the lock goes
        self._commits = []
        for lock in self._locks:
            os.close(lock)  # closing the descriptor releases the lock
        self._locks = []

    @property
    def complete(self) -> bool:
        """Whether every rollout has its freeze or failure already (none was busy)."""
        return not self._busy

    def finish(self) -> list[FrozenCapture | str]:
        """Every freeze, durable (see the class docstring); idempotent."""
        if self._finished is None:
            try:
                self._durable()
            finally:
                self._release()
            for i in self._busy:
                # Another holder had the lock (or the id came twice): frozen alone, with no
                # other lock held while it waits, durable before its lock is released.
                try:
                    self.frozen[i] = self._store.freeze_raw(self._ids[i], **self._options)
                except Exception as exc:  # noqa: BLE001 - reported per rollout, never for the batch
                    self.frozen[i] = _text(exc)
            self._busy = []
            self._finished = list(self.frozen)  # type: ignore[arg-type] - every slot is filled
        return self._finished


def _temp_file(target: Path, data: bytes, spares: Spares | None) -> tuple[int, str]:
    """`temp_beside(target, data)`, made from one of `spares` when there is one."""
    claimed = spares.claim_temp(target) if spares is not None else None
    if claimed is None:
        return temp_beside(target, data)
    return fill_temp(*claimed, data)


def freezing(
    store: Any,  # the TokenCaptureStore (not imported: it imports this)
    rollout_ids: list[str],
    *,
    read: bool = True,
    read_below: int = 0,
    max_bytes: int | None = None,
    spares: Spares | None = None,
) -> Freezing:
    """The freezes of at most CHUNK_ROLLOUTS rollouts, made and becoming durable: use
    their bytes while they do, hand them out only from `Freezing.finish`. With `spares`,
    the lock files and temp files it makes are spare files renamed into place where
    there are spares left (`raycap.capture.spares`)."""
    if len(rollout_ids) > CHUNK_ROLLOUTS:
        raise ValueError(f"a Freezing holds at most {CHUNK_ROLLOUTS} rollouts' locks, not {len(rollout_ids)}; use freeze_batch")
    return Freezing(store, rollout_ids, read=read, read_below=read_below, max_bytes=max_bytes, spares=spares)


def freeze_batch(
    store: Any,  # the TokenCaptureStore whose freeze_many this is (not imported: it imports this)
    rollout_ids: list[str],
    *,
    read: bool = True,
    read_below: int = 0,
    max_bytes: int | None = None,
    spares: Spares | None = None,
) -> list[FrozenCapture | str]:
    """`TokenCaptureStore.freeze_many`: the freezes of `rollout_ids` in their order, a
    failure as "<Type>: <message>" in its slot (see the module docstring)."""
    out: list[FrozenCapture | str] = []
    for start in range(0, len(rollout_ids), CHUNK_ROLLOUTS):
        chunk = rollout_ids[start : start + CHUNK_ROLLOUTS]
        out.extend(Freezing(store, chunk, read=read, read_below=read_below, max_bytes=max_bytes, spares=spares).finish())
    return out
