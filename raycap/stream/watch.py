"""Watching capture directories for freezes: inotify on local file systems.

A freeze replaces a rollout's state file by a rename, so an IN_MOVED_TO event for
`R.tokens.state.json` is the moment it may have become ready. On a local file system
inotify sees every rename, whoever made it; anywhere else (network file systems) the
stream falls back to rescanning (`is_local_file_system` tells which). A watch that
overflows its event queue says so, and the stream rescans.

`Watch` runs these rules for a stream's directories, wherever its file work runs (the
stream's process, or a directory's node actor): one thread reports the rollouts whose
state file was renamed into place, and another asks for a rescan only when it must. On
local file systems that is only when the watch asks (its queue overflowed, or it
failed): a rescan reads every name, retired tombstones included, and discovery must not
cost in proportion to the history. On a network file system, where a watch sees only
this machine's renames, it rescans every RESCAN_SECONDS as a safety net; where inotify
is missing, every POLL_SECONDS.

This module does not import Ray.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import select
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

RESCAN_SECONDS = 10.0
POLL_SECONDS = 0.1
_STATE_SUFFIX = ".tokens.state.json"

# File systems whose inotify events include every rename, whoever made it. Anything else
# (nfs, cifs, fuse, lustre, ...) gets the periodic rescan.
LOCAL_FILE_SYSTEMS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "jfs", "reiserfs", "bcachefs"}
)


def is_local_file_system(path: str) -> bool:
    """Whether `path` is on a local file system (its mount's type, from /proc/self/mounts).
    Unknown counts as not local: the cost of a wrong guess is a missed rollout."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as mounts:
            table = [line.split()[1:3] for line in mounts if len(line.split()) >= 3]
    except OSError:
        return False
    real = os.path.realpath(path)
    best, kind = "", None
    for point, fs in table:
        point = point.replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fs
    return kind in LOCAL_FILE_SYSTEMS

_IN_CLOSE_WRITE = 0x00000008
_IN_MOVED_TO = 0x00000080
_IN_Q_OVERFLOW = 0x00004000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")


class Inotify:
    """A Linux inotify watch on plain directories, through libc (no dependency)."""

    def __init__(self, fd: int):
        self.fd = fd

    @classmethod
    def open(cls, paths: Sequence[str]) -> Inotify | None:
        """The watch, or None where inotify is unavailable (then the stream polls)."""
        if not sys.platform.startswith("linux"):
            return None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        except (OSError, AttributeError):
            return None
        if fd < 0:
            return None
        for path in paths:
            if libc.inotify_add_watch(fd, os.fsencode(path), _IN_MOVED_TO | _IN_CLOSE_WRITE) < 0:
                logger.info("cannot watch %s (errno %d); polling it instead", path, ctypes.get_errno())
                os.close(fd)
                return None
        return cls(fd)

    def read(self, timeout: float) -> tuple[list[str], bool]:
        """File names of the events that arrived within `timeout`, and whether the
        kernel's queue overflowed (events were lost: rescan)."""
        readable, _, _ = select.select([self.fd], [], [], timeout)
        if not readable:
            return [], False
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return [], False
        names, overflow, offset = [], False, 0
        while offset + _EVENT.size <= len(data):
            _, mask, _, length = _EVENT.unpack_from(data, offset)
            offset += _EVENT.size
            if mask & _IN_Q_OVERFLOW:
                overflow = True
            name = data[offset : offset + length].split(b"\0", 1)[0]
            offset += length
            if name:
                names.append(os.fsdecode(name))
        return names, overflow

    def close(self) -> None:
        os.close(self.fd)


def state_file_rollout(name: str) -> str | None:
    """The rollout whose state file `name` is (a watch event's file name), or None."""
    from raycap.capture.files import rollout_of_name

    named = rollout_of_name(name, (_STATE_SUFFIX,))
    return None if named is None else named[0]


class Watch:
    """The watch of a stream's directories at `paths` (see the module docstring).

    Made before the caller's first scan, so no freeze falls between the scan and the
    watch; `start` then runs it: `on_rollouts(ids)` gets the rollouts of each batch of
    events, in their order, and `rescan()` is called when the directories must be listed
    again. Both run on the watch's threads and must not raise for one bad file."""

    def __init__(self, paths: Sequence[str], name: str = "raycap-watch") -> None:
        self.paths = list(paths)
        self.name = name
        self.inotify = Inotify.open(self.paths)
        self._rescan_now = threading.Event()
        self._closed = False
        self._threads: list[threading.Thread] = []

    def start(self, on_rollouts: Callable[[list[str]], None], rescan: Callable[[], None]) -> None:
        if self.inotify is not None:
            self._spawn(lambda: self._watch_loop(on_rollouts), f"{self.name}-events")
        self._spawn(lambda: self._rescan_loop(rescan), f"{self.name}-rescan")

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _watch_loop(self, on_rollouts: Callable[[list[str]], None]) -> None:
        """Report each rollout whose state file was renamed into place (a freeze renames
        one); an overflowed event queue asks for a rescan."""
        inotify = self.inotify
        assert inotify is not None
        while not self._closed:
            try:
                names, overflow = inotify.read(timeout=0.5)
                if overflow:
                    self._rescan_now.set()
                ids = [rid for rid in map(state_file_rollout, names) if rid is not None]
                if ids and not self._closed:
                    on_rollouts(list(dict.fromkeys(ids)))
            except Exception as exc:  # noqa: BLE001 - the watch must outlive one bad file
                logger.warning("watching %s failed once (%s); rescanning", ", ".join(self.paths), exc)
                self._rescan_now.set()
                time.sleep(POLL_SECONDS)

    def _rescan_loop(self, rescan: Callable[[], None]) -> None:
        """The safety net under the watch, or the whole of it where inotify is missing.
        Its own thread: a rescan of a large directory never delays the watch's events."""
        if self.inotify is None:
            interval: float | None = POLL_SECONDS
        elif all(is_local_file_system(path) for path in self.paths):
            interval = None
        else:
            interval = RESCAN_SECONDS
        while not self._closed:
            self._rescan_now.wait(interval)
            self._rescan_now.clear()
            if self._closed:
                return
            try:
                rescan()
            except Exception as exc:  # noqa: BLE001 - the next rescan tries again
                logger.warning("rescanning %s failed (%s); trying again", ", ".join(self.paths), exc)

    def close(self) -> None:
        self._closed = True
        self._rescan_now.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=30)
        if self.inotify is not None:
            self.inotify.close()
            self.inotify = None
