"""Watching capture directories for freezes: inotify on local file systems.

A freeze replaces a rollout's state file by a rename, so an IN_MOVED_TO event for
`R.tokens.state.json` is the moment it may have become ready. On a local file system
inotify sees every rename, whoever made it; anywhere else (network file systems) the
stream falls back to rescanning (`is_local_file_system` tells which). A watch that
overflows its event queue says so, and the stream rescans.

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
from collections.abc import Sequence

logger = logging.getLogger(__name__)

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
