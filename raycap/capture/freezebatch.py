"""Freezing many rollouts of one capture directory at once, each as durable as alone.

A freeze replaces the rollout's state file: a temp file beside it, fsynced, renamed over
it, and the directory fsynced before the freeze is handed out (SPEC section 2). One
rollout after another, every freeze waits for its own file system commits, and the next
rollout's new files (its lock file, its temp file) wait behind them. A batch does the
same steps in phases instead, a chunk of rollouts at a time:

1. take each rollout's lock without waiting; freeze it under the lock as `freeze_raw`
   does, but leave its new state in a temp file that is written, not yet fsynced;
2. fsync all those temp files at once, on a thread pool, so the file system commits
   them together;
3. rename each fsynced temp file over its state file (still under the lock), then
   fsync the directory once, and only then release the locks and hand the freezes out.

So every freeze returned is durable, and a crash at any point leaves each state file
old or new and whole (a temp file is renamed only once it is fsynced; a leftover temp
file is hidden and never read). Since the directory is fsynced before the locks are
released, no one can read a frozen state of this batch that could still be lost.

A rollout whose lock is busy is never waited for while the chunk's locks are held (two
batches over the same ids in different orders could otherwise wait on each other for
ever): it is frozen on its own afterwards, holding no other lock. A failure of one
rollout is "<Type>: <message>" in its slot and leaves the others as they are; a failed
directory fsync raises, since then no freeze of the chunk is known to be durable.

This module does not import Ray.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from raycap.capture.files import fsync_dir, temp_beside
from raycap.capture.rolloutfiles import FrozenCapture

# The most rollouts whose locks and temp files one chunk holds open at a time.
CHUNK_ROLLOUTS = 64
# fsyncs only wait on the disk, so more of them than cores overlap usefully.
FSYNC_THREADS = 16


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _fsync(fd: int) -> BaseException | None:
    try:
        os.fsync(fd)
    except OSError as exc:
        return exc
    return None


def freeze_batch(
    store: Any,  # the TokenCaptureStore whose freeze_many this is (not imported: it imports this)
    rollout_ids: list[str],
    *,
    read: bool = True,
    threads: int = 8,
    read_below: int = 0,
    max_bytes: int | None = None,
) -> list[FrozenCapture | str]:
    """`TokenCaptureStore.freeze_many`: the freezes of `rollout_ids` in their order, a
    failure as "<Type>: <message>" in its slot (see the module docstring). `threads`
    is the least number of threads the fsyncs of a chunk share."""
    out: list[FrozenCapture | str | None] = [None] * len(rollout_ids)
    busy: list[int] = []
    for start in range(0, len(rollout_ids), CHUNK_ROLLOUTS):
        positions = range(start, min(start + CHUNK_ROLLOUTS, len(rollout_ids)))
        busy.extend(_chunk(store, rollout_ids, positions, out, read=read, threads=threads, read_below=read_below, max_bytes=max_bytes))
    for i in busy:
        # Another holder had the lock (or the id came twice): frozen alone, with no other
        # lock held while it waits, durable before its lock is released.
        try:
            out[i] = store.freeze_raw(rollout_ids[i], read=read, read_below=read_below, max_bytes=max_bytes)
        except Exception as exc:  # noqa: BLE001 - reported per rollout, never for the batch
            out[i] = _text(exc)
    return out  # type: ignore[return-value] - every slot is filled


def _chunk(
    store: Any,  # the TokenCaptureStore whose freeze_many this is (not imported: it imports this)
    rollout_ids: list[str],
    positions: range,
    out: list[FrozenCapture | str | None],
    *,
    read: bool,
    threads: int,
    read_below: int,
    max_bytes: int | None,
) -> list[int]:
    """Freeze the rollouts at `positions` into `out`; the positions whose locks were busy."""
    busy: list[int] = []
    locks: list[int] = []
    # Position, frozen capture, state path, temp file descriptor and path (None: the
    # state file is current already).
    staged: list[tuple[int, FrozenCapture, Path, int | None, str | None]] = []
    try:
        for i in positions:
            rollout_id = rollout_ids[i]
            try:
                paths = store.paths(rollout_id)
                lock = store._lock(paths, wait=False)
                if lock is None:
                    busy.append(i)
                    continue
                locks.append(lock)
                with store._jsonl(rollout_id, paths, limit=max_bytes) as jsonl:
                    frozen, state = store._freeze_locked(rollout_id, paths, jsonl, read=read, read_below=read_below)
                fd, temp = (None, None) if state is None else temp_beside(paths.state, state.to_json())
            except Exception as exc:  # noqa: BLE001 - reported per rollout, never for the batch
                out[i] = _text(exc)
                continue
            staged.append((i, frozen, paths.state, fd, temp))
        fds = [fd for _, _, _, fd, _ in staged if fd is not None]
        if len(fds) > 1:
            with ThreadPoolExecutor(max_workers=min(len(fds), max(threads, FSYNC_THREADS))) as pool:
                failures = dict(zip(fds, pool.map(_fsync, fds)))
        else:
            failures = {fd: _fsync(fd) for fd in fds}
        for n, (i, frozen, target, fd, temp) in enumerate(staged):
            if fd is None:
                out[i] = frozen
                continue
            os.close(fd)
            staged[n] = (i, frozen, target, None, temp)
            try:
                failure = failures[fd]
                if failure is not None:
                    raise failure
                os.replace(temp, target)
            except OSError as exc:
                Path(temp).unlink(missing_ok=True)
                out[i] = _text(exc)
                continue
            staged[n] = (i, frozen, target, None, None)
            out[i] = frozen
        if staged:
            # Also when no state changed: a state another freeze renamed is durable too
            # before it is handed out again.
            fsync_dir(store.directory)
    finally:
        for _, _, _, fd, temp in staged:
            if fd is not None:
                os.close(fd)
            if temp is not None:
                Path(temp).unlink(missing_ok=True)
        for lock in locks:
            os.close(lock)  # closing the descriptor releases the lock
    return busy
