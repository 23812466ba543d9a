"""Spare files: empty files made between training steps, so a step's freezes rename instead of create.

Freezing a rollout that a writer left as plain JSONL makes two files: its lock file and
its state file's temp file. On ext4 a new file is the dear part of such a freeze. The
kernel searches the directory's block group for a free inode while it holds the
directory's lock, so creations in one directory never run in parallel; and right after
deletions (rollouts retired or removed) each search reads past every inode freed in the
last minutes (see docs/performance.md). A `SparePool` makes such files ahead, while the
trainer trains, and hands a step's batches `Spares`: names of files to rename into place.

- A lock spare becomes `R.tokens.lock` by `renameat2(RENAME_NOREPLACE)`: the name appears
  atomically, or not at all when a lock file is there already (the spare then stays).
- A temp spare is first renamed to a temp name of the freeze's own, then written,
  fsynced and renamed over the state file like any temp file. So a spare is one
  freeze's alone even when two holders were handed the same name: the one whose rename
  fails makes its file as before.

A spare is an empty regular file under a hidden name (`SPARE_PREFIX`), never a rollout's
file: nothing lists, watches or builds it. A lock spare has a lock file's mode, a temp
spare a temp file's. Wherever a spare cannot be used (it is gone, the file system cannot
rename without replacing), the freeze makes its file itself. The pool removes its
spares when the process exits; `TokenCaptureStore.sweep_retired` removes those of a
process that was killed.

This module does not import Ray.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import stat
import sys
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from raycap.capture.files import open_regular, temp_name

logger = logging.getLogger(__name__)

SPARE_PREFIX = ".raycap-spare."
# The most spares of each kind a pool keeps per directory (a step of this many fresh ids
# finds all it needs).
MAX_SPARES = 256

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
# Errors that say this file system (or kernel, or libc) cannot rename without replacing.
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_MODES = {"lock": 0o666, "temp": 0o600}  # as open_capture makes a lock file, and temp_beside a temp file


def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        call = libc.renameat2
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return call


_RENAMEAT2 = _renameat2()


def rename_noreplace(source: str, target: str) -> None:
    """Rename `source` to `target` unless `target` exists (FileExistsError then). Raises
    OSError with errno ENOSYS where this cannot be done atomically."""
    if _RENAMEAT2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), _RENAME_NOREPLACE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), target)


def is_spare(name: str) -> bool:
    return name.startswith(SPARE_PREFIX)


@dataclass
class Spares:
    """Spare files one batch of freezes may use: names in its directory (see the module
    docstring). Sent to a builder task as it is; each name is used at most once."""

    locks: list[str] = field(default_factory=list)
    temps: list[str] = field(default_factory=list)

    def place_lock(self, lock: Path) -> None:
        """Make the lock file `lock` from a spare if there is none there yet; otherwise
        (a lock file exists, no spare is left or it is gone) do nothing: the caller's
        open then finds or makes the lock file as usual."""
        while self.locks:
            spare = os.path.join(lock.parent, self.locks[-1])
            if not _plain_empty(spare):
                self.locks.pop()  # gone, or not a spare this pool made (forged): not used
                continue
            try:
                rename_noreplace(spare, os.fspath(lock))
            except FileExistsError:
                return  # the rollout has its lock file already: the spare is for the next one
            except OSError as exc:
                if exc.errno in _UNSUPPORTED:
                    self.locks.clear()
                    return
                self.locks.pop()
                if exc.errno != errno.ENOENT:
                    return  # the caller's own open reports what is wrong, if anything
                continue  # taken by another holder: try the next spare
            self.locks.pop()
            return

    def claim_temp(self, target: Path) -> tuple[int, str] | None:
        """A temp file beside `target` made from a spare, open for writing, and its path;
        None when no spare could be claimed (make one as usual)."""
        head = os.path.dirname(os.fspath(target))
        while self.temps:
            spare = os.path.join(head, self.temps.pop())
            temp = temp_name(target)
            try:
                os.rename(spare, temp)  # the claim: from here on this file is ours alone
            except OSError:
                continue
            try:
                # A link, a FIFO or a file with content is not a spare this pool made.
                fd = open_regular(temp, os.O_WRONLY, lambda kind: OSError(errno.EINVAL, f"a spare is {kind}"))
            except OSError:
                _unlink(temp)
                continue
            if os.fstat(fd).st_size:
                os.close(fd)
                _unlink(temp)
                continue
            return fd, temp
        return None


def _plain_empty(path: str) -> bool:
    """Whether `path` (not followed) is an empty regular file."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_size == 0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class _Held:
    """The spare files a pool holds, ready or handed out, and whether it is closed: what
    `release` removes, at `SparePool.close`, when the pool is dropped or when the process
    exits (in the process that made them only: a fork's exit must not remove the spares
    its parent still hands out)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.ready: dict[str, list[str]] = {"lock": [], "temp": []}
        self.handed: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.closed = False
        self.owner = os.getpid()

    def release(self) -> None:
        if os.getpid() != self.owner:
            return
        with self.lock:
            self.closed = True
            for name in [*self.ready["lock"], *self.ready["temp"], *(n for _, n in self.handed)]:
                _unlink(os.path.join(self.directory, name))
            self.ready = {"lock": [], "temp": []}
            self.handed = []


class SparePool:
    """Spare files kept ready in one local directory by this process.

    `take(n)` hands out spares for a batch of n fresh rollouts (fewer when the pool has
    fewer) and stops a refill under way; `refill(n)`, after the step, takes back on a
    thread of its own the handed-out spares that are still there and makes new ones
    until it holds, of each kind, as many as the largest step's ids (at most MAX_SPARES).
    Where a spare cannot be made (a read-only or full directory), that refill stops."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._held = held = _Held(directory)
        self._want = 0  # spares of each kind to make now (0 while a step runs)
        self._most = 0  # the most fresh ids a step has had
        self._thread: threading.Thread | None = None
        self._broken = False  # a spare could not be made: this refill stops
        weakref.finalize(self, held.release)

    def take(self, rollouts: int) -> Spares:
        """Spares for a batch of `rollouts` fresh ids. A refill under way stops: the
        step's own freezes are not to wait behind its creations (`refill` after the step)."""
        held = self._held
        with held.lock:
            self._want = 0
            out = Spares()
            for kind, names in (("lock", out.locks), ("temp", out.temps)):
                ready = held.ready[kind]
                names.extend(ready[max(0, len(ready) - rollouts):])
                del ready[max(0, len(ready) - rollouts):]
                held.handed.extend((kind, n) for n in names)
            return out

    def refill(self, rollouts: int) -> None:
        """Start making spares for the next batches of `rollouts` fresh ids (returns at once)."""
        with self._held.lock:
            if self._held.closed:
                return
            self._broken = False  # a full disk, say, may have room again after a step
            self._want = min(max(rollouts, self._most), MAX_SPARES)
            self._most = self._want
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="raycap-spares", daemon=True)
                self._thread.start()

    def settle(self, timeout: float | None = None) -> None:
        """Wait until the refill under way (if any) has finished."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def close(self) -> None:
        """Stop refilling and remove the spares this pool holds."""
        self._held.release()
        self.settle()

    def _run(self) -> None:
        """The refill thread: it ends, under the pool's lock, once nothing is wanted, so
        a `refill` call either finds it still running or starts a new one. A spare made
        after the pool was released is removed again."""
        held = self._held
        try:
            self._take_back()
            while True:
                with held.lock:
                    wanted = not held.closed and not self._broken
                    kind = next((k for k in ("temp", "lock") if len(held.ready[k]) < self._want), None) if wanted else None
                    if kind is None:
                        self._thread = None
                        return
                try:
                    name = self._make(kind)
                except FileExistsError:
                    continue
                except OSError as exc:
                    logger.debug("no spare files in %s: %s", self.directory, exc)
                    with held.lock:
                        self._broken = True
                    continue
                with held.lock:
                    if held.closed:
                        _unlink(os.path.join(self.directory, name))
                    else:
                        held.ready[kind].append(name)
        except BaseException:
            with held.lock:
                self._thread = None
            raise

    def _make(self, kind: str) -> str:
        name = f"{SPARE_PREFIX}{kind}.{os.urandom(8).hex()}"
        os.close(os.open(os.path.join(self.directory, name), _CREATE, _MODES[kind]))
        return name

    def _take_back(self) -> None:
        """Spares handed out and not used go back to the pool."""
        held = self._held
        with held.lock:
            handed, held.handed = held.handed, []
        kept = [(kind, name) for kind, name in handed if os.path.lexists(os.path.join(self.directory, name))]
        with held.lock:
            if held.closed:
                for _, name in kept:
                    _unlink(os.path.join(self.directory, name))
                return
            for kind, name in kept:
                held.ready[kind].append(name)


def remove_stale(directory: Path, cutoff: float) -> int:
    """Remove the spare files in `directory` last changed before `cutoff` (a time): the
    leftovers of a process that was killed. A process still holding one finds it gone
    and makes its file itself. Returns how many were removed."""
    removed = 0
    with os.scandir(directory) as entries:
        for item in entries:
            if is_spare(item.name):
                try:
                    if item.stat(follow_symlinks=False).st_mtime < cutoff:
                        os.unlink(item.path)
                        removed += 1
                except OSError:
                    continue
    return removed
